"""Degraded modes (ch. 18.18, ch. 20.12; aivedio.degraded): each one made to happen for real, seen in
/healthz through the `api` handler (the sample API Gateway event), counted in the DegradedMode
gauge, and its effect on admission or scheduling checked:
- Redis killed mid-run (a redis-server of the test's own): conservative scheduling from PostgreSQL,
  BEST_EFFORT paused, rate limits in PostgreSQL; restarted empty, the index is rebuilt at once;
- Redis paused (a partition): an add it missed marks the lane stale, and the index is rebuilt when
  it answers again although its data survived;
- the outbox not drained past Limits.outbox_backlog_max_age_seconds: REJECT_PLATFORM_OVERLOADED
  with nothing written, until it drains;
- a provider failing: its breaker opens, new work goes elsewhere, the job it accepted stays with it;
- PostgreSQL gone (connections refused and cut): every request answers 503
  REJECT_DATABASE_UNAVAILABLE fast, nothing is admitted, /healthz says the database is down;
- the price book unreadable: the last snapshot within its age and the per-task cap, else
  REJECT_PRICING_UNAVAILABLE;
- a capacity counter found wrong: conservative scheduling until the repair commits."""
from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from aivedio.config import (BillingConfig, LaneConfig, Limits, ManualClock, PlatformConfig, ProviderAccount, ProviderConfig,
                            Settings)
from aivedio.context import build_platform, set_platform
from aivedio_tools.local.apigw import to_event
from aivedio_tools.local.lambda_context import FakeLambdaContext
from aivedio.observability import metrics
from aivedio.scheduling.resources import ensure_platform_pools, release_attempt
from aivedio.scheduling.ring import Ring, active_tenants_pg, built_key
from aivedio.scheduling.scheduler import Scheduler
from aivedio.tasks import cas_transition
from tests.admission_support import BODY, clear_cache, footprint, new_tenant
from tests.conftest import TEST_HOME, create_test_database, drop_test_database
from tests.redis_server import RedisServer, redis_server_binary
from tests.scheduler_support import BODY_1U, OPEN, UNCAPPED, finish_all, pick_attempts, submit

pytestmark = pytest.mark.timeout(120)
EVENTS = Path(__file__).resolve().parents[2] / "events"
PAID, BE = "PAID_SHARED", "BEST_EFFORT"
needs_redis_server = pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server binary")


@pytest.fixture
def db_url():
    """A database per test: the modes read platform-wide tables (outbox, attempts, shards)."""
    url = create_test_database("degraded")
    yield url
    drop_test_database(url)


