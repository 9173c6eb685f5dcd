"""The chaos run's clients: tenants submitting, duplicating, conflicting, cancelling and polling
over the HTTP API, every operation recorded in the history as invoke, then ok, fail or info.

ok is a 2xx; fail is a definite refusal (a 4xx: nothing happened, or a replay told us what did);
info is an outcome the client cannot know (a timeout, a reset connection, a 5xx). Idempotency keys
and bodies derive from the seed, so a rerun of a seed sends the same requests."""
from __future__ import annotations

import hashlib
import http.client
import json
import random
import threading
import time
import uuid
from pathlib import Path
from typing import Any

NAMESPACE = uuid.UUID("8f0d5a8e-7f69-4c1f-9b1e-6a3c2d10c4a1")
REQUEST_TIMEOUT_S = 5.0
BODY_SHORT = {"model": "video-model-x", "mode": "text_to_video", "prompt": "a fox in the snow", "duration_seconds": 5, "resolution": "720p"}
BODY_LONG = {**BODY_SHORT, "duration_seconds": 10}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


class History:
    """history.jsonl, appended under one lock: `i` is the order of recording."""

    def __init__(self, path: Path, t0: float):
        self.path, self.t0 = path, t0
        self._f = path.open("a", buffering=1)
        self._lock = threading.Lock()
        self._i = 0
        self.counts: dict[str, int] = {}

    def record(self, **op: Any) -> None:
        with self._lock:
            self._i += 1
            line = {"i": self._i, "t": round(time.monotonic() - self.t0, 4), **op}
            self._f.write(json.dumps(line) + "\n")
            key = f"{op['f']}:{op['type']}"
            self.counts[key] = self.counts.get(key, 0) + 1

    def close(self) -> None:
        with self._lock:
            self._f.close()


class Client:
    """One client process of the history: one keep-alive connection, one operation at a time."""

    def __init__(self, name: str, port: int, history: History):
        self.name, self.port, self.history = name, port, history
        self._conn: http.client.HTTPConnection | None = None

    def _request(self, method: str, path: str, api_key: str, body: bytes | None, key: str | None) -> tuple[int, bytes]:
        if self._conn is None:
            self._conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        if key:
            headers["Idempotency-Key"] = key
        try:
            self._conn.request(method, path, body=body, headers=headers)
            r = self._conn.getresponse()
            return r.status, r.read()
        except BaseException:
            self._conn.close()
            self._conn = None
            raise

    def op(self, f: str, tenant: str, api_key: str, method: str, path: str, *, body: dict | None = None,
           key: str | None = None, task_id: str | None = None) -> dict[str, Any]:
        raw = json.dumps(body, sort_keys=True).encode() if body is not None else None
        common = {"process": self.name, "f": f, "tenant": tenant, "key": key, "body": raw and sha(raw), "task_id": task_id}
        self.history.record(type="invoke", value=None, **common)
        try:
            status, data = self._request(method, path, api_key, raw, key)
        except Exception as e:  # noqa: BLE001 - any failure to hear back is an unknown outcome
            value = {"status": None, "decision": None, "task_id": None, "state": None, "code": type(e).__name__, "response": None}
            self.history.record(type="info", value=value, **common)
            return value
        try:
            doc = json.loads(data or b"{}")
        except ValueError:
            doc = {}
        doc = doc if isinstance(doc, dict) else {}
        err = doc.get("error") if isinstance(doc.get("error"), dict) else {}
        value = {"status": status, "decision": doc.get("decision"), "task_id": doc.get("task_id"), "state": doc.get("state"),
                 "code": err.get("code") or doc.get("code"), "response": sha(data)}
        kind = "ok" if 200 <= status < 300 else "fail" if 400 <= status < 500 else "info"
        self.history.record(type=kind, value=value, **common)
        return value


