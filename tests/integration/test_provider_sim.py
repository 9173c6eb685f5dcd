"""The HTTP adapter against the provider simulator, over real sockets: idempotency, concurrency
limits and 429s, final rejections, accept-then-timeout resolved by key, the exact shapes of the
contract, webhooks (signed, dropped, duplicated, retried), invoices, the MP4 outputs, and the
simulator's ground truth. Time is compressed (time_scale) so the whole module runs in seconds."""
import io
import json
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import av
import httpx
import pytest

from aivedio.config import PlatformConfig, ProviderAccount, ProviderConfig, SimulatorBehaviour
from aivedio.providers.adapter import (Accepted, HttpProviderAdapter, NotAcceptedRetryable, RejectedFinal, SubmitRequest,
                                       Unknown, build_adapters)
from aivedio_tools.provider_sim import SimulatorServer, start_simulators
from aivedio.providers.webhooks import verify_webhook
from tests.waiting import wait_for as wait_until

AMOUNT = re.compile(r"^-?\d+\.\d{4}$")
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")
FAST = dict(queue_seconds_min=0.0, queue_seconds_max=0.0, latency_seconds_min=1.0, latency_seconds_max=2.0, failure_rate=0.0)
SLOW = dict(queue_seconds_min=0.0, queue_seconds_max=0.0, latency_seconds_min=10_000.0, latency_seconds_max=10_000.0,
            failure_rate=0.0)
SCALE = 100.0  # one platform second is 10 ms
WEBHOOK_SECRET = "whsec_c2ltLXRlc3Qtc2VjcmV0"


def provider(max_concurrency=50, timeout=2.0, accounts=None, **behaviour) -> ProviderConfig:
    return ProviderConfig(
        name="sim-test", submit_timeout_seconds=timeout, webhook_secret=WEBHOOK_SECRET,  # one secret for every call
        accounts=accounts or [ProviderAccount(account_id="acct-1", api_key="key-1", max_concurrency=max_concurrency)],
        simulator=SimulatorBehaviour(**{**FAST, **behaviour}),
    )


@pytest.fixture
def sim():
    started: list[SimulatorServer] = []
    adapters: list[HttpProviderAdapter] = []

    def make(cfg: ProviderConfig, time_scale: float = SCALE):
        s = SimulatorServer(cfg, cfg.simulator, time_scale, port=0).start()
        a = HttpProviderAdapter(cfg, s.base_url)
        started.append(s)
        adapters.append(a)
        return s, a

    yield make
    for a in adapters:
        a.close()
    for s in started:
        s.stop()


def req(n: int | str = 1, callback_url=None, **kw) -> SubmitRequest:
    doc = dict(model="video-model-x", prompt="a cat on a skateboard", duration_seconds=4, resolution="720p",
               client_request_id=f"crid-{n}", callback_url=callback_url)
    doc.update(kw)
    return SubmitRequest(**doc)


def jobs_with_key(s: SimulatorServer, key: str) -> list[dict]:
    return [j for j in s.truth["jobs"] if j["idempotency_key"] == key]


_client = httpx.Client(timeout=5)  # one client: making one costs ~50 ms (its TLS context)


def http(s: SimulatorServer, method: str, path: str, key: str | None = "key-1", **kw) -> httpx.Response:
    headers = kw.pop("headers", {})
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return _client.request(method, s.base_url + path, headers=headers, **kw)


# --- submit ---------------------------------------------------------------------------------------------

def test_the_same_key_returns_the_same_job_and_creates_one(sim):
    s, a = sim(provider(**SLOW))
    first = a.submit("acct-1", "key-same", req(1))
    again = a.submit("acct-1", "key-same", req(1))
    other_body = a.submit("acct-1", "key-same", req(2, prompt="something else"))
    assert isinstance(first, Accepted) and first.raw.status == 201 and not first.replayed
    for out in (again, other_body):
        assert isinstance(out, Accepted) and out.raw.status == 200 and out.replayed and out.job_id == first.job_id
        assert json.loads(out.raw.body) == json.loads(first.raw.body)  # the original answer
    [job] = jobs_with_key(s, "key-same")
    assert job["id"] == first.job_id and job["submit_requests"] == 3 and job["client_request_id"] == "crid-1"