@pytest.fixture
def own_redis(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _no_global_platform():
    yield
    set_platform(None)


def config(**kw) -> PlatformConfig:
    base = dict(providers=[ProviderConfig(name="sim-a", accounts=[ProviderAccount(account_id="a1", max_concurrency=50)])],
                lanes={PAID: LaneConfig(capacity_units=4), BE: LaneConfig(capacity_units=4),
                       "ENTERPRISE_RESERVED": LaneConfig(capacity_units=10, borrowable_units=0)})  # nothing to borrow
    return PlatformConfig(**{**base, **kw})


def started(p):
    with p.db.connection() as c:
        ensure_platform_pools(c, p.config)
    return p


def own_platform(db_url: str, redis_url: str, cfg: PlatformConfig, **kw):
    return started(build_platform(Settings(database_url=db_url, redis_url=redis_url, redis_prefix=f"t{uuid.uuid4().hex[:8]}",
                                           home=TEST_HOME), cfg, **kw))


def tenant(p, service_class=PAID, **policy):
    return new_tenant(p, service_class=service_class, weight=1, credits=10_000_000, **{**OPEN, **UNCAPPED, **policy})


def healthz(p) -> dict:
    """GET /healthz through the api handler, as API Gateway sends it."""
    from functions.api.handler import lambda_handler

    set_platform(p)
    resp = lambda_handler(json.loads((EVENTS / "api_healthz.json").read_text()), FakeLambdaContext("aivedio-api"))
    assert resp["statusCode"] == 200, resp
    doc = json.loads(resp["body"])
    assert doc["status"] == ("degraded" if doc["degraded"] else "ok")
    return doc


def post_generation(p, api_key: str, body: dict = BODY) -> dict:
    """POST /v1/generations through the api handler: the proxy answer."""
    from functions.api.handler import lambda_handler

    set_platform(p)
    ev = to_event("POST", "/v1/generations", "", [("Authorization", f"Bearer {api_key}"), ("Idempotency-Key", uuid.uuid4().hex),
                                                   ("Content-Type", "application/json")], json.dumps(body).encode())
    return lambda_handler(ev, FakeLambdaContext("aivedio-api"))


def header(resp: dict, name: str) -> str | None:
    """A header of a proxy answer (Powertools answers in multiValueHeaders, the gate in headers)."""
    for k, v in (resp.get("multiValueHeaders") or {}).items():
        if k.lower() == name.lower():
            return v[-1]
    return next((v for k, v in (resp.get("headers") or {}).items() if k.lower() == name.lower()), None)


def gauge_entries(mode: str) -> float:
    return metrics.snapshot().get(f"DegradedMode|mode={mode}", 0.0)


def queued_tenants(conn, lane: str) -> set[str]:
    return {str(t) for t in active_tenants_pg(conn, lane)}


def ring_set(p, lane: str) -> set[str]:
    members, listed = Ring(p).members(lane)
    assert sorted(members) == sorted(listed), "the ring's list and set disagree"
    return members


# --- Redis ----------------------------------------------------------------------------------------------------

@needs_redis_server
def test_redis_killed_mid_run_schedules_from_postgresql_and_rebuilds_when_it_returns(db_url, own_redis, conn):
    p = own_platform(db_url, own_redis.url, config())
    a, b, cheap = tenant(p), tenant(p), tenant(p, service_class=BE)
    submit(p, a.tenant_id, a.user_id, n=6)
    submit(p, b.tenant_id, b.user_id, n=6)
    s = Scheduler(p)
    s.tick(2)  # builds the index
    finish_all(p)
    assert not s.tick(2).conservative
    finish_all(p)
    assert healthz(p)["status"] == "ok"
    entered = gauge_entries("redis")

    own_redis.kill()
    # Admission goes on, with its rate limits in PostgreSQL; the queue indexer's add is lost.
    late = submit(p, a.tenant_id, a.user_id, n=3)
    be_tasks = submit(p, cheap.tenant_id, cheap.user_id, n=2)
    assert conn.execute("select count(*) as n from rate_limit_bucket where bucket_key = %s",
                        (f"user:{a.user_id}:submit",)).fetchone()["n"] == 1
    doc = healthz(p)
    assert (doc["status"], doc["redis"], doc["database"]) == ("degraded", "down", "ok")
    mode = doc["degraded"]["redis"]
    assert "conservative" in mode["reason"] and mode["since"]
    assert gauge_entries("redis") == entered + 1

    r = s.tick(2)
    assert r.conservative and r.claims > 0 and BE not in r.by_lane  # PostgreSQL ring; BEST_EFFORT paused
    finish_all(p)
    assert {conn.execute("select state from generation_task where task_id = %s", (t,)).fetchone()["state"]
            for t in be_tasks} == {"QUEUED"}

    own_redis.start()  # back, empty
    r = s.tick(2)
    assert r.conservative  # the index was missing: rebuilt by this tick, which stays conservative
    assert own_redis.client().exists(built_key(p.cache, PAID))
    # Rebuilt before the tick claimed: every tenant still queued is on it (one this tick emptied may
    # linger until its next visit, or until the redis-index service takes it off).
    assert ring_set(p, PAID) >= queued_tenants(conn, PAID)
    from aivedio.reconcile import redis_index

    redis_index.run_once(p)
    assert ring_set(p, PAID) == queued_tenants(conn, PAID)
    for _ in range(30):
        finish_all(p)
        r = s.tick(2)
        assert not r.conservative
        if not conn.execute("select 1 from generation_task where state = 'QUEUED' limit 1").fetchone():
            break
    finish_all(p)
    states = {row["state"] for row in conn.execute("select state from generation_task").fetchall()}
    assert states == {"SUCCEEDED"}, states  # the late tasks and BEST_EFFORT too: nothing lost
    assert all(conn.execute("select state from generation_task where task_id = %s", (t,)).fetchone()["state"] == "SUCCEEDED"
               for t in late)
    doc = healthz(p)
    assert (doc["status"], doc["redis"], doc["degraded"]) == ("ok", "ok", {})
    p.close()


@needs_redis_server
def test_an_add_lost_in_a_partition_marks_the_lane_stale_and_it_is_rebuilt_when_redis_answers(db_url, own_redis, conn):
    p = own_platform(db_url, own_redis.url, config())
    a, b = tenant(p), tenant(p)
    submit(p, a.tenant_id, a.user_id, n=1)
    s = Scheduler(p)
    s.tick(2)
    finish_all(p)
    assert not s.tick(2).conservative
    submit(p, b.tenant_id, b.user_id, n=6, ring=False)  # more than the lane holds: some stay queued
    own_redis.pause()  # the keys survive; commands time out
    try:
        Ring(p).add(PAID, b.tenant_id)  # the queue indexer's add for b's tasks times out
    finally:
        own_redis.resume()
    # A write that timed out may or may not have been applied (it sat in the socket's buffer); here it
    # never arrived.
    Ring(p).drop(PAID, b.tenant_id)
    assert str(b.tenant_id) not in ring_set(p, PAID) and own_redis.client().exists(built_key(p.cache, PAID))
    r = s.tick(2)
    assert r.conservative  # the lane was stale: its marker dropped, the ring rebuilt from PostgreSQL
    assert ring_set(p, PAID) == queued_tenants(conn, PAID) == {str(b.tenant_id)}
    p.close()


# --- the outbox -----------------------------------------------------------------------------------------------

def test_an_outbox_older_than_its_max_age_stops_admission_until_it_drains(make_platform, conn):
    max_age = 600.0
    p = started(make_platform(config(time_scale=10.0, limits=Limits(outbox_backlog_max_age_seconds=max_age))))
    t = tenant(p)
    stuck = uuid.uuid4()
    real_age = (max_age + 50) / 10.0  # platform seconds over the threshold, in real seconds
    conn.execute("""insert into outbox_event (event_id, event_type, aggregate_type, payload, created_at)
                    values (%s, 'TaskQueued', 'generation_task', '{}', now() - make_interval(secs => %s))""", (stuck, real_age))
    clear_cache(p)
    before = footprint(conn, t.tenant_id)
    resp = post_generation(p, t.api_key)
    body = json.loads(resp["body"])
    assert (resp["statusCode"], body["decision"]) == (503, "REJECT_PLATFORM_OVERLOADED"), body
    assert "oldest unpublished outbox event" in body["message"] and header(resp, "Retry-After") == "30"
    assert footprint(conn, t.tenant_id) == before  # nothing written
    doc = healthz(p)
    mode = doc["degraded"]["outbox_backlog"]
    assert doc["outbox_pending"] == 1 and doc["outbox_oldest_pending_seconds"] > max_age
    # since: when the oldest event crossed the threshold, max_age platform seconds after it was written
    created = conn.execute("select created_at from outbox_event where event_id = %s", (stuck,)).fetchone()["created_at"]
    assert abs(datetime.fromisoformat(mode["since"]) - (created + timedelta(seconds=max_age / 10.0))) < timedelta(seconds=1)
    assert mode["detail"]["pending"] == 1

    conn.execute("update outbox_event set status = 'PUBLISHED', published_at = now() where event_id = %s", (stuck,))
    clear_cache(p)
    assert post_generation(p, t.api_key)["statusCode"] == 202
    clear_cache(p)
    doc = healthz(p)
    assert "outbox_backlog" not in doc["degraded"] and doc["outbox_pending"] == 1  # the new task's TaskQueued, fresh


def test_healthz_counts_dead_letters_and_open_manual_reviews(make_platform, conn):
    p = started(make_platform(config()))
    t = tenant(p)
    (task,) = submit(p, t.tenant_id, t.user_id, n=1)
    conn.execute("insert into outbox_event (event_type, aggregate_type, payload, status) values ('X', 'test', '{}', 'FAILED')")
    conn.execute("update generation_task set state = 'MANUAL_REVIEW' where task_id = %s", (task,))
    doc = healthz(p)
    assert (doc["outbox_dead_letters"], doc["manual_review_open"]) == (1, 1)


# --- a provider failing ---------------------------------------------------------------------------------------

def _fail(p, a) -> None:
    """The provider failed the job: task and attempt FAILED, reservations released, in one transaction."""
    def tx(conn):
        now = p.clock.now()
        assert cas_transition(conn, tenant_id=a.tenant_id, task_id=a.task_id, from_state="RUNNING", version=a.version,
                              to_state="FAILED", now=now, finished_at=now) is not None
        conn.execute("update task_attempt set state = 'FAILED', updated_at = %s where attempt_id = %s", (now, a.attempt_id))
        release_attempt(conn, a.attempt_id, now)

    p.db.transaction(tx)


def test_a_failing_provider_opens_its_breaker_and_the_job_it_accepted_is_not_migrated(make_platform, conn):
    from aivedio.scheduling import router

    cfg = config(providers=[
        ProviderConfig(name="p-bad", cost_per_second="0.0100", accounts=[ProviderAccount(account_id="b1", max_concurrency=40)]),
        ProviderConfig(name="p-good", cost_per_second="0.0500", accounts=[ProviderAccount(account_id="g1", max_concurrency=40)]),
    ], lanes={PAID: LaneConfig(capacity_units=40)})
    p = started(make_platform(cfg))
    t = tenant(p)
    submit(p, t.tenant_id, t.user_id, n=router.BREAKER_MIN_SAMPLES + 1)
    s = Scheduler(p)
    for _ in range(10):
        s.tick(2)
        if not conn.execute("select 1 from generation_task where state = 'QUEUED' limit 1").fetchone():
            break
    running = pick_attempts(p, 100)
    assert {a.provider for a in running} == {"p-bad"}  # cheaper: preferred while it works
    accepted, failed = running[0], running[1:]
    for a in failed:
        _fail(p, a)
    clear_cache(p)
    assert set(router.open_breakers(p)) == {"p-bad"}
    doc = healthz(p)
    mode = doc["degraded"]["provider_breaker"]
    assert mode["detail"]["providers"]["p-bad"]["samples"] == router.BREAKER_MIN_SAMPLES
    assert mode["detail"]["accounts"] == ["p-bad:b1"]

    fresh = submit(p, t.tenant_id, t.user_id, n=4)
    s.tick(2)
    attempts = conn.execute("select task_id, provider from task_attempt where task_id = any(%s)", (fresh,)).fetchall()
    assert len(attempts) == 4 and {r["provider"] for r in attempts} == {"p-good"}
    # The job p-bad accepted stays with p-bad: same attempt, still running, no second attempt.
    mine = conn.execute("select attempt_id, provider, state from task_attempt where task_id = %s", (accepted.task_id,)).fetchall()
    assert [(r["attempt_id"], r["provider"], r["state"]) for r in mine] == [(accepted.attempt_id, "p-bad", "RUNNING")]
    task = conn.execute("select state, current_attempt_id from generation_task where task_id = %s", (accepted.task_id,)).fetchone()
    assert (task["state"], task["current_attempt_id"]) == ("RUNNING", accepted.attempt_id)


# --- PostgreSQL down ------------------------------------------------------------------------------------------

def _cut_off(admin: psycopg.Connection, dbname: str, allow: bool) -> None:
    admin.execute(sql.SQL("alter database {} allow_connections {}").format(sql.Identifier(dbname), sql.SQL("true" if allow else "false")))
    if not allow:
        admin.execute("select pg_terminate_backend(pid) from pg_stat_activity where datname = %s and pid <> pg_backend_pid()", (dbname,))


def test_postgresql_down_fails_closed_fast_and_healthz_says_so(db_url, redis_url, redis_prefix):
    from tests.conftest import admin_url

    cfg = config(limits=Limits(api_database_wait_seconds=0.5))
    p = started(build_platform(Settings(database_url=db_url, redis_url=redis_url, redis_prefix=redis_prefix, home=TEST_HOME),
                               cfg, pool_size=2))
    t = tenant(p)
    assert post_generation(p, t.api_key)["statusCode"] == 202
    dbname = db_url.rsplit("/", 1)[1]
    with psycopg.connect(admin_url(), autocommit=True) as admin:
        _cut_off(admin, dbname, allow=False)
        try:
            t0 = time.monotonic()
            resp = post_generation(p, t.api_key)
            took = time.monotonic() - t0
            body = json.loads(resp["body"])
            assert (resp["statusCode"], body["error"], body["decision"]) == (503, "REJECTED", "REJECT_DATABASE_UNAVAILABLE"), body
            assert header(resp, "Retry-After") == str(body["retry_after_seconds"]) and took < 5
            from functions.api.handler import app

            spec = json.loads(app.get_openapi_json_schema())
            assert "503" in spec["paths"]["/v1/generations"]["post"]["responses"]
            assert "503" in spec["paths"]["/v1/wallet"]["get"]["responses"]
            doc = healthz(p)
            assert (doc["status"], doc["database"]) == ("degraded", "down")
            assert "fail closed" in doc["degraded"]["database"]["reason"]
            assert doc["outbox_dead_letters"] is None and doc["manual_review_open"] is None
        finally:
            _cut_off(admin, dbname, allow=True)
    with psycopg.connect(db_url, row_factory=dict_row) as c:
        assert c.execute("select count(*) as n from generation_task").fetchone()["n"] == 1  # only the first one
    deadline = time.monotonic() + 30  # the pool reconnects with its backoff
    while healthz(p)["database"] != "ok":
        assert time.monotonic() < deadline, "the pool never reconnected"
        time.sleep(0.5)
    assert "database" not in healthz(p)["degraded"]
    assert post_generation(p, t.api_key)["statusCode"] == 202
    p.close()


# --- pricing unavailable --------------------------------------------------------------------------------------

def _price_book_unreadable(conn, on: bool) -> None:
    conn.execute("alter table price_book rename to price_book_away" if on else "alter table price_book_away rename to price_book")


def test_pricing_unavailable_uses_the_last_snapshot_within_its_age_and_cap_else_rejects(make_platform, conn):
    from aivedio.admission.service import admit
    from aivedio.admission.models import GenerationRequest
    from aivedio.admission.decisions import Rejected

    p_now = datetime.now(timezone.utc)
    clock = ManualClock(p_now)
    p = started(make_platform(config(billing=BillingConfig(price_snapshot_max_age_seconds=300, price_snapshot_max_task_amount=100)),
                              clock=clock))
    t = tenant(p)
    first = json.loads(admit(p, t.caller, GenerationRequest(**BODY_1U), BODY_1U, uuid.uuid4().hex).body)
    version = first["quote"]["price_version_id"]
    _price_book_unreadable(conn, True)
    try:
        clear_cache(p)
        clock._now = p_now + timedelta(seconds=200)  # within the snapshot's 300 s
        got = json.loads(admit(p, t.caller, GenerationRequest(**BODY_1U), BODY_1U, uuid.uuid4().hex).body)
        assert got["quote"]["price_version_id"] == version and got["quote"]["quoted_amount"] == first["quote"]["quoted_amount"]
        doc = healthz(p)
        assert "pricing from the snapshot" in doc["degraded"]["pricing"]["reason"]
        # Above the per-task cap (10 s: 120 credits > 100): refused, even within the age.
        dear = {**BODY_1U, "duration_seconds": 10}
        with pytest.raises(Rejected) as e:
            admit(p, t.caller, GenerationRequest(**dear), dear, uuid.uuid4().hex)
        assert e.value.decision == "REJECT_PRICING_UNAVAILABLE" and e.value.status == 503
        # Past its age: refused, whatever the amount, through the API too; nothing written.
        clear_cache(p)
        clock._now = p_now + timedelta(seconds=301)
        before = footprint(conn, t.tenant_id)
        resp = post_generation(p, t.api_key, BODY_1U)
        assert (resp["statusCode"], json.loads(resp["body"])["decision"]) == (503, "REJECT_PRICING_UNAVAILABLE")
        assert footprint(conn, t.tenant_id) == before
        assert "no usable price snapshot" in healthz(p)["degraded"]["pricing"]["reason"]
        # A process that never read a price has no snapshot at all.
        other = make_platform(p.config, clock=clock)
        with pytest.raises(Rejected, match="no price version was read yet"):
            admit(other, t.caller, GenerationRequest(**BODY_1U), BODY_1U, uuid.uuid4().hex)
    finally:
        _price_book_unreadable(conn, False)
    clear_cache(p)
    assert post_generation(p, t.api_key, BODY_1U)["statusCode"] == 202
    assert "pricing" not in healthz(p)["degraded"]


def test_a_tampered_snapshot_is_not_used(make_platform, conn):
    from aivedio.admission.decisions import Rejected
    from aivedio.admission.models import GenerationRequest
    from aivedio.admission.service import admit

    p = started(make_platform(config()))
    t = tenant(p)
    admit(p, t.caller, GenerationRequest(**BODY_1U), BODY_1U, uuid.uuid4().hex)
    snap = p.extras["price_snapshot"]
    snap.version["rules"]["models"]["video-model-x"]["base_amount"] = 0  # what a checksum is for
    _price_book_unreadable(conn, True)
    try:
        clear_cache(p)
        with pytest.raises(Rejected, match="checksum") as e:
            admit(p, t.caller, GenerationRequest(**BODY_1U), BODY_1U, uuid.uuid4().hex)
        assert e.value.decision == "REJECT_PRICING_UNAVAILABLE"
    finally:
        _price_book_unreadable(conn, False)


# --- capacity counters ----------------------------------------------------------------------------------------

def test_a_wrong_capacity_counter_makes_scheduling_conservative_until_the_repair_commits(make_platform, conn):
    from aivedio.reconcile import capacity_counters

    p = started(make_platform(config()))
    t = tenant(p)
    submit(p, t.tenant_id, t.user_id, n=2)
    s = Scheduler(p)
    s.tick(2)
    assert not s.tick(2).conservative
    conn.execute("update resource_pool_shard set used_units = used_units + 1 where resource_key = 'worker:gpu' and shard_no = 0")
    assert len(capacity_counters.detect(p)) == 1
    clear_cache(p)
    doc = healthz(p)
    assert "conservative" in doc["degraded"]["capacity_counters"]["reason"]
    assert doc["degraded"]["capacity_counters"]["detail"]["shards"] == ["worker:gpu#0"]
    assert s.tick(2).conservative
    report = capacity_counters.run_once(p)
    assert report.repaired == 1 and report.complete
    clear_cache(p)
    assert not s.tick(2).conservative
    assert "capacity_counters" not in healthz(p)["degraded"]
