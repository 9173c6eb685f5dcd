"""A small HTTP load generator: closed-loop for sustained throughput, open-loop at a fixed rate
for latency percentiles. Client processes with keep-alive connections, bounded in time and count,
aimed only at loopback servers this run started."""
from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import time
import uuid
from typing import Callable
from urllib.parse import urlsplit


def _conn(base_url: str) -> http.client.HTTPConnection:
    u = urlsplit(base_url)
    assert u.hostname in ("127.0.0.1", "localhost", "::1"), "bench traffic stays on loopback"
    return http.client.HTTPConnection(u.hostname, u.port, timeout=30)


def _post(conn, path: str, body: bytes, headers: dict) -> int:
    conn.request("POST", path, body=body, headers=headers)
    resp = conn.getresponse()
    resp.read()
    return resp.status


def _client(base_urls: list[str], keys: list[str], body: bytes, seconds: float, rate: float | None, seed: int, out: mp.Queue) -> None:
    """One client process: one connection per base URL it rotates through; closed loop when rate is None."""
    conns = [_conn(u) for u in base_urls]
    statuses: dict[int, int] = {}
    latencies: list[float] = []
    end = time.monotonic() + seconds
    i = 0
    next_at = time.monotonic()
    while time.monotonic() < end:
        if rate:
            now = time.monotonic()
            if now < next_at:
                time.sleep(next_at - now)
            next_at += 1.0 / rate
        k = (seed + i) % len(conns)
        headers = {"Authorization": f"Bearer {keys[(seed + i) % len(keys)]}", "Content-Type": "application/json",
                   "Idempotency-Key": f"bench-{seed}-{i}-{uuid.uuid4().hex[:8]}"}
        t0 = time.perf_counter()
        try:
            st = _post(conns[k], "/v1/generations", body, headers)
        except (OSError, http.client.HTTPException):
            st = 0
            conns[k] = _conn(base_urls[k])
        latencies.append(time.perf_counter() - t0)
        statuses[st] = statuses.get(st, 0) + 1
        i += 1
    out.put({"statuses": statuses, "latencies": latencies})


def run_load(base_urls: list[str], keys: list[str], body: dict, *, clients: int, seconds: float, rate_total: float | None = None) -> dict:
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    raw = json.dumps(body).encode()
    per_client = rate_total / clients if rate_total else None
    procs = [ctx.Process(target=_client, args=(base_urls, keys, raw, seconds, per_client, n * 7919, q)) for n in range(clients)]
    for p in procs:
        p.start()
    results = [q.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    statuses: dict[str, int] = {}
    lat: list[float] = []
    for r in results:
        for st, n in r["statuses"].items():
            statuses[str(st)] = statuses.get(str(st), 0) + n
        lat += r["latencies"]
    lat.sort()

    def pct(p: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 2) if lat else None

    ok = statuses.get("202", 0)
    return {"requests": len(lat), "accepted": ok, "statuses": statuses, "seconds": seconds,
            "accepted_per_second": round(ok / seconds, 1), "p50_ms": pct(0.50), "p99_ms": pct(0.99)}


__all__ = ["run_load", "Callable"]
