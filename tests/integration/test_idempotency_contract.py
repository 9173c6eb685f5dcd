"""The Idempotency-Key contract in full (docs/tenant-api.md), over the real PostgreSQL:

- the in-flight 409 covers the whole request, input probe included: a second request with the key
  answers IDEMPOTENCY_IN_PROGRESS while the first is still fetching its input (a slow local media
  server holds it there), probes nothing itself, and the first then completes and is replayed;
- a request that died leaves an IN_PROGRESS record that blocks its key only until the lock time
  (Timers.idempotency_lock_seconds); then the next request takes it over;
- a request that ends without a task (a rejection, a bad input) gives its key back;
- a record past its TTL is no longer replayed (the key stays spent: one task per key), and the
  idempotency-purge maintenance service deletes expired records in batches, across a batch
  boundary, leaving live ones; its scheduled Lambda handler runs the same pass."""
from __future__ import annotations

import functools
import json
import threading
import uuid
from datetime import datetime, timedelta, timezone
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import av
import pytest

from aivedio.admission.models import GenerationRequest
from aivedio.admission.service import IdempotencyInProgress, IdempotencyKeyReused, _claim, admit, request_hash
from aivedio.config import Limits, ManualClock, PlatformConfig
from aivedio.reconcile import idempotency_purge
from tests.admission_support import BODY, accepted, footprint, new_tenant, serve
from tests.conftest import create_test_database, drop_test_database

_ = serve  # a fixture, imported for the tests that request it

LOCAL = ["127.0.0.1"]  # the media server below is local; the probe refuses non-global hosts unless allowed
SIZE = 32


def _png(path: Path) -> Path:
    with av.open(str(path), "w", format="image2") as c:
        s = c.add_stream("png", rate=1)
        s.width = s.height = SIZE
        s.pix_fmt = "rgb24"
        frame = av.VideoFrame(SIZE, SIZE, "rgb24")
        frame.planes[0].update(bytes(frame.planes[0].buffer_size))
        for packet in s.encode(frame):
            c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return path


