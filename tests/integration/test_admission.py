"""Admission over the real PostgreSQL and Redis (issue 3, docs/tenant-api.md).

Each decision code is produced by the condition that names it, through the real `api` handler
behind the local HTTP server, with the contract's HTTP status; and each rejection writes nothing.
Tests whose decisions read lane-wide figures (queued units, the outbox backlog, the price
version) get a database of their own, so other tests' tasks cannot move them."""
from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone

import psycopg
import pytest

from aivedio.billing.lots import grant_credits
from aivedio.admission.decisions import REJECT_STATUS, Rejected
from aivedio.admission.models import GenerationRequest
from aivedio.admission.service import admit
from aivedio.cache.client import Cache
from aivedio.config import LaneConfig, Limits, ManualClock, ModelPrice, PlatformConfig
from aivedio.pricing import price_book
from tests.admission_support import (BODY, CONTRACT_STATUS, COST_UNITS, PRICE, accepted, assert_rejected,
                                     assert_wallet_matches_ledger, clear_cache, footprint, new_tenant, second_user,
                                     serve, wallet_row)
from tests.conftest import create_test_database, drop_test_database

pytestmark = pytest.mark.redis_cluster  # each test also runs on a 3-node Redis cluster

_ = serve  # a fixture, imported for the tests that request it


@pytest.fixture(scope="module")
def shared_db_url():
    url = create_test_database("admission")
    yield url
    drop_test_database(url)


@pytest.fixture
def own_db():
    """Requested by tests that read lane-wide figures (queued units, the outbox backlog, the
    active price version) or move the clock: they get a database of their own."""


@pytest.fixture
def db_url(request, shared_db_url):
    """Overrides conftest's per-module database: a fresh one (cloned from the migrated template in
    ~0.2 s) for a test that asks for `own_db`, the module's otherwise."""
    if "own_db" not in request.fixturenames:
        yield shared_db_url
        return
    url = create_test_database("admission_own")
    yield url
    drop_test_database(url)


# --- the decision table ------------------------------------------------------------------------------

def test_every_decision_code_has_the_contracts_status():
    for code, status in CONTRACT_STATUS.items():
        assert REJECT_STATUS[code] == status, code
        assert Rejected(code, "x").status == status


def test_user_rate_limit(platform, conn, serve):
    api = serve(platform)
    t = new_tenant(platform, user_submit_rate_per_minute=2)
    for _ in range(2):
        accepted(api.submit(t))
    before = footprint(conn, t.tenant_id)
    r = api.submit(t)
    body = assert_rejected(r, "REJECT_USER_RATE_LIMIT", conn, t.tenant_id, before)
    assert body["retry_after_seconds"] >= 1 and r.headers["Retry-After"] == str(body["retry_after_seconds"])
    # The limit is the user's: another user of the same tenant still gets in.
    accepted(api.submit(second_user(platform, t)))


def test_tenant_rate_limit(platform, conn, serve):
    api = serve(platform)
    t = new_tenant(platform, tenant_submit_rate_per_minute=2)
    other = second_user(platform, t)
    accepted(api.submit(t))
    accepted(api.submit(other))
    before = footprint(conn, t.tenant_id)
    # Each user has made one request of their own 10 000 a minute; the tenant's 2 are spent.
    assert_rejected(api.submit(t), "REJECT_TENANT_RATE_LIMIT", conn, t.tenant_id, before)
    assert_rejected(api.submit(other), "REJECT_TENANT_RATE_LIMIT", conn, t.tenant_id, before)
    # Another tenant is untouched.
    accepted(api.submit(new_tenant(platform)))


@pytest.mark.parametrize("limit", [{"max_user_queued_tasks": 2}, {"max_user_queued_units": 2}])
def test_user_queue_full(platform, conn, serve, limit):
    api = serve(platform)
    t = new_tenant(platform, **limit)
    first = accepted(api.submit(t))
    accepted(api.submit(t))
    before = footprint(conn, t.tenant_id)
    body = assert_rejected(api.submit(t), "REJECT_USER_QUEUE_FULL", conn, t.tenant_id, before)
    assert body["retry_after_seconds"] >= 1
    accepted(api.submit(second_user(platform, t)))  # the tenant's queue has room; this user's has not
    # A cancelled task leaves the queue, and the user's next task fits again.
    assert api.cancel(t, first["task_id"]).status_code == 202
    accepted(api.submit(t))