def test_concurrent_submits_of_one_key_create_one_job(sim):
    s, a = sim(provider(**SLOW))
    with ThreadPoolExecutor(20) as pool:
        outs = list(pool.map(lambda _: a.submit("acct-1", "key-race", req()), range(20)))
    assert {o.job_id for o in outs} == {outs[0].job_id} and all(isinstance(o, Accepted) for o in outs)
    assert Counter(o.raw.status for o in outs) == {201: 1, 200: 19}
    assert len(jobs_with_key(s, "key-race")) == 1 and len(s.truth["jobs"]) == 1


def test_429_at_max_concurrency_with_retry_after_and_nothing_created(sim):
    s, a = sim(provider(max_concurrency=3, retry_after_seconds=7, **SLOW))
    ids = [a.submit("acct-1", f"k{i}", req(i)).job_id for i in range(3)]
    out = a.submit("acct-1", "k3", req(3))
    assert isinstance(out, NotAcceptedRetryable) and out.reason == "rate_limited"
    assert out.retry_after_seconds == 7 and out.raw.status == 429 and out.raw.headers["retry-after"] == "7"
    assert jobs_with_key(s, "k3") == [] and len(s.truth["jobs"]) == 3
    assert a.find_by_key("acct-1", idempotency_key="k3").items == []
    # A replay of an existing key is not a new job: it is answered, not refused.
    assert isinstance(a.submit("acct-1", "k0", req(0)), Accepted)
    # Cancelling frees a slot.
    assert a.cancel("acct-1", ids[0]).status == "cancelled"
    assert isinstance(a.submit("acct-1", "k3", req(3)), Accepted)
    assert s.truth["accounts"]["acct-1"] == {"max_concurrency": 3, "current": 3, "peak": 3}


def test_429_bursts_refuse_every_new_job_on_the_account_for_their_length(sim):
    s, a = sim(provider(burst_429_rate=1.0, burst_429_seconds=120))
    outs = [a.submit("acct-1", f"b{i}", req(i)) for i in range(5)]
    assert all(isinstance(o, NotAcceptedRetryable) for o in outs)
    # Retry-After is what is left of the burst; time is compressed, so a slow machine eats into it.
    assert all(0 < o.retry_after_seconds <= 120 for o in outs)
    assert s.truth["jobs"] == [] and s.truth["submits"]["burst_rate_limited"] == 5


@pytest.mark.parametrize("request_kw, status, code", [
    (dict(model="no-such-model"), 422, "UNSUPPORTED_MODEL"),
    (dict(duration_seconds=61), 422, "UNSUPPORTED_DURATION"),
    (dict(duration_seconds=0), 422, "UNSUPPORTED_DURATION"),
    (dict(resolution="8k"), 422, "UNSUPPORTED_RESOLUTION"),
    (dict(prompt="   "), 422, "EMPTY_PROMPT"),
    (dict(prompt=None), 400, "MISSING_FIELD"),
    (dict(with_audio="yes"), 400, "INVALID_FIELD"),
    (dict(client_request_id=""), 400, "INVALID_FIELD"),
    (dict(callback_url="ftp://x"), 400, "INVALID_FIELD"),
])
def test_400_and_422_are_final_and_create_nothing(sim, request_kw, status, code):
    s, a = sim(provider())
    out = a.submit("acct-1", "key-bad", req(**request_kw))
    assert isinstance(out, RejectedFinal) and out.raw.status == status and out.code == code
    assert s.truth["jobs"] == []
    # The refusal did not burn the key: a valid request with it creates the job.
    assert isinstance(a.submit("acct-1", "key-bad", req()), Accepted) and len(jobs_with_key(s, "key-bad")) == 1