class SlowMedia:
    """A local media server whose /slow.png answers only once `gate` is set (or after `hold_s`), and
    that counts the fetches it received."""

    def __init__(self, root: Path, hold_s: float = 8.0):
        self.gate, self.fetched, self.fetches = threading.Event(), threading.Event(), 0
        outer = self

        class Handler(SimpleHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                outer.fetches += 1
                outer.fetched.set()
                if self.path.startswith("/slow"):
                    outer.gate.wait(hold_s)
                    self.path = "/still.png"
                super().do_GET()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def db_url():
    """A database per test: the purge is platform-wide, and these tests move the clock past the TTL."""
    url = create_test_database("idempotency")
    yield url
    drop_test_database(url)


@pytest.fixture
def slow_media(tmp_path):
    _png(tmp_path / "still.png")
    m = SlowMedia(tmp_path)
    yield m
    m.close()


def record(conn, tenant_id, key: str) -> dict | None:
    return conn.execute("select * from idempotency_record where tenant_id = %s and idempotency_key = %s",
                        (tenant_id, key)).fetchone()


def test_a_second_request_while_the_first_is_still_probing_answers_409(make_platform, conn, serve, slow_media):
    p = make_platform(PlatformConfig(limits=Limits(probe_allowed_private_hosts=LOCAL)))
    api = serve(p)
    t = new_tenant(p)
    body = {**BODY, "mode": "image_to_video", "inputs": [{"url": f"{slow_media.base}/slow.png", "kind": "image"}]}
    first: dict = {}
    thread = threading.Thread(target=lambda: first.setdefault("r", api.submit(t, body, key="held")))
    thread.start()
    try:
        assert slow_media.fetched.wait(10), "the first request never fetched its input"
        # The first request is inside its probe: its key is IN_PROGRESS, committed.
        held = record(conn, t.tenant_id, "held")
        assert held is not None and held["status"] == "IN_PROGRESS" and held["locked_until"] > held["created_at"]
        before = footprint(conn, t.tenant_id)
        second = api.submit(t, body, key="held")
        assert second.status_code == 409 and second.json()["error"] == "IDEMPOTENCY_IN_PROGRESS", second.text
        other = api.submit(t, {**body, "duration_seconds": 6}, key="held")
        assert other.status_code == 422 and other.json()["error"] == "IDEMPOTENCY_KEY_REUSED", other.text
        assert slow_media.fetches == 1  # neither fetched anything: they were answered before any slow work
        assert footprint(conn, t.tenant_id) == before  # and wrote nothing
    finally:
        slow_media.gate.set()
        thread.join(30)
    done = accepted(first["r"])
    rec = record(conn, t.tenant_id, "held")
    assert (rec["status"], rec["response_status"], str(rec["task_id"])) == ("COMPLETED", 202, done["task_id"])
    assert rec["locked_until"] is None
    again = api.submit(t, body, key="held")
    assert (again.status_code, again.content) == (first["r"].status_code, first["r"].content)  # byte for byte
    assert slow_media.fetches == 1  # a replay probes nothing
    assert conn.execute("select count(*) as n from generation_task where tenant_id = %s", (t.tenant_id,)).fetchone()["n"] == 1


def test_a_dead_requests_record_blocks_its_key_only_until_the_lock_time(make_platform, conn, serve):
    clock = ManualClock(datetime.now(timezone.utc))
    p = make_platform(clock=clock)
    t = new_tenant(p)
    req = GenerationRequest(**BODY)
    # A request claimed the key and died before its admission transaction (a crashed process).
    dead_token = _claim(p, t.tenant_id, "crashed", request_hash(BODY))
    assert isinstance(dead_token, uuid.UUID)
    rec = record(conn, t.tenant_id, "crashed")
    assert rec["status"] == "IN_PROGRESS" and rec["task_id"] == dead_token
    lock = p.config.timers.idempotency_lock_seconds
    assert (rec["locked_until"] - rec["created_at"]).total_seconds() == pytest.approx(lock)

    with pytest.raises(IdempotencyInProgress):  # within the lock time: the dead request may still be alive
        admit(p, t.caller, req, BODY, "crashed")
    clock.advance(lock - 1)
    with pytest.raises(IdempotencyInProgress):
        admit(p, t.caller, req, BODY, "crashed")
    clock.advance(2)  # past the lock: the record is stale, and the retry takes it over by CAS
    got = admit(p, t.caller, req, BODY, "crashed")
    assert got.status == 202 and not got.replayed
    task_id = json.loads(got.body)["task_id"]
    rec = record(conn, t.tenant_id, "crashed")
    assert rec["status"] == "COMPLETED" and str(rec["task_id"]) == task_id and rec["task_id"] != dead_token
    assert admit(p, t.caller, req, BODY, "crashed").body == got.body  # and it is what the key replays now
    # The dead request's token no longer owns anything: were it to wake, it could neither complete nor
    # release the key (both are CAS on the token).
    with p.db.connection() as c:
        assert c.execute("""delete from idempotency_record where tenant_id = %s and idempotency_key = 'crashed'
                             and status = 'IN_PROGRESS' and task_id = %s""", (t.tenant_id, dead_token)).rowcount == 0


def test_a_request_that_ends_without_a_task_gives_its_key_back(make_platform, conn, serve):
    p = make_platform(PlatformConfig(limits=Limits(probe_allowed_private_hosts=LOCAL)))
    api = serve(p)
    t = new_tenant(p)
    before = footprint(conn, t.tenant_id)
    bad = {**BODY, "mode": "image_to_video", "inputs": [{"url": "http://127.0.0.1:9/missing.png", "kind": "image"}]}
    r = api.submit(t, bad, key="retry-me")
    assert r.status_code == 422 and r.json()["error"] == "INPUT_UNREACHABLE", r.text
    assert footprint(conn, t.tenant_id) == before  # no idempotency record either
    broke = new_tenant(p, credits=1)
    start = footprint(conn, broke.tenant_id)
    r = api.submit(broke, key="retry-me")
    assert r.status_code == 402 and r.json()["decision"] == "REJECT_INSUFFICIENT_CREDIT", r.text
    assert footprint(conn, broke.tenant_id) == start
    # The key is free again: the corrected request goes through under it.
    accepted(api.submit(t, key="retry-me"))


def test_an_expired_record_is_not_replayed_and_the_purge_deletes_expired_records_in_batches(make_platform, conn):
    clock = ManualClock(datetime.now(timezone.utc))
    p = make_platform(clock=clock)
    t = new_tenant(p)
    req = GenerationRequest(**BODY)
    keys = [f"old-{i}" for i in range(5)]
    for k in keys:
        assert admit(p, t.caller, req, BODY, k).status == 202
    first = admit(p, t.caller, req, BODY, keys[0])
    assert first.replayed  # within the TTL the key replays
    dead = _claim(p, t.tenant_id, "dead-in-progress", request_hash(BODY))  # and a request that died
    assert isinstance(dead, uuid.UUID)

    clock.advance(p.config.timers.idempotency_ttl_seconds + 1)
    with pytest.raises(IdempotencyKeyReused):  # expired: not replayed, and the key stays spent (its task has it)
        admit(p, t.caller, req, BODY, keys[0])
    assert record(conn, t.tenant_id, keys[0])["status"] == "COMPLETED"  # the refused reuse changed nothing
    fresh = admit(p, t.caller, req, BODY, "fresh")  # a live record beside the expired ones
    assert fresh.status == 202
    expired_by_dead_key = admit(p, t.caller, req, BODY, "dead-in-progress")  # no task had it: free again
    assert expired_by_dead_key.status == 202

    # 5 expired records, batches of 2: 2 + 2 + 1, the short batch ends the run.
    report = idempotency_purge.run_once(p, batch_size=2)
    assert report == idempotency_purge.PurgeReport(deleted=5, batches=3, complete=True)
    left = {r["idempotency_key"] for r in conn.execute("select idempotency_key from idempotency_record where tenant_id = %s",
                                                       (t.tenant_id,)).fetchall()}
    assert left == {"fresh", "dead-in-progress"}
    assert idempotency_purge.run_once(p, batch_size=2) == idempotency_purge.PurgeReport(deleted=0, batches=1, complete=True)
    # Exactly a batch's worth: the full batch is followed by an empty one.
    clock.advance(p.config.timers.idempotency_ttl_seconds + 1)
    assert idempotency_purge.run_once(p, batch_size=2) == idempotency_purge.PurgeReport(deleted=2, batches=2, complete=True)
    # A bounded run stops after max_batches and says it is not done.
    for k in ("a", "b", "c"):
        admit(p, t.caller, req, BODY, f"late-{k}")
    clock.advance(p.config.timers.idempotency_ttl_seconds + 1)
    assert idempotency_purge.run_once(p, batch_size=1, max_batches=2) == idempotency_purge.PurgeReport(
        deleted=2, batches=2, complete=False)
    assert idempotency_purge.run_once(p, batch_size=1) == idempotency_purge.PurgeReport(deleted=1, batches=2, complete=True)
    # The tasks stay: only the records go.
    assert conn.execute("select count(*) as n from generation_task where tenant_id = %s", (t.tenant_id,)).fetchone()["n"] == 10


def test_the_scheduled_purge_handler(make_platform, conn):
    from aivedio.context import set_platform
    from aivedio.events_routing import SCHEDULES
    from aivedio_tools.local.lambda_context import FakeLambdaContext
    from functions.idempotency_purge.handler import lambda_handler

    [s] = [s for s in SCHEDULES if s.function == "idempotency_purge"]
    assert s.name == "idempotency-purge" and s.aws_every_minutes >= 1
    clock = ManualClock(datetime.now(timezone.utc))
    p = make_platform(clock=clock)
    t = new_tenant(p)
    admit(p, t.caller, GenerationRequest(**BODY), BODY, "to-purge")
    clock.advance(p.config.timers.idempotency_ttl_seconds + 1)
    set_platform(p)
    try:
        with open("events/idempotency_purge.json") as f:
            out = lambda_handler(json.load(f), FakeLambdaContext("aivedio-idempotency-purge"))
    finally:
        set_platform(None)
    assert out["service"] == "idempotency-purge" and out["repaired"] >= 1 and out["complete"] is True
    assert record(conn, t.tenant_id, "to-purge") is None


def test_webhook_receipts_and_applied_parked_webhooks_are_purged_after_their_window(make_platform, conn):
    """The receipts and the applied parked webhooks do not grow forever; a webhook still PARKED (its
    job never mapped) is evidence for invoice reconciliation and stays, whatever its age."""
    from psycopg.types.json import Jsonb

    clock = ManualClock(datetime.now(timezone.utc))
    p = make_platform(clock=clock)
    ttl = timedelta(seconds=p.config.timers.webhook_receipt_ttl_seconds)
    now, tag = clock.now(), uuid.uuid4().hex[:8]
    old, young = now - ttl - timedelta(hours=1), now - ttl + timedelta(hours=1)
    for i, at in enumerate([old, old, old, young]):
        conn.execute("insert into webhook_receipt (provider, webhook_id, received_at) values (%s, %s, %s)",
                     (f"p-{tag}", f"w-{i}", at))
    for wid, state, done in [("applied-old", "APPLIED", old), ("dup-old", "DUPLICATE", old), ("stale-young", "STALE", young),
                             ("parked-old", "PARKED", None)]:
        conn.execute("""insert into parked_webhook (provider, webhook_id, provider_job_id, event_type, body, received_at, state, done_at)
                        values (%s, %s, 'job', 'job.succeeded', %s, %s, %s, %s)""",
                     (f"p-{tag}", wid, Jsonb({"type": "job.succeeded"}), old - timedelta(days=30), state, done))

    report = idempotency_purge.run_once(p, batch_size=2)
    assert (report.receipts_deleted, report.parked_webhooks_deleted, report.complete) == (3, 2, True)
    assert [r["webhook_id"] for r in conn.execute(
        "select webhook_id from webhook_receipt where provider = %s", (f"p-{tag}",))] == ["w-3"]
    assert sorted(r["webhook_id"] for r in conn.execute(
        "select webhook_id from parked_webhook where provider = %s", (f"p-{tag}",))) == ["parked-old", "stale-young"]
    again = idempotency_purge.run_once(p, batch_size=2)
    assert (again.receipts_deleted, again.parked_webhooks_deleted) == (0, 0)
    assert again.as_report().details == {"idempotency_records": again.deleted, "webhook_receipts": 0, "parked_webhooks": 0}