@pytest.mark.parametrize("limit", [{"max_queued_tasks": 2}, {"max_queued_units": 2}])
def test_tenant_queue_full(platform, conn, serve, limit):
    api = serve(platform)
    t = new_tenant(platform, **limit)
    other = second_user(platform, t)
    accepted(api.submit(t))
    accepted(api.submit(other))
    before = footprint(conn, t.tenant_id)
    assert_rejected(api.submit(t), "REJECT_TENANT_QUEUE_FULL", conn, t.tenant_id, before)
    assert_rejected(api.submit(other), "REJECT_TENANT_QUEUE_FULL", conn, t.tenant_id, before)
    accepted(api.submit(new_tenant(platform)))


def test_lane_queue_full(make_platform, conn, serve, own_db):
    # PAID_SHARED holds at most 2 queued units; every BODY task is 1 unit.
    p = make_platform(PlatformConfig(lanes={"PAID_SHARED": LaneConfig(capacity_units=1200, max_queue_units=2)}))
    api = serve(p)
    a, b = new_tenant(p), new_tenant(p)
    accepted(api.submit(a))
    accepted(api.submit(a))
    clear_cache(p)
    before = footprint(conn, b.tenant_id)
    body = assert_rejected(api.submit(b), "REJECT_LANE_QUEUE_FULL", conn, b.tenant_id, before)
    assert body["retry_after_seconds"] >= 1
    # The lane is full for every tenant in it, but not for other lanes.
    accepted(api.submit(new_tenant(p, service_class="STANDARD")))


def _slow_lane_config() -> PlatformConfig:
    # No completions yet, so μ falls back to capacity / 30 units per second: 1/30 here, i.e. each
    # 1-unit task ahead adds 30 s of expected wait.
    return PlatformConfig(lanes={"PAID_SHARED": LaneConfig(capacity_units=1)})


def test_expected_wait_too_long(make_platform, conn, serve, own_db):
    p = make_platform(_slow_lane_config())
    api = serve(p)
    t = new_tenant(p, max_wait_seconds=75, allow_best_effort_downgrade=False)
    levels = []
    for _ in range(3):  # expected waits 0 s, 30 s, 60 s: all within 75 s
        clear_cache(p)
        levels.append(accepted(api.submit(t))["queue_position_level"])
    assert levels == ["LOW", "MEDIUM", "HIGH"]
    clear_cache(p)
    before = footprint(conn, t.tenant_id)
    body = assert_rejected(api.submit(t), "REJECT_EXPECTED_WAIT_TOO_LONG", conn, t.tenant_id, before)  # 90 s > 75 s
    assert body["retry_after_seconds"] >= 1


def test_accepted_best_effort_when_the_wait_is_too_long_and_the_policy_allows(make_platform, conn, serve, own_db):
    p = make_platform(_slow_lane_config())
    api = serve(p)
    t = new_tenant(p, max_wait_seconds=75, allow_best_effort_downgrade=True)
    for _ in range(3):
        clear_cache(p)
        assert accepted(api.submit(t))["decision"] == "ACCEPTED"
    clear_cache(p)
    r = api.submit(t)
    body = accepted(r)
    assert body["decision"] == "ACCEPTED_BEST_EFFORT" and body["queue_class"] == "BEST_EFFORT"
    task = conn.execute("select * from generation_task where task_id = %s", (body["task_id"],)).fetchone()
    assert (task["queue_class"], task["priority_band"], task["admission_decision"]) == ("BEST_EFFORT", 4, "ACCEPTED_BEST_EFFORT")
    # A downgraded task is still a paid task: reserved like any other.
    res = conn.execute("select * from credit_reservation where task_id = %s", (body["task_id"],)).fetchone()
    assert res["state"] == "ACTIVE" and res["reserved_amount"] == PRICE


