"""The local runtime over the real PostgreSQL and Redis: the API handler behind the HTTP server,
the handler invoked directly with the sample API Gateway event, and the outbox relay delivering to
in-process consumers at least once."""
from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import httpx
import psycopg
import pytest

from aivedio import outbox
from aivedio.config import Limits, PlatformConfig
from aivedio_tools.local import consumers
from aivedio_tools.local.lambda_context import FakeLambdaContext
from aivedio_tools.local.runtime import LocalRuntime, Loop
from tests.waiting import wait_for

EVENTS = Path(__file__).resolve().parents[2] / "events"


@pytest.fixture
def runtime(platform):
    rt = LocalRuntime(platform, port=0).start()
    yield rt
    rt.stop()


@pytest.fixture
def event_type():
    """A fresh event type per test, and its consumers removed afterwards."""
    et = f"test.{uuid.uuid4().hex[:8]}"
    yield et
    consumers.CONSUMERS.pop(et, None)


@pytest.fixture
def clean_outbox(conn):
    conn.execute("delete from outbox_event")
    conn.execute("delete from processed_event")


def write(conn, event_type, n=1, **payload):
    return [outbox.write_event(conn, event_type, aggregate_type="test", aggregate_id=uuid.uuid4(),
                               tenant_id=None, payload={"i": i, **payload}) for i in range(n)]


def row(conn, event_id):
    return conn.execute("select * from outbox_event where event_id = %s", (event_id,)).fetchone()


# --- the API through the local HTTP server -------------------------------------------------------

def test_healthz_reports_database_redis_and_loops(runtime):
    wait_for(lambda: "outbox-relay" in runtime.platform.extras["loop_status"])
    r = httpx.get(f"{runtime.base_url}/healthz", timeout=10)
    assert r.status_code == 200
    doc = r.json()
    assert doc["status"] == "ok" and doc["database"] == "ok" and doc["redis"] == "ok"
    loop = doc["loops"]["outbox-relay"]
    assert loop["runs"] >= 1 and loop["last_ok"] is True and loop["last_run_at"]


def test_healthz_says_disabled_without_redis(make_platform):
    rt = LocalRuntime(make_platform(redis=False), port=0, loops=[]).start()
    try:
        doc = httpx.get(f"{rt.base_url}/healthz", timeout=10).json()
    finally:
        rt.stop()
    assert (doc["status"], doc["database"], doc["redis"]) == ("ok", "ok", "disabled")