def test_malformed_requests_and_bad_credentials(sim):
    s, _ = sim(provider())
    body = req().body()
    assert http(s, "POST", "/v1/jobs", json=body).status_code == 400  # no Idempotency-Key
    r = http(s, "POST", "/v1/jobs", content=b"{not json", headers={"Idempotency-Key": "k"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "INVALID_JSON"
    for key in (None, "wrong-key"):
        r = http(s, "POST", "/v1/jobs", key=key, json=body, headers={"Idempotency-Key": "k"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "UNAUTHENTICATED"
    assert http(s, "GET", "/v1/meta", key="wrong-key").status_code == 401
    assert s.truth["jobs"] == []


@pytest.mark.parametrize("mode, reason", [("drop", "connection_dropped"), ("delay", "timeout")])
def test_accept_then_timeout_is_unknown_and_then_found_by_key(sim, mode, reason):
    s, a = sim(provider(timeout=0.3, accept_then_timeout_rate=1.0, accept_then_timeout_mode=mode, **SLOW))
    out = a.submit("acct-1", "key-lost", req(7))
    assert isinstance(out, Unknown) and out.reason == reason and out.raw.status is None
    [created] = jobs_with_key(s, "key-lost")
    assert created["created_by"] == f"accept_then_timeout:{mode}"
    found = a.find_by_key("acct-1", idempotency_key="key-lost")
    assert [j.id for j in found.items] == [created["id"]] and not found.proves_absent(0)
    assert [j.id for j in a.find_by_key("acct-1", client_request_id="crid-7").items] == [created["id"]]
    # A retry with the same key adopts the job; it is never a second one.
    retry = a.submit("acct-1", "key-lost", req(7))
    assert isinstance(retry, Accepted) and retry.replayed and retry.job_id == created["id"]
    assert len(jobs_with_key(s, "key-lost")) == 1


def test_5xx_is_unknown_whether_or_not_the_job_was_created(sim):
    s, a = sim(provider(server_error_rate=1.0, **SLOW))
    outs = {f"e{i}": a.submit("acct-1", f"e{i}", req(i)) for i in range(12)}
    assert all(isinstance(o, Unknown) and o.reason == "http_5xx" for o in outs.values())
    created = {j["idempotency_key"] for j in s.truth["jobs"]}
    assert 0 < len(created) < 12  # some before creating the job, some after
    for key in outs:
        found = a.find_by_key("acct-1", idempotency_key=key)
        assert bool(found.items) == (key in created)
        assert found.proves_absent(1) == (key not in created)


def test_keys_past_the_idempotency_window_are_forgotten(sim):
    s, a = sim(provider(idempotency_window_seconds=20, **SLOW))  # 0.2 s real
    first = a.submit("acct-1", "key-old", req())
    assert a.meta().idempotency_window_seconds == 20
    time.sleep(0.3)
    found = a.find_by_key("acct-1", idempotency_key="key-old")
    assert found.items == [] and not found.proves_absent(30)  # past the window, empty proves nothing
    second = a.submit("acct-1", "key-old", req())
    assert isinstance(second, Accepted) and second.raw.status == 201 and second.job_id != first.job_id
    assert len(jobs_with_key(s, "key-old")) == 2


# --- shapes of the contract ---------------------------------------------------------------------------

def test_get_shapes_through_the_lifecycle(sim):
    s, a = sim(provider(queue_seconds_min=30, queue_seconds_max=30, latency_seconds_min=30, latency_seconds_max=30,
                        cost_per_second="0.1050"))
    job_id = a.submit("acct-1", "key-shape", req(duration_seconds=4)).job_id
    queued = http(s, "GET", f"/v1/jobs/{job_id}").json()
    assert set(queued) == {"id", "status", "created_at"} and queued["status"] == "queued" and ISO.match(queued["created_at"])
    wait_until(lambda: a.get("acct-1", job_id).status == "running")
    assert set(http(s, "GET", f"/v1/jobs/{job_id}").json()) == {"id", "status", "created_at"}
    wait_until(lambda: a.get("acct-1", job_id).terminal)
    done = http(s, "GET", f"/v1/jobs/{job_id}").json()
    assert set(done) == {"id", "status", "created_at", "finished_at", "output_url", "usage", "charge_id"}
    assert done["status"] == "succeeded" and ISO.match(done["finished_at"])
    assert done["usage"] == {"seconds": 4, "cost_amount": "0.4200", "currency": "USD"}
    job = a.get("acct-1", job_id)
    assert job.usage.cost_amount == Decimal("0.4200") and job.charge_id == done["charge_id"]
    assert job.output_url == f"{s.base_url}/v1/outputs/{job_id}.mp4"
    assert http(s, "GET", "/v1/jobs/job_nope").status_code == 404 and a.get("acct-1", "job_nope") is None
    found = http(s, "GET", "/v1/jobs", params={"idempotency_key": "key-shape"}).json()
    assert found == {"items": [done]}
    assert http(s, "GET", "/v1/jobs", params={"client_request_id": "crid-nope"}).json() == {"items": []}


def test_failed_jobs_and_failed_but_charged_jobs(sim):
    s, a = sim(provider(failure_rate=1.0, failed_but_charged_rate=0.5, credit_note_rate=1.0))
    ids = [a.submit("acct-1", f"f{i}", req(i)).job_id for i in range(12)]
    wait_until(lambda: all(a.get("acct-1", i).terminal for i in ids))
    docs = [http(s, "GET", f"/v1/jobs/{i}").json() for i in ids]
    assert all(d["status"] == "failed" and set(d["error"]) == {"code", "message"} and "output_url" not in d for d in docs)
    charged = [d for d in docs if "charge_id" in d]
    free = [d for d in docs if "charge_id" not in d]
    assert charged and free
    assert all(d["usage"]["cost_amount"] == "0.2000" for d in charged)
    assert all(d["usage"]["cost_amount"] == "0.0000" for d in free)
    lines = s.truth["invoice_lines"]
    assert {ln["charge_id"] for ln in lines} == {d["charge_id"] for d in charged}
    assert Counter(ln["type"] for ln in lines) == {"charge": len(charged), "credit_note": len(charged)}


def test_cancel_by_stage(sim):
    s, a = sim(provider(queue_seconds_min=10_000, queue_seconds_max=10_000, cancellation_fee="0.0700"))
    queued = a.submit("acct-1", "c-queued", req(1)).job_id
    r = http(s, "POST", f"/v1/jobs/{queued}/cancel")
    assert r.status_code == 200 and r.json() == {"id": queued, "status": "cancelled"}
    doc = a.get("acct-1", queued)
    assert doc.status == "cancelled" and doc.usage.cost_amount == Decimal("0") and doc.charge_id is None

    s2, a2 = sim(provider(cancellation_fee="0.0700", **SLOW))
    running = a2.submit("acct-1", "c-running", req(2)).job_id
    wait_until(lambda: a2.get("acct-1", running).status == "running")
    assert a2.cancel("acct-1", running).status == "cancelled"
    doc = a2.get("acct-1", running)
    assert doc.usage.cost_amount == Decimal("0.0700") and doc.usage.currency == "USD" and doc.charge_id
    assert AMOUNT.match(doc.doc["usage"]["cost_amount"])
    [line] = s2.truth["invoice_lines"]
    assert (line["type"], line["amount"], line["job_id"]) == ("charge", "0.0700", running)

    s3, a3 = sim(provider())
    done = a3.submit("acct-1", "c-done", req(3)).job_id
    wait_until(lambda: a3.get("acct-1", done).terminal)
    assert a3.cancel("acct-1", done).status == "succeeded"  # a finished job keeps its status
    assert a3.get("acct-1", done).status == "succeeded" and len(s3.truth["invoice_lines"]) == 1
    assert a3.cancel("acct-1", "job_nope") is None and http(s3, "POST", "/v1/jobs/job_nope/cancel").status_code == 404
    assert [j["cancel_requested_at"] is not None for j in s3.truth["jobs"]] == [True]


def test_meta_and_invoices_shapes(sim):
    s, a = sim(provider(idempotency_window_seconds=86400))
    assert http(s, "GET", "/v1/meta").json() == {"idempotency_window_seconds": 86400}
    ids = [a.submit("acct-1", f"inv{i}", req(i)).job_id for i in range(4)]
    wait_until(lambda: all(a.get("acct-1", i).terminal for i in ids))
    today = datetime.now(timezone.utc).date()
    doc = http(s, "GET", "/v1/invoices", params={"date": today.isoformat()}).json()
    if len(doc["lines"]) < 4:  # the jobs finished across midnight UTC
        doc["lines"] += http(s, "GET", "/v1/invoices", params={"date": (today + timedelta(days=1)).isoformat()}).json()["lines"]
    assert set(doc) == {"lines"} and len(doc["lines"]) == 4
    for line in doc["lines"]:
        assert set(line) == {"line_id", "charge_id", "job_id", "idempotency_key", "account_id", "model", "type",
                             "amount", "currency", "occurred_at"}
        assert line["type"] == "charge" and AMOUNT.match(line["amount"]) and ISO.match(line["occurred_at"])
        assert line["account_id"] == "acct-1" and line["currency"] == "USD" and line["job_id"] in ids
    assert http(s, "GET", "/v1/invoices", params={"date": "2001-01-01"}).json() == {"lines": []}
    for bad in ("", "yesterday", "2025-13-01", "20250101"):
        assert http(s, "GET", "/v1/invoices", params={"date": bad}).status_code == 400
    inv = a.invoices(today)
    assert all(isinstance(ln.amount, Decimal) for ln in inv.lines)


def test_invoice_lines_duplicated_and_a_day_late(sim):
    s, a = sim(provider(invoice_duplicate_rate=1.0, invoice_late_rate=1.0))
    job_id = a.submit("acct-1", "late", req()).job_id
    wait_until(lambda: a.get("acct-1", job_id).terminal)
    [truth_line] = s.truth["invoice_lines"]
    occurred = datetime.fromisoformat(truth_line["occurred_at"].replace("Z", "+00:00")).date()
    assert truth_line["billed_date"] == (occurred + timedelta(days=1)).isoformat() and truth_line["copies"] == 2
    assert a.invoices(occurred).lines == []
    late = a.invoices(occurred + timedelta(days=1)).lines
    assert len(late) == 2 and late[0] == late[1] and late[0].job_id == job_id


def test_truth_over_http_matches_in_process(sim):
    s, a = sim(provider(max_concurrency=4, **SLOW))
    for i in range(3):
        a.submit("acct-1", f"t{i}", req(i))
    doc = _client.get(s.base_url + "/_truth").json()
    assert {j["id"] for j in doc["jobs"]} == {j["id"] for j in s.truth["jobs"]}
    assert doc["accounts"]["acct-1"] == {"max_concurrency": 4, "current": 3, "peak": 3}
    assert {j["idempotency_key"] for j in doc["jobs"]} == {"t0", "t1", "t2"}


# --- webhooks ---------------------------------------------------------------------------------------------

class Receiver:
    """A callback endpoint that records every delivery; it can refuse each message's first try."""

    def __init__(self, refuse_first: bool = False):
        self.received: list[tuple[dict, bytes, float]] = []
        self.refuse_first = refuse_first
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with outer._lock:
                    msg = self.headers["webhook-id"]
                    refuse = outer.refuse_first and msg not in outer._seen
                    outer._seen.add(msg)
                    if not refuse:
                        outer.received.append((dict(self.headers.items()), body, time.time()))
                self.send_response(500 if refuse else 204)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/callbacks"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def by_job(self) -> Counter:
        return Counter(json.loads(b)["data"]["id"] for _, b, _ in self.received)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def make(**kw):
        r = Receiver(**kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def test_webhooks_arrive_signed_and_verify(sim, receiver):
    rcv = receiver()
    cfg = provider(failure_rate=0.0)
    s, a = sim(cfg)
    ids = [a.submit("acct-1", f"w{i}", req(i, callback_url=rcv.url)).job_id for i in range(5)]
    _, a_slow = sim(provider(**SLOW))  # the same secret; its job is cancelled while it runs
    queued = a_slow.submit("acct-1", "w-cancel", req(9, callback_url=rcv.url))
    assert a_slow.cancel("acct-1", queued.job_id).status == "cancelled"
    wait_until(lambda: len(rcv.received) == 6)
    for headers, body, received_at in rcv.received:
        assert verify_webhook(cfg.webhook_secret, headers, body, now=received_at)
        assert not verify_webhook(cfg.webhook_secret, headers, body + b" ", now=received_at)
        doc = json.loads(body)
        assert set(doc) == {"type", "data"} and doc["type"] == f"job.{doc['data']['status']}"
        if doc["type"] == "job.succeeded":
            assert doc["data"] == http(s, "GET", f"/v1/jobs/{doc['data']['id']}").json()
        assert headers["webhook-id"].startswith("msg_")
    assert {json.loads(b)["type"] for _, b, _ in rcv.received} == {"job.succeeded", "job.cancelled"}
    assert set(rcv.by_job()) == set(ids) | {queued.job_id}


def test_a_refused_webhook_is_retried_with_the_same_id(sim, receiver):
    rcv = receiver(refuse_first=True)
    s, a = sim(provider())
    job_id = a.submit("acct-1", "retry", req(callback_url=rcv.url)).job_id
    wait_until(lambda: len(rcv.received) == 1)
    # The simulator books the delivery once the receiver's answer is back.
    truth = wait_until(lambda: (j := s.truth["jobs"][0])["webhook"]["delivered"] == 1 and j)
    assert truth["webhook"]["attempts"] == 2
    assert rcv.received[0][0]["webhook-id"] == truth["webhook"]["webhook_id"] and rcv.by_job() == {job_id: 1}


def _webhook_run(sim, rcv, seed):
    s, a = sim(provider(seed=seed, webhook_drop_rate=0.2, webhook_duplicate_rate=0.3, webhook_delay_seconds_max=20))
    ids = [a.submit("acct-1", f"wh-{i}", req(i, callback_url=rcv.url)).job_id for i in range(60)]
    wait_until(lambda: all(j["webhook"] is not None for j in s.truth["jobs"]))
    truth = {j["id"]: j["webhook"] for j in s.truth["jobs"]}
    expected = sum(w["copies"] for w in truth.values())
    wait_until(lambda: len(rcv.received) >= expected)
    time.sleep(0.05)
    return s, ids, truth


def test_duplicates_and_drops_happen_at_the_configured_rates_reproducibly(sim, receiver):
    rcv = receiver()
    s, ids, truth = _webhook_run(sim, rcv, seed=11)
    got = rcv.by_job()
    assert len(rcv.received) == sum(w["copies"] for w in truth.values())
    for job_id, w in truth.items():
        assert got.get(job_id, 0) == w["copies"] == (0 if w["dropped"] else 2 if w["copies"] == 2 else 1)
    dropped = {j for j, w in truth.items() if w["dropped"]}
    duplicated = {j for j, w in truth.items() if w["copies"] == 2}
    assert 4 <= len(dropped) <= 22 and 6 <= len(duplicated) <= 30  # 60 draws at 20% and 30% (of the kept)
    assert s.truth["webhooks"]["dropped"] == len(dropped) and s.truth["webhooks"]["duplicated"] == len(duplicated)
    # The copies of one message share its webhook-id (a receiver dedupes on it).
    ids_per_job: dict[str, set] = {}
    for headers, body, _ in rcv.received:
        ids_per_job.setdefault(json.loads(body)["data"]["id"], set()).add(headers["webhook-id"])
    assert all(len(v) == 1 for v in ids_per_job.values())

    # The same seed and keys make the same decisions; another seed makes others.
    rcv2 = receiver()
    _, ids2, truth2 = _webhook_run(sim, rcv2, seed=11)
    # What happened to each copy on the wire (attempts, deliveries, the receiver's answers) is timing;
    # the decisions (drop, duplicate, the ids) are the seed's.
    outcome = ("attempts", "delivered", "answers")
    assert ids2 == ids and {k: {f: x for f, x in v.items() if f not in outcome} for k, v in truth2.items()} == \
        {k: {f: x for f, x in v.items() if f not in outcome} for k, v in truth.items()}
    rcv3 = receiver()
    _, _, truth3 = _webhook_run(sim, rcv3, seed=12)
    assert {j for j, w in truth3.items() if w["dropped"]} != dropped


def test_outcomes_are_reproducible_from_the_seed(sim):
    def run(seed):
        s, a = sim(provider(seed=seed, failure_rate=0.3, **{k: v for k, v in SLOW.items() if k != "failure_rate"}))
        for i in range(30):
            a.submit("acct-1", f"r{i}", req(i))
        return {j["idempotency_key"]: (j["id"], j["planned_outcome"]) for j in s.truth["jobs"]}

    first, again, other = run(3), run(3), run(4)
    assert first == again and first != other
    assert 0 < Counter(o for _, o in first.values())["failed"] < 30


# --- outputs ----------------------------------------------------------------------------------------------

def _clip(data: bytes) -> dict:
    with av.open(io.BytesIO(data)) as container:
        [video] = container.streams.video
        frames = list(container.decode(video))
        return {"size": (video.width, video.height), "codec": video.codec_context.name, "frames": len(frames),
                "duration": container.duration / 1_000_000 if container.duration else None,
                "audio": [a.codec_context.name for a in container.streams.audio]}


@pytest.mark.parametrize("duration, resolution, with_audio, size", [
    (4, "720p", False, (1280, 720)),
    (3, "480p", True, (854, 480)),
    (2, "1080p", True, (1920, 1080)),
])
def test_a_succeeded_job_has_a_real_mp4_matching_its_order(sim, duration, resolution, with_audio, size):
    s, a = sim(provider())
    job_id = a.submit("acct-1", f"mp4-{resolution}", req(duration_seconds=duration, resolution=resolution,
                                                         with_audio=with_audio)).job_id
    job = wait_until(lambda: (j := a.get("acct-1", job_id)).terminal and j)
    r = _client.get(job.output_url)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4" and len(r.content) > 200
    clip = _clip(r.content)
    assert clip["size"] == size and clip["codec"] in ("h264", "mpeg4")
    assert clip["frames"] == duration * 2  # 2 fps of one flat frame: cheap whatever the resolution
    assert clip["duration"] == pytest.approx(duration, abs=0.1)
    assert clip["audio"] == (["aac"] if with_audio else [])
    assert _client.get(job.output_url).content == r.content  # deterministic (and cached)
    assert [j["output_fault"] for j in s.truth["jobs"]] == [None]
    assert _client.get(f"{s.base_url}/v1/outputs/job_nope.mp4").status_code == 404


def test_output_misbehaviours_forced_per_job_by_a_prompt_marker(sim):
    s, a = sim(provider())
    ids = {kind: a.submit("acct-1", f"fault-{kind}", req(kind, prompt=f"a cat [sim:output={kind}]", duration_seconds=4,
                                                         resolution="720p", with_audio=True)).job_id
           for kind in ("truncated", "empty", "not_video", "wrong_duration", "wrong_resolution", "no_audio")}
    done = {kind: wait_until(lambda i=i: (j := a.get("acct-1", i)).terminal and j) for kind, i in ids.items()}
    body = {kind: _client.get(job.output_url) for kind, job in done.items()}
    assert all(r.status_code == 200 and r.headers["content-type"] == "video/mp4" for r in body.values())
    assert body["empty"].content == b""
    assert b"<html>" in body["not_video"].content
    with pytest.raises(av.error.InvalidDataError):
        _clip(body["not_video"].content)
    assert 0 < len(body["truncated"].content) < len(body["wrong_resolution"].content)
    with pytest.raises(Exception):  # the second half (and the moov box) is missing
        _clip(body["truncated"].content)
    assert _clip(body["wrong_duration"].content)["duration"] == pytest.approx(2, abs=0.1)
    assert _clip(body["wrong_resolution"].content)["size"] == (854, 480)
    assert _clip(body["no_audio"].content)["audio"] == [] and _clip(body["no_audio"].content)["size"] == (1280, 720)
    assert {j["id"]: j["output_fault"] for j in s.truth["jobs"]} == {i: kind for kind, i in ids.items()}


def test_output_misbehaviour_rates_are_drawn_per_job_and_reproducible(sim):
    s, a = sim(provider(output_empty_rate=0.5))
    ids = [a.submit("acct-1", f"rate-{i}", req(i)).job_id for i in range(20)]
    for i in ids:
        wait_until(lambda i=i: a.get("acct-1", i).terminal)
    faults = {j["id"]: j["output_fault"] for j in s.truth["jobs"]}
    assert set(faults.values()) == {None, "empty"}
    for i in ids:
        job = a.get("acct-1", i)
        assert (len(_client.get(job.output_url).content) == 0) == (faults[i] == "empty")
    s2, a2 = sim(provider(output_empty_rate=0.5))
    for i in range(20):
        a2.submit("acct-1", f"rate-{i}", req(i))
    assert {j["idempotency_key"]: j["output_fault"] for j in s2.truth["jobs"]} == {
        j["idempotency_key"]: j["output_fault"] for j in s.truth["jobs"]}


# --- concurrency ------------------------------------------------------------------------------------------

def test_peak_concurrency_never_exceeds_the_limit_under_50_concurrent_submits(sim):
    s, a = sim(provider(max_concurrency=5, **SLOW))
    barrier = threading.Barrier(50)

    def go(i):
        barrier.wait()
        return a.submit("acct-1", f"p{i}", req(i))

    with ThreadPoolExecutor(50) as pool:
        outs = list(pool.map(go, range(50)))
    assert Counter(o.kind for o in outs) == {"ACCEPTED": 5, "NOT_ACCEPTED_RETRYABLE": 45}
    assert len(s.truth["jobs"]) == 5 and s.truth["accounts"]["acct-1"]["peak"] == 5


def test_every_submit_gets_through_by_retrying_and_the_limit_holds_throughout(sim):
    accounts = [ProviderAccount(account_id="acct-1", api_key="key-1", max_concurrency=5),
                ProviderAccount(account_id="acct-2", api_key="key-2", max_concurrency=3)]
    s, a = sim(provider(accounts=accounts, latency_seconds_min=2, latency_seconds_max=5, retry_after_seconds=1))
    barrier = threading.Barrier(50)

    def go(i):
        account = "acct-1" if i % 2 else "acct-2"
        barrier.wait()
        while True:
            out = a.submit(account, f"q{i}", req(i))
            if isinstance(out, Accepted):
                return out
            assert isinstance(out, NotAcceptedRetryable)
            time.sleep(out.retry_after_seconds / SCALE)

    with ThreadPoolExecutor(50) as pool:
        outs = list(pool.map(go, range(50)))
    truth = s.truth
    assert len({o.job_id for o in outs}) == 50 and len(truth["jobs"]) == 50
    assert Counter(j["idempotency_key"] for j in truth["jobs"]).most_common(1)[0][1] == 1
    assert truth["accounts"]["acct-1"]["peak"] == 5 and truth["accounts"]["acct-2"]["peak"] == 3
    assert truth["submits"]["rate_limited"] > 0


# --- the command ------------------------------------------------------------------------------------------

def test_the_provider_sim_command_serves_the_contract(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('time_scale = 50.0\n[[providers]]\nname = "p-one"\n[[providers]]\nname = "p-two"\n'
                   '[[providers.accounts]]\naccount_id = "x1"\napi_key = "secret-x1"\n'
                   '[providers.simulator]\nidempotency_window_seconds = 1234\n')
    proc = subprocess.Popen([sys.executable, "-m", "aivedio_tools.cli", "provider-sim", "--port", "0", "--config", str(cfg),
                             "--provider", "p-two"], stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        url = re.search(r"(http://\S+)", line).group(1)
        assert "p-two" in line and "time_scale=50" in line
        r = httpx.get(url + "/v1/meta", headers={"Authorization": "Bearer secret-x1"}, timeout=5)
        assert r.json() == {"idempotency_window_seconds": 1234}
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_serve_starts_a_simulator_for_each_provider_without_a_base_url():
    config = PlatformConfig(time_scale=10, providers=[
        ProviderConfig(name="built-in-a"), ProviderConfig(name="external", base_url="http://127.0.0.1:9", webhook_secret="whsec_dGVzdA==",
                       accounts=[ProviderAccount(account_id="x1", api_key="key-x1")]),
        ProviderConfig(name="built-in-b", simulator=SimulatorBehaviour(idempotency_window_seconds=99))])
    sims = start_simulators(config)
    try:
        assert sorted(sims) == ["built-in-a", "built-in-b"]
        adapters = build_adapters(config.providers, {n: s.base_url for n, s in sims.items()})
        assert adapters["external"].base_url == "http://127.0.0.1:9"
        assert adapters["built-in-b"].meta().idempotency_window_seconds == 99
        assert adapters["built-in-a"].meta().idempotency_window_seconds == 86400
        assert sims["built-in-a"].simulator.time_scale == 10
        for a in adapters.values():
            a.close()
    finally:
        for s in sims.values():
            s.stop()