def _mid_minute_clock(day_headroom_seconds: int = 300) -> ManualClock:
    """10 s into the current minute, so the minute tests' steps of 60 s land in known windows; moved
    ahead to just after midnight when the day ends within the headroom, so the per-day test's steps
    never cross into a new day (its budget window). It moves ahead, never back a day: prices are in
    force from when the test made them."""
    now = datetime.now(timezone.utc).replace(second=10, microsecond=0)
    if (now + timedelta(seconds=day_headroom_seconds)).date() != now.date():
        now = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), timezone.utc).replace(second=10)
    return ManualClock(now)


def test_cost_budget_per_minute(make_platform, conn, serve, own_db):
    clock = _mid_minute_clock()
    p = make_platform(clock=clock)
    api = serve(p)
    t = new_tenant(p, max_cost_per_minute=2 * COST_UNITS + 10)
    accepted(api.submit(t))
    accepted(api.submit(t))
    before = footprint(conn, t.tenant_id)
    body = assert_rejected(api.submit(t), "REJECT_COST_BUDGET", conn, t.tenant_id, before)
    assert body["retry_after_seconds"] >= 1
    clock.advance(60)  # the next minute's budget is fresh
    accepted(api.submit(t))


def test_cost_budget_per_day(make_platform, conn, serve, own_db):
    clock = _mid_minute_clock()
    p = make_platform(clock=clock)
    api = serve(p)
    t = new_tenant(p, max_cost_per_day=2 * COST_UNITS + 10)
    accepted(api.submit(t))
    clock.advance(60)
    accepted(api.submit(t))
    clock.advance(60)
    before = footprint(conn, t.tenant_id)
    assert_rejected(api.submit(t), "REJECT_COST_BUDGET", conn, t.tenant_id, before)