class Workload:
    """A submitter per tenant at its rate, a canceller and a poller, until stop()."""

    def __init__(self, plan: dict[str, Any], tenants: dict[str, dict[str, Any]], port: int, history: History):
        self.plan, self.tenants, self.port, self.history = plan, tenants, port, history
        self.w = plan["workload"]
        self.stop_event = threading.Event()
        self.accepted: dict[str, tuple[str, str]] = {}  # task_id -> (tenant, api key)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> "Workload":
        seed = self.plan["seeds"]["workload"]
        for n, t in enumerate(self.plan["tenants"]):
            rng = random.Random(seed + n)
            self._threads.append(threading.Thread(target=self._submitter, args=(t, rng, n), name=f"chaos-submit-{n}", daemon=True))
        self._threads.append(threading.Thread(target=self._poller, args=(random.Random(seed + 101),), name="chaos-poll", daemon=True))
        for th in self._threads:
            th.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        for th in self._threads:
            th.join(REQUEST_TIMEOUT_S * 3)

    def _note(self, tenant: str, api_key: str, v: dict[str, Any]) -> None:
        if v.get("task_id") and v.get("status") in (200, 201, 202):
            with self._lock:
                self.accepted[v["task_id"]] = (tenant, api_key)

    def _submitter(self, t: dict[str, Any], rng: random.Random, n: int) -> None:
        name = t["name"]
        api_key = self.tenants[name]["api_key"]
        client = Client(f"client-{n}", self.port, self.history)
        sent: list[tuple[str, dict]] = []
        i = 0
        rate = t["rate_per_s"] * self.w["rate_factor"]
        while not self.stop_event.wait(rng.expovariate(rate)):
            x = rng.random()
            if sent and x < self.w["duplicate_rate"]:
                key, body = rng.choice(sent)  # the same request again: one task, the same answer
                if self.w["racing_duplicates"]:
                    self._race(n, name, api_key, key, body)
                    continue
            elif sent and x < self.w["duplicate_rate"] + self.w["conflict_rate"]:
                key, body = rng.choice(sent)
                body = {**body, "prompt": body["prompt"] + " (changed)"}  # a different body under a used key: 422
            else:
                i += 1
                key = uuid.uuid5(NAMESPACE, f"{self.plan['seed']}:{name}:{i}").hex
                body = dict(BODY_LONG if rng.random() < self.w["long_rate"] else BODY_SHORT)
                sent.append((key, body))
                if self.w["racing_duplicates"] and rng.random() < self.w["duplicate_rate"]:
                    self._race(n, name, api_key, key, body)
                    continue
            v = client.op("submit", name, api_key, "POST", "/v1/generations", body=body, key=key)
            self._note(name, api_key, v)
            if v.get("task_id") and rng.random() < self.w["cancel_rate"]:
                c = client.op("cancel", name, api_key, "POST", f"/v1/generations/{v['task_id']}/cancel", task_id=v["task_id"])
                del c

    def _race(self, n: int, name: str, api_key: str, key: str, body: dict) -> None:
        """Two clients send one key at the same instant (the idempotency lock's case)."""
        barrier = threading.Barrier(2)

        def one(j: int) -> None:
            c = Client(f"client-{n}-race-{j}", self.port, self.history)
            barrier.wait()
            self._note(name, api_key, c.op("submit", name, api_key, "POST", "/v1/generations", body=body, key=key))

        ths = [threading.Thread(target=one, args=(j,), daemon=True) for j in (0, 1)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(REQUEST_TIMEOUT_S * 2)

    def _poller(self, rng: random.Random) -> None:
        client = Client("client-poll", self.port, self.history)
        while not self.stop_event.wait(0.05):
            with self._lock:
                ids = list(self.accepted.items())
            if ids:
                task_id, (tenant, api_key) = rng.choice(ids)
                client.op("get", tenant, api_key, "GET", f"/v1/generations/{task_id}", task_id=task_id)

    def read_all(self) -> int:
        """After the run settles: one last read of every task a client knows of."""
        client = Client("client-final", self.port, self.history)
        with self._lock:
            ids = list(self.accepted.items())
        for task_id, (tenant, api_key) in ids:
            client.op("get", tenant, api_key, "GET", f"/v1/generations/{task_id}", task_id=task_id)
        return len(ids)