def test_openapi_document_is_3_1(runtime):
    r = httpx.get(f"{runtime.base_url}/openapi.json", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    doc = r.json()
    assert doc["openapi"].startswith("3.1")
    assert "/healthz" in doc["paths"]
    assert doc["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"


def test_swagger_ui_is_served_offline(runtime):
    r = httpx.get(f"{runtime.base_url}/swagger", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "swagger" in r.text.lower() and "/healthz" in r.text


def test_unknown_path_is_404_json(runtime):
    r = httpx.post(f"{runtime.base_url}/v1/nothing-here", json={}, timeout=10)
    assert r.status_code == 404
    doc = r.json()
    assert doc["error"] == "NOT_FOUND" and set(doc) >= {"message", "details"}


def test_handler_answers_the_sample_api_gateway_event(platform):
    from functions.api.handler import lambda_handler

    event = json.loads((EVENTS / "api_healthz.json").read_text())
    resp = lambda_handler(event, FakeLambdaContext("aivedio-api"))
    assert resp["statusCode"] == 200
    doc = json.loads(resp["body"])
    assert (doc["status"], doc["database"], doc["redis"]) == ("ok", "ok", "ok")


def test_wake_runs_a_loop_before_its_interval(platform):
    ran = []
    rt = LocalRuntime(platform, port=0, loops=[Loop("slow", 3600.0, lambda: ran.append(time.monotonic()))]).start()
    try:
        wait_for(lambda: len(ran) == 1)
        platform.wake("slow")
        wait_for(lambda: len(ran) == 2, timeout=5)
    finally:
        rt.stop()
    assert platform.extras["loop_status"]["slow"]["runs"] == 2


def test_a_failing_loop_keeps_running_and_reports_its_error(platform):
    def explode():
        raise ValueError("nope")

    rt = LocalRuntime(platform, port=0, loops=[Loop("bad", 0.01, explode)]).start()
    try:
        wait_for(lambda: platform.extras["loop_status"].get("bad", {}).get("errors", 0) >= 3)
        doc = httpx.get(f"{rt.base_url}/healthz", timeout=10).json()
    finally:
        rt.stop()
    assert doc["loops"]["bad"]["last_ok"] is False and "nope" in doc["loops"]["bad"]["last_error"]


# --- the outbox -----------------------------------------------------------------------------------

def test_relay_delivers_written_events_in_order_and_marks_them_published(platform, conn, clean_outbox, event_type):
    got = []
    consumers.register(event_type, got.append)
    ids = write(conn, event_type, 3)
    assert outbox.backlog(conn) == 3
    assert outbox.relay_once(platform, consumers.deliver) == 3
    assert [uuid.UUID(e["event_id"]) for e in got] == ids
    assert got[0]["event_type"] == event_type and got[0]["version"] == 1 and got[0]["payload"] == {"i": 0}
    assert all(row(conn, i)["status"] == "PUBLISHED" and row(conn, i)["published_at"] for i in ids)
    assert outbox.backlog(conn) == 0
    assert outbox.relay_once(platform, consumers.deliver) == 0  # nothing is delivered twice when all went well
    assert len(got) == 3


def test_event_written_in_a_rolled_back_transaction_never_exists(platform, conn, clean_outbox, event_type):
    with pytest.raises(RuntimeError):
        with conn.transaction():
            write(conn, event_type)
            raise RuntimeError("business change failed")
    assert outbox.backlog(conn) == 0


def test_consumer_that_raised_gets_the_event_again(make_platform, conn, clean_outbox, event_type):
    platform = make_platform(PlatformConfig(time_scale=1000.0))  # backoff of 1 platform second = 1 ms
    calls = []

    def flaky(envelope):
        calls.append(envelope["event_id"])
        if len(calls) == 1:
            raise ConnectionError("downstream unavailable")

    other = []
    consumers.register(event_type, flaky)
    consumers.register(event_type, other.append)
    (event_id,) = write(conn, event_type)

    assert outbox.relay_once(platform, consumers.deliver) == 0
    r = row(conn, event_id)
    assert (r["status"], r["attempts"]) == ("PENDING", 1)
    assert "downstream unavailable" in r["last_error"]
    assert r["next_retry_at"] > r["created_at"]

    time.sleep(0.01)
    assert outbox.relay_once(platform, consumers.deliver) == 1
    assert calls == [str(event_id)] * 2
    assert len(other) == 2  # at least once: the healthy consumer saw it again and must deduplicate
    assert row(conn, event_id)["status"] == "PUBLISHED"


def test_backoff_waits_before_the_retry(platform, conn, clean_outbox, event_type):
    def broken(envelope):
        raise RuntimeError("x")

    consumers.register(event_type, broken)
    (event_id,) = write(conn, event_type)
    outbox.relay_once(platform, consumers.deliver)
    consumers.unregister(event_type, broken)
    assert outbox.relay_once(platform, consumers.deliver) == 0  # not due yet (1 s at time_scale 1)
    r = row(conn, event_id)
    assert r["attempts"] == 1
    delay = (r["next_retry_at"] - conn.execute("select now() as n").fetchone()["n"]).total_seconds()
    assert 0 < delay <= platform.config.timers.outbox_retry_base_seconds


def test_event_fails_after_max_attempts(make_platform, conn, clean_outbox, event_type):
    platform = make_platform(PlatformConfig(time_scale=1000.0, limits=Limits(outbox_max_attempts=3)))

    def broken(envelope):
        raise RuntimeError("always")

    consumers.register(event_type, broken)
    (event_id,) = write(conn, event_type)
    for _ in range(3):
        outbox.relay_once(platform, consumers.deliver)
        time.sleep(0.02)
    r = row(conn, event_id)
    assert (r["status"], r["attempts"]) == ("FAILED", 3)
    consumers.unregister(event_type, broken)
    assert outbox.relay_once(platform, consumers.deliver) == 0  # FAILED waits for an operator
    assert outbox.backlog(conn) == 0


def test_relay_skips_rows_locked_by_another_transaction(platform, db_url, conn, clean_outbox, event_type):
    got = []
    consumers.register(event_type, got.append)
    locked_id, free_id = write(conn, event_type, 2)
    with psycopg.connect(db_url) as other:  # another relay mid-delivery holds locked_id
        other.execute("select 1 from outbox_event where event_id = %s for update", (locked_id,))
        t0 = time.monotonic()
        assert outbox.relay_once(platform, consumers.deliver) == 1
        assert time.monotonic() - t0 < 2  # skipped, not waited for
        assert [e["event_id"] for e in got] == [str(free_id)]
        assert row(conn, locked_id)["status"] == "PENDING"
        other.rollback()
    assert outbox.relay_once(platform, consumers.deliver) == 1
    assert [e["event_id"] for e in got] == [str(free_id), str(locked_id)]


def test_concurrent_relays_deliver_each_event_once(platform, conn, clean_outbox, event_type):
    got, lock = [], threading.Lock()

    def slow_consumer(envelope):
        time.sleep(0.002)
        with lock:
            got.append(envelope["event_id"])

    consumers.register(event_type, slow_consumer)
    ids = write(conn, event_type, 60)
    threads = [threading.Thread(target=lambda: [outbox.relay_once(platform, consumers.deliver, batch=10) for _ in range(6)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == sorted(str(i) for i in ids)  # no event twice, none missing


def test_runtime_loop_delivers_through_the_relay_handler(runtime, conn, clean_outbox, event_type):
    got = []
    consumers.register(event_type, got.append)
    (event_id,) = write(conn, event_type, note="via loop")
    wait_for(lambda: got)
    assert got[0]["event_id"] == str(event_id) and got[0]["payload"]["note"] == "via loop"
    wait_for(lambda: row(conn, event_id)["status"] == "PUBLISHED")


def test_mark_processed_is_true_once(conn, clean_outbox):
    event_id = uuid.uuid4()
    assert outbox.mark_processed(conn, "indexer", event_id) is True
    assert outbox.mark_processed(conn, "indexer", event_id) is False
    assert outbox.mark_processed(conn, "settlement", event_id) is True


def test_idempotent_consumer_applies_a_redelivered_event_once(platform, conn, clean_outbox, event_type):
    """The pattern consumers follow: mark_processed in the same transaction as the effect."""
    applied = []

    def consumer(envelope):
        with platform.db.connection() as c, c.transaction():
            if outbox.mark_processed(c, "test-consumer", envelope["event_id"]):
                applied.append(envelope["event_id"])

    consumers.register(event_type, consumer)
    (event_id,) = write(conn, event_type)
    envelope = outbox.envelope_of(row(conn, event_id)).to_message()
    consumers.deliver(envelope)
    consumers.deliver(envelope)
    assert applied == [str(event_id)]


# --- the relay Lambda as deployed: events go to SQS (moto stands in for AWS) -----------------------

def test_relay_lambda_sends_each_event_to_the_queue_of_its_type(make_platform, conn, clean_outbox, monkeypatch):
    import boto3
    from moto import mock_aws

    from aivedio.context import set_platform
    from functions.outbox_relay import handler as relay

    for k, v in {"AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(k, v)
    relay._sqs.cache_clear()
    with mock_aws():
        sqs = boto3.client("sqs")
        created = sqs.create_queue(QueueName="task-created")["QueueUrl"]
        fallback = sqs.create_queue(QueueName="everything-else")["QueueUrl"]
        platform = make_platform(event_queue_urls={"task.created": created, "*": fallback})
        set_platform(platform)
        try:
            (a,) = write(conn, "task.created")
            (b,) = write(conn, "wallet.topped_up")
            event = json.loads((EVENTS / "outbox_relay.json").read_text())
            # As deployed, a run polls until RESERVE_MILLIS before its timeout: give it half a second.
            context = FakeLambdaContext("aivedio-outbox-relay", timeout_seconds=relay.RESERVE_MILLIS / 1000 + 0.5)
            assert relay.lambda_handler(event, context) == {"published": 2}
        finally:
            set_platform(None)

        def bodies(url):
            msgs = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, MessageAttributeNames=["All"]).get("Messages", [])
            return [(json.loads(m["Body"]), m["MessageAttributes"]["event_type"]["StringValue"]) for m in msgs]

        [(doc, attr)] = bodies(created)
        assert doc["event_id"] == str(a) and attr == "task.created" and doc["version"] == 1
        [(doc, attr)] = bodies(fallback)
        assert doc["event_id"] == str(b) and attr == "wallet.topped_up"
    relay._sqs.cache_clear()


def test_relay_lambda_without_a_queue_for_the_type_keeps_the_event(make_platform, conn, clean_outbox):
    from functions.outbox_relay.handler import NoQueueForEvent, sqs_deliver

    platform = make_platform()
    (event_id,) = write(conn, "unrouted.event")
    assert outbox.relay_once(platform, sqs_deliver({})) == 0
    r = row(conn, event_id)
    assert r["status"] == "PENDING" and NoQueueForEvent.__name__ in r["last_error"]