def test_insufficient_credit(platform, conn, serve):
    api = serve(platform)
    t = new_tenant(platform, credits=PRICE + PRICE // 2)
    accepted(api.submit(t))
    before = footprint(conn, t.tenant_id)
    assert before["wallet"]["available_amount"] == PRICE // 2
    assert_rejected(api.submit(t), "REJECT_INSUFFICIENT_CREDIT", conn, t.tenant_id, before)
    # A cheaper task that fits is still accepted.
    cheap = {**BODY, "duration_seconds": 1, "resolution": "480p"}  # (20 + 10) * 60 % = 18
    accepted(api.submit(t, cheap))
    assert wallet_row(conn, t.tenant_id)["available_amount"] == PRICE // 2 - 18


@pytest.mark.parametrize("expensive", [{"resolution": "4k"}, {"duration_seconds": 40}])
def test_resource_class_disabled_outside_the_contract(platform, conn, serve, expensive):
    api = serve(platform)
    t = new_tenant(platform, service_class="STANDARD")  # STANDARD contracts exclude EXPENSIVE work
    before = footprint(conn, t.tenant_id)
    assert_rejected(api.submit(t, {**BODY, **expensive}), "REJECT_RESOURCE_CLASS_DISABLED", conn, t.tenant_id, before)
    accepted(api.submit(t))  # ordinary work is in the contract
    paid = new_tenant(platform)  # PAID_SHARED contracts include it
    assert accepted(api.submit(paid, {**BODY, **expensive}))["queue_class"] == "EXPENSIVE"


def test_resource_class_disabled_when_the_lane_is_closed(make_platform, conn, serve):
    p = make_platform(PlatformConfig(lanes={"PAID_SHARED": LaneConfig(capacity_units=1200, admission_open=False)}))
    api = serve(p)
    t = new_tenant(p)
    before = footprint(conn, t.tenant_id)
    assert_rejected(api.submit(t), "REJECT_RESOURCE_CLASS_DISABLED", conn, t.tenant_id, before)
    accepted(api.submit(new_tenant(p, service_class="STANDARD")))  # the STANDARD lane is open


def test_platform_overloaded_by_outbox_backlog(make_platform, conn, serve, own_db):
    p = make_platform(PlatformConfig(limits=Limits(outbox_backlog_reject_threshold=3)))
    api = serve(p)
    t = new_tenant(p)
    for i in range(4):
        conn.execute("insert into outbox_event (event_type, aggregate_type, payload) values ('test.Backlog', 'test', %s)",
                     (json.dumps({"i": i}),))
    clear_cache(p)
    before = footprint(conn, t.tenant_id)
    body = assert_rejected(api.submit(t), "REJECT_PLATFORM_OVERLOADED", conn, t.tenant_id, before)
    assert body["retry_after_seconds"] >= 1
    conn.execute("update outbox_event set status = 'PUBLISHED', published_at = now() where event_type = 'test.Backlog'")
    clear_cache(p)
    accepted(api.submit(t))


def test_cancel_rate_limit(platform, conn, serve):
    api = serve(platform)
    t = new_tenant(platform, cancel_rate_per_minute=1)
    first, second = accepted(api.submit(t)), accepted(api.submit(t))
    assert api.cancel(t, first["task_id"]).status_code == 202
    before = footprint(conn, t.tenant_id)
    r = api.cancel(t, second["task_id"])
    assert r.status_code == 429 and r.json()["decision"] == "REJECT_CANCEL_RATE_LIMIT", r.text
    assert footprint(conn, t.tenant_id) == before
    assert conn.execute("select state from generation_task where task_id = %s", (second["task_id"],)).fetchone()["state"] == "QUEUED"


def test_a_frozen_wallet_admits_nothing(platform, conn, serve):
    api = serve(platform)
    t = new_tenant(platform)
    conn.execute("update wallet_account set frozen = true, freeze_reason = 'chargeback review' where tenant_id = %s", (t.tenant_id,))
    before = footprint(conn, t.tenant_id)
    r = api.submit(t)
    assert r.status_code == 403 and r.json()["decision"] == "REJECT_WALLET_FROZEN", r.text
    assert footprint(conn, t.tenant_id) == before


def test_rejections_through_the_core_raise_with_the_decision(platform, conn):
    t = new_tenant(platform, credits=10)
    req = GenerationRequest(**BODY)
    before = footprint(conn, t.tenant_id)
    with pytest.raises(Rejected) as e:
        admit(platform, t.caller, req, BODY, "core-1")
    assert (e.value.decision, e.value.status) == ("REJECT_INSUFFICIENT_CREDIT", 402)
    assert footprint(conn, t.tenant_id) == before
    # A rejection stores no idempotency record: the same key is free once the wallet has credit.
    platform.db.transaction(lambda c: grant_credits(c, wallet_row(c, t.tenant_id), 1000, kind="PAID", business_key="topup-1"))
    r = admit(platform, t.caller, req, BODY, "core-1")
    assert r.status == 202 and not r.replayed


# --- cancel, client fields, Redis down, quotes, prices, lots, postpaid ---------------------------------

def test_cancel_before_dispatch_releases_to_the_original_lot(platform, conn, serve):
    api = serve(platform)
    t = new_tenant(platform, credits=1000)
    start = footprint(conn, t.tenant_id)
    (lot_id,) = [lot["lot_id"] for lot in start["lots"]]
    task = accepted(api.submit(t))
    w = api.wallet(t)
    assert (w["available_amount"], w["reserved_amount"]) == (1000 - PRICE, PRICE)

    r = api.cancel(t, task["task_id"])
    assert r.status_code == 202 and r.json() == {"task_id": task["task_id"], "state": "CANCELLED"}
    row = conn.execute("select * from generation_task where task_id = %s", (task["task_id"],)).fetchone()
    assert row["state"] == "CANCELLED" and row["finished_at"] is not None
    res = conn.execute("select * from credit_reservation where task_id = %s", (task["task_id"],)).fetchone()
    assert (res["state"], res["released_amount"]) == ("RELEASED", PRICE)
    release = conn.execute("select * from ledger_transaction where task_id = %s and event_type = 'RELEASE'",
                           (task["task_id"],)).fetchall()
    assert len(release) == 1
    entries = conn.execute("select bucket, amount_delta, lot_id from ledger_entry where ledger_txn_id = %s",
                           (release[0]["ledger_txn_id"],)).fetchall()
    assert sorted((e["bucket"], e["amount_delta"], e["lot_id"]) for e in entries) == [
        ("AVAILABLE", PRICE, lot_id), ("RESERVED", -PRICE, lot_id)]
    end = footprint(conn, t.tenant_id)
    assert {k: v for k, v in end["wallet"].items() if k != "version"} == {
        k: v for k, v in start["wallet"].items() if k != "version"}
    assert end["lots"] == start["lots"]
    w = api.wallet(t)
    assert (w["available_amount"], w["reserved_amount"], w["consumed_amount"]) == (1000, 0, 0)
    assert_wallet_matches_ledger(conn, t.tenant_id)
    assert conn.execute("select count(*) as n from outbox_event where aggregate_id = %s and event_type = 'TaskCancelled'",
                        (task["task_id"],)).fetchone()["n"] == 1

    again = api.cancel(t, task["task_id"])
    assert again.status_code == 409 and again.json()["error"] == "TASK_TERMINAL"
    assert footprint(conn, t.tenant_id) == end  # the second cancel wrote nothing
    # Another tenant cannot cancel it: 404, as for an id that does not exist.
    assert api.cancel(new_tenant(platform), task["task_id"]).status_code == 404


def test_client_priority_price_and_queue_class_are_ignored(platform, conn, serve):
    api = serve(platform)
    t = new_tenant(platform)
    plain = accepted(api.submit(t))
    sneaky = {**BODY, "priority": 0, "priority_band": 0, "price": 1, "quoted_amount": 1, "max_reserve_amount": 1,
              "queue_class": "ENTERPRISE_RESERVED", "lane": "RECOVERY", "weight": 1000, "resource_class": "video-cheap",
              "fairness_units": 0}
    got = accepted(api.submit(t, sneaky))
    assert got["queue_class"] == plain["queue_class"] == "PAID_SHARED"
    assert got["quote"]["quoted_amount"] == got["quote"]["max_reserve_amount"] == PRICE
    a, b = (conn.execute("select * from generation_task where task_id = %s", (x["task_id"],)).fetchone() for x in (plain, got))
    for col in ("queue_class", "priority_band", "resource_class", "fairness_units", "estimated_cost_units"):
        assert a[col] == b[col], col
    assert b["priority_band"] == 3 and b["resource_class"] == "video-standard" and b["fairness_units"] == 1
    assert conn.execute("select reserved_amount from credit_reservation where task_id = %s",
                        (got["task_id"],)).fetchone()["reserved_amount"] == PRICE


@pytest.fixture
def redis_down(platform, redis_prefix):
    """The platform with its cache pointing at a Redis that is not there."""
    platform.cache.close()
    platform.cache = Cache("redis://127.0.0.1:1/0", redis_prefix)
    assert not platform.cache.healthy()
    return platform


@pytest.mark.parametrize("which", ["user", "tenant"])
def test_rate_limits_fall_back_to_postgresql_when_redis_is_down(redis_down, conn, which):
    p = redis_down
    t = new_tenant(p, **{f"{which}_submit_rate_per_minute": 2})
    req = GenerationRequest(**BODY)
    for i in range(2):
        assert admit(p, t.caller, req, BODY, f"k{i}").status == 202
    before = footprint(conn, t.tenant_id)
    with pytest.raises(Rejected) as e:
        admit(p, t.caller, req, BODY, "k2")
    code = f"REJECT_{which.upper()}_RATE_LIMIT"
    assert (e.value.decision, e.value.status) == (code, 429) and e.value.retry_after_seconds >= 1
    assert footprint(conn, t.tenant_id) == before
    bucket = f"user:{t.user_id}:submit" if which == "user" else f"tenant:{t.tenant_id}:submit"
    row = conn.execute("select tokens from rate_limit_bucket where bucket_key = %s", (bucket,)).fetchone()
    assert row is not None and float(row["tokens"]) < 1


def test_rate_limit_fallback_through_http(redis_down, conn, serve):
    api = serve(redis_down)
    t = new_tenant(redis_down, user_submit_rate_per_minute=1)
    accepted(api.submit(t))
    before = footprint(conn, t.tenant_id)
    assert_rejected(api.submit(t), "REJECT_USER_RATE_LIMIT", conn, t.tenant_id, before)


def test_quote_reserves_nothing(platform, conn, serve, own_db):
    api = serve(platform)
    t = new_tenant(platform, credits=1000)
    before = footprint(conn, t.tenant_id)
    for _ in range(3):
        r = api.quote(t)
        assert r.status_code == 200, r.text
    q = r.json()
    assert q["quoted_amount"] == q["max_reserve_amount"] == PRICE and q["unit"] == "CREDIT"
    assert uuid.UUID(q["price_version_id"])
    assert footprint(conn, t.tenant_id) == before
    assert conn.execute("select count(*) as n from generation_task").fetchone()["n"] == 0
    # A quote is no promise of admission, but an admission at the same version quotes the same.
    got = accepted(api.submit(t))
    assert got["quote"]["price_version_id"] == q["price_version_id"]
    assert got["quote"]["quoted_amount"] == q["quoted_amount"]


def test_price_versions_are_immutable_and_tasks_keep_theirs(make_platform, conn, own_db):
    p1 = make_platform()
    t = new_tenant(p1)
    req = GenerationRequest(**BODY)
    first = json.loads(admit(p1, t.caller, req, BODY, "old-price").body)
    v1 = first["quote"]["price_version_id"]
    assert first["quote"]["quoted_amount"] == PRICE
    v1_row = price_book.load_version(conn, v1)

    dearer = PlatformConfig(prices={"video-model-x": ModelPrice(per_second_amount=20)})  # (20 + 20 * 5) = 120
    v2 = price_book.ensure_price_book(conn, dearer, datetime.now(timezone.utc))
    assert str(v2) != v1
    assert price_book.ensure_price_book(conn, dearer, datetime.now(timezone.utc)) == v2  # unchanged rules: no new version
    p2 = make_platform(dearer)
    second = json.loads(admit(p2, t.caller, req, BODY, "new-price").body)
    assert second["quote"]["price_version_id"] == str(v2) and second["quote"]["quoted_amount"] == 120

    # The old version is closed, not edited; its rules are as they were.
    old = price_book.load_version(conn, v1)
    assert old["rules"] == v1_row["rules"] and old["effective_from"] == v1_row["effective_from"]
    assert old["effective_to"] is not None
    with pytest.raises(psycopg.errors.RaiseException, match="immutable"):
        conn.execute("update price_book set rules = '{}'::jsonb where price_version_id = %s", (v1,))
    # The first task keeps the version and amount it was quoted with.
    for table in ("generation_charge", "credit_reservation"):
        row = conn.execute(f"select * from {table} where task_id = %s", (first["task_id"],)).fetchone()
        assert (str(row["price_version_id"]), row["quoted_amount"]) == (v1, PRICE), table
    row = conn.execute("select * from generation_charge where task_id = %s", (second["task_id"],)).fetchone()
    assert (str(row["price_version_id"]), row["quoted_amount"]) == (str(v2), 120)


def test_lots_are_spent_earliest_expiry_first_then_by_priority(platform, conn, serve):
    api = serve(platform)
    t = new_tenant(platform, credits=100)  # a PAID lot without expiry
    now = datetime.now(timezone.utc)

    def add_lots(c):
        w = wallet_row(c, t.tenant_id)
        out = {}
        for name, kind, amount, expires in (("sub", "SUBSCRIPTION", 30, now + timedelta(days=5)),
                                            ("comp", "COMPENSATION", 40, now + timedelta(days=10)),
                                            ("promo", "PROMOTIONAL", 50, now + timedelta(days=10))):
            key = f"grant:test:{name}"
            grant_credits(c, w, amount, kind=kind, business_key=key, expires_at=expires)
            out[name] = c.execute("select lot_id from credit_lot where source_business_key = %s", (key,)).fetchone()["lot_id"]
        return out

    lots = platform.db.transaction(add_lots)
    lots["paid"] = conn.execute("select lot_id from credit_lot where tenant_id = %s and kind = 'PAID'",
                                (t.tenant_id,)).fetchone()["lot_id"]
    assert wallet_row(conn, t.tenant_id)["available_amount"] == 220
    start = footprint(conn, t.tenant_id)

    def allocation(task_id) -> dict:
        rows = conn.execute("""select a.lot_id, a.amount from reservation_allocation a join credit_reservation r using (reservation_id)
                                where r.task_id = %s""", (task_id,)).fetchall()
        by_lot = {v: k for k, v in lots.items()}
        return {by_lot[r["lot_id"]]: r["amount"] for r in rows}

    # Earliest expiry first: the subscription (5 days), then, at equal expiry (10 days), promotional
    # before compensation by priority; the paid lot that never expires comes last.
    first = accepted(api.submit(t))
    assert allocation(first["task_id"]) == {"sub": 30, "promo": 40}
    second = accepted(api.submit(t))
    assert allocation(second["task_id"]) == {"promo": 10, "comp": 40, "paid": 20}
    remaining = {name: conn.execute("select remaining_amount from credit_lot where lot_id = %s", (lot,)).fetchone()["remaining_amount"]
                 for name, lot in lots.items()}
    assert remaining == {"sub": 0, "promo": 0, "comp": 0, "paid": 80}
    reserve = conn.execute("""select e.lot_id, e.bucket, e.amount_delta from ledger_entry e join ledger_transaction t using (ledger_txn_id)
                               where t.task_id = %s and t.event_type = 'RESERVE'""", (second["task_id"],)).fetchall()
    assert sorted((e["lot_id"], e["bucket"], e["amount_delta"]) for e in reserve) == sorted(
        [(lots[n], b, s * a) for n, a in (("promo", 10), ("comp", 40), ("paid", 20)) for b, s in (("AVAILABLE", -1), ("RESERVED", 1))])
    wallet = api.wallet(t)
    assert sum(lot["remaining_amount"] for lot in wallet["lots"]) == wallet["available_amount"] == 80

    # Cancelling both gives every credit back to the very lot it came from.
    for task in (first, second):
        assert api.cancel(t, task["task_id"]).json()["state"] == "CANCELLED"
    end = footprint(conn, t.tenant_id)
    assert end["lots"] == start["lots"]
    assert end["wallet"]["available_amount"] == 220 and end["wallet"]["reserved_amount"] == 0
    assert_wallet_matches_ledger(conn, t.tenant_id)


def test_postpaid_within_the_credit_limit(platform, conn, serve):
    api = serve(platform)
    t = new_tenant(platform, account_type="POSTPAID", credits=2 * PRICE + 10)  # the credit limit
    w = api.wallet(t)
    assert (w["account_type"], w["available_amount"], w["credit_limit_amount"]) == ("POSTPAID", 0, 2 * PRICE + 10)
    accepted(api.submit(t))
    accepted(api.submit(t))
    w = api.wallet(t)
    assert (w["available_amount"], w["reserved_amount"]) == (-2 * PRICE, 2 * PRICE)
    before = footprint(conn, t.tenant_id)
    assert_rejected(api.submit(t), "REJECT_INSUFFICIENT_CREDIT", conn, t.tenant_id, before)  # -210 < -150
    assert conn.execute("select count(*) as n from reservation_allocation where tenant_id = %s",
                        (t.tenant_id,)).fetchone()["n"] == 0  # a credit limit, not lots
    assert_wallet_matches_ledger(conn, t.tenant_id)


def test_same_key_replays_byte_for_byte_and_a_different_body_is_refused(platform, conn, serve):
    api = serve(platform)
    t = new_tenant(platform)
    first = api.submit(t, key="same")
    accepted(first)
    before = footprint(conn, t.tenant_id)
    again = api.submit(t, key="same")
    assert (again.status_code, again.content) == (first.status_code, first.content)
    other = api.submit(t, {**BODY, "duration_seconds": 6}, key="same")
    assert other.status_code == 422 and other.json()["error"] == "IDEMPOTENCY_KEY_REUSED"
    assert footprint(conn, t.tenant_id) == before
    # Keys belong to a tenant: another tenant's "same" is a request of its own.
    stranger = new_tenant(platform)
    theirs = accepted(api.submit(stranger, key="same"))
    assert theirs["task_id"] != first.json()["task_id"]


def test_a_lane_without_capacity_rejects_as_too_long_a_wait(make_platform, conn, serve, own_db):
    # capacity 0 and no completions: μ = 0, so the expected wait is unbounded.
    p = make_platform(PlatformConfig(lanes={"PAID_SHARED": LaneConfig(capacity_units=0)}))
    api = serve(p)
    t = new_tenant(p, allow_best_effort_downgrade=False)
    before = footprint(conn, t.tenant_id)
    body = assert_rejected(api.submit(t), "REJECT_EXPECTED_WAIT_TOO_LONG", conn, t.tenant_id, before)
    assert body["retry_after_seconds"] >= 1


def test_no_downgrade_into_a_closed_best_effort_lane(make_platform, conn, serve, own_db):
    config = PlatformConfig(lanes={"PAID_SHARED": LaneConfig(capacity_units=1),
                                   "BEST_EFFORT": LaneConfig(capacity_units=200, admission_open=False)})
    p = make_platform(config)
    api = serve(p)
    t = new_tenant(p, max_wait_seconds=75, allow_best_effort_downgrade=True)
    for _ in range(3):
        clear_cache(p)
        assert accepted(api.submit(t))["decision"] == "ACCEPTED"
    clear_cache(p)
    before = footprint(conn, t.tenant_id)
    # The wait is too long, and the lane it could be downgraded to is closed to admission.
    assert_rejected(api.submit(t), "REJECT_EXPECTED_WAIT_TOO_LONG", conn, t.tenant_id, before)
    assert conn.execute("select count(*) as n from generation_task where queue_class = 'BEST_EFFORT'").fetchone()["n"] == 0


def test_an_expired_lot_is_not_spent_and_its_credit_does_not_admit(platform, conn, serve):
    """Until the expiry job posts its EXPIRE, an expired lot's credit is still in the wallet's
    available amount; admission must neither spend it nor fail on it."""
    api = serve(platform)
    t = new_tenant(platform, credits=PRICE + 30)  # a PAID lot without expiry
    yesterday = datetime.now(timezone.utc) - timedelta(days=1)
    platform.db.transaction(lambda c: grant_credits(c, wallet_row(c, t.tenant_id), 100, kind="PROMOTIONAL",
                                                    business_key="grant:test:expired", expires_at=yesterday))
    assert wallet_row(conn, t.tenant_id)["available_amount"] == PRICE + 130
    first = accepted(api.submit(t))
    expired = conn.execute("select remaining_amount from credit_lot where source_business_key = 'grant:test:expired'").fetchone()
    assert expired["remaining_amount"] == 100  # untouched: the task was paid from the live PAID lot
    lots = conn.execute("""select l.kind, a.amount from reservation_allocation a join credit_lot l using (lot_id)
                            join credit_reservation r using (reservation_id) where r.task_id = %s""", (first["task_id"],)).fetchall()
    assert [(r["kind"], r["amount"]) for r in lots] == [("PAID", PRICE)]
    # 130 available on paper, but only 30 of it is live credit.
    before = footprint(conn, t.tenant_id)
    assert_rejected(api.submit(t), "REJECT_INSUFFICIENT_CREDIT", conn, t.tenant_id, before)
