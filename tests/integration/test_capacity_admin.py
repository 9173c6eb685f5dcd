"""Capacities, switches and price versions an operator changes at run time (issue 16,
aivedio.admin.capacity, aivedio.pricing.price_book): a lowered provider account concurrency binds the
next claims (never above the new limit, running work never cut), a closed resource class or lane
answers REJECT_RESOURCE_CLASS_DISABLED through admission in another process within seconds and
reopens, an overlapping price version is refused with nothing changed, bad input writes nothing (no
audit row either), every change is in audit_log with its old and new values, and a process start
keeps what the operator set."""
from __future__ import annotations

import json
import time
from datetime import timedelta

import psycopg
import pytest

from aivedio.admin import capacity, prices
from aivedio.scheduling import resources
from aivedio.policy import capacity as policy_capacity
from aivedio.admission.decisions import Rejected
from aivedio.admission.models import GenerationRequest
from aivedio.admission.service import admit
from aivedio.bootstrap import apply_config
from aivedio.config import LaneConfig, Limits, PlatformConfig, ProviderAccount, ProviderConfig
from aivedio.errors import InvalidRequest
from aivedio.pricing import price_book
from aivedio.scheduling.resources import account_key, provider_key, shard_allocation, split
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import BODY, PRICE, new_tenant
from tests.conftest import create_test_database, drop_test_database
from tests.scheduler_support import BODY_1U, OPEN, UNCAPPED, complete, pick_attempts, submit

pytestmark = pytest.mark.timeout(180)
PROVIDER, ACCOUNT = "sim-cap", "acct-1"


@pytest.fixture
def db_url():
    """A database per test: overrides and pools are platform-wide, and each test starts from the config."""
    url = create_test_database("capacity_admin")
    yield url
    drop_test_database(url)


def config(slots: int = 6, shards: int = 2) -> PlatformConfig:
    return PlatformConfig(providers=[ProviderConfig(name=PROVIDER, accounts=[ProviderAccount(account_id=ACCOUNT,
                                                                                            max_concurrency=slots)])],
                          lanes={"PAID_SHARED": LaneConfig(capacity_units=100)}, limits=Limits(pool_shards=shards))


def change(p, fn):
    return capacity.run_change(p, lambda conn: fn(conn))


def shards(conn, key: str) -> list[tuple[int, int, int | None]]:
    return [(r["capacity_units"], r["used_units"], r["limit_units"]) for r in conn.execute(
        "select capacity_units, used_units, limit_units from resource_pool_shard where resource_key = %s order by shard_no",
        (key,)).fetchall()]


def in_use(conn, key: str) -> int:
    return sum(u for _, u, _ in shards(conn, key))


def audit_rows(conn, action: str) -> list[dict]:
    return conn.execute("select operator, action, target, old_value, new_value, reason from audit_log where action = %s "
                        "order by audit_id", (action,)).fetchall()


def footprint(conn) -> dict:
    """Everything a change could write."""
    return {"overrides": conn.execute("select count(*) as n from capacity_override").fetchone()["n"],
            "audit": conn.execute("select count(*) as n from audit_log").fetchone()["n"],
            "pools": conn.execute("select resource_key, shard_no, capacity_units, limit_units, version from resource_pool_shard "
                                  "order by 1, 2").fetchall(),
            "prices": conn.execute("select price_version_id, effective_to, status from price_book order by 1").fetchall()}


# --- the shard allocation, pure ---------------------------------------------------------------------

@pytest.mark.parametrize("total,used", [(2, [0, 0]), (2, [2, 0]), (2, [3, 1]), (4, [4, 0, 0, 0]), (3, [1, 1, 1, 1]),
                                        (0, [2, 1]), (10, [6, 0]), (5, [2, 2, 2])])
def test_the_allocation_never_lets_claims_pass_the_new_total_and_never_cuts_running_work(total, used):
    alloc = shard_allocation(total, used)
    assert all(cap >= u for (cap, _), u in zip(alloc, used))  # capacity never below what runs
    allowed = [cap if lim is None else min(cap, lim) for cap, lim in alloc]
    # The worst case: every other shard still holds what it held (or filled to its allowance), and
    # this one claims up to its allowance. That is never more than the new total, unless what ran
    # already was (then no shard takes anything).
    for i in range(len(used)):
        others = sum(max(u, a) for j, (u, a) in enumerate(zip(used, allowed)) if j != i)
        if allowed[i] > used[i]:
            assert allowed[i] + others <= total, (i, alloc)
    if all(u <= t for u, t in zip(used, split(total, len(used)))):
        assert alloc == [(t, None) for t in split(total, len(used))]


# --- provider account concurrency ---------------------------------------------------------------------

def test_a_lowered_account_concurrency_binds_the_next_claims_and_running_work_finishes(make_platform, conn):
    p = make_platform(config(slots=6, shards=2))
    with p.db.connection() as c:
        apply_config(c, p.config, p.clock)
    t = new_tenant(p, weight=1, credits=1_000_000, **{**OPEN, **UNCAPPED})
    submit(p, t.tenant_id, t.user_id, body=BODY_1U, n=14)
    sched = Scheduler(p)
    sched.tick(5)
    key = account_key(PROVIDER, ACCOUNT)
    assert in_use(conn, key) == 6
    running = pick_attempts(p, 100)
    assert len(running) == 6

    doc = change(p, lambda c: capacity.set_provider_account(c, p.config, operator="ops-jane", provider=PROVIDER,
                                                            account_id=ACCOUNT, max_concurrency=2, reason="provider asked"))
    assert (doc["max_concurrency"], doc["configured_max_concurrency"]) == (2, 6)
    # Nothing running was cut: the same six attempts hold their reservations.
    assert in_use(conn, key) == 6
    assert conn.execute("select count(*) as n from task_attempt where state = 'RUNNING'").fetchone()["n"] == 6
    model_key = provider_key(PROVIDER, ACCOUNT, "us", "video-model-x")
    assert sum(min(c, lim if lim is not None else c) for c, _, lim in shards(conn, model_key)) <= 6

    old = {a.attempt_id for a in running}  # in flight when the limit was lowered
    for _ in range(12):  # finish work one at a time; after each, a convergence pass and a tick
        complete(p, running.pop(0))
        resources.converge(p, force=True)
        sched.tick(5)
        running += pick_attempts(p, 100)
        assert in_use(conn, key) == len(running)
        # A new claim only ever took the account to the new limit: above it is what ran before.
        assert len(running) <= max(2, sum(a.attempt_id in old for a in running)), running
    # Drained: exactly the new limit runs, and the shards are the plain split of 2.
    assert in_use(conn, key) == 2
    resources.converge(p, force=True)
    assert [c for c, _, _ in shards(conn, key)] == split(2, 2)

    [row] = audit_rows(conn, "provider_account.set")
    assert (row["operator"], row["target"], row["reason"]) == ("ops-jane", f"provider_account:{PROVIDER}/{ACCOUNT}",
                                                               "provider asked")
    assert (row["old_value"], row["new_value"]) == ({"max_concurrency": 6}, {"max_concurrency": 2})

    # Raised again: the next tick fills up to the new limit.
    change(p, lambda c: capacity.set_provider_account(c, p.config, operator="ops-jane", provider=PROVIDER,
                                                      account_id=ACCOUNT, max_concurrency=5, reason="recovered"))
    submit(p, t.tenant_id, t.user_id, body=BODY_1U, n=6)
    sched.tick(5)
    assert in_use(conn, key) == 5


def test_the_scheduler_tick_resplits_a_drained_pool_on_its_own(make_platform, conn):
    p = make_platform(config(slots=4, shards=2).model_copy(update={"time_scale": 50.0}))  # convergence every 0.1 s
    with p.db.connection() as c:
        apply_config(c, p.config, p.clock)
    t = new_tenant(p, weight=1, credits=1_000_000, **{**OPEN, **UNCAPPED})
    submit(p, t.tenant_id, t.user_id, body=BODY_1U, n=4)
    sched = Scheduler(p)
    sched.tick(5)
    running = pick_attempts(p, 100)
    change(p, lambda c: capacity.set_provider_account(c, p.config, operator="ops", provider=PROVIDER, account_id=ACCOUNT,
                                                      max_concurrency=1, reason="x"))
    for a in running:
        complete(p, a)
    time.sleep(0.2)
    sched.tick(1)
    assert [cap for cap, _, _ in shards(conn, account_key(PROVIDER, ACCOUNT))] == split(1, 2)


def test_a_process_start_keeps_the_operators_capacities(make_platform, conn):
    p = make_platform(config(slots=6, shards=2))
    with p.db.connection() as c:
        apply_config(c, p.config, p.clock)
    change(p, lambda c: capacity.set_provider_account(c, p.config, operator="ops", provider=PROVIDER, account_id=ACCOUNT,
                                                      max_concurrency=3, reason="throttled"))
    change(p, lambda c: capacity.set_lane(c, p.config, operator="ops", lane="PAID_SHARED", capacity_units=40,
                                          reason="shrink"))
    change(p, lambda c: capacity.set_pool(c, p.config, operator="ops", key="worker:gpu", capacity_units=7, reason="gpus"))
    other = make_platform(config(slots=6, shards=2))  # another process starts with the same file
    with other.db.connection() as c:
        apply_config(c, other.config, other.clock)
    assert [c for c, _, _ in shards(conn, account_key(PROVIDER, ACCOUNT))] == split(3, 2)
    assert sum(c for c, _, _ in shards(conn, "lane:PAID_SHARED")) == 40
    assert sum(c for c, _, _ in shards(conn, "worker:gpu")) == 7
    assert policy_capacity.effective_config(other).lanes["PAID_SHARED"].capacity_units == 40


# --- lanes and pools ----------------------------------------------------------------------------------

def test_a_lane_change_resizes_its_pool_shows_in_the_report_and_is_audited(make_platform, conn):
    p = make_platform(config())
    with p.db.connection() as c:
        apply_config(c, p.config, p.clock)
    ent = p.config.lanes["ENTERPRISE_RESERVED"]
    doc = change(p, lambda c: capacity.set_lane(c, p.config, operator="ops", lane="ENTERPRISE_RESERVED",
                                                capacity_units=300, borrowable_units=100, reason="rebalance"))
    assert (doc["capacity_units"], doc["borrowable_units"], doc["min_headroom_units"]) == (300, 100, ent.min_headroom_units)
    assert sum(c for c, _, _ in shards(conn, "lane:ENTERPRISE_RESERVED")) == 300
    assert sum(c for c, _, _ in shards(conn, "lane:ENTERPRISE_RESERVED:lent")) == 100
    # A second change keeps the first's other fields.
    change(p, lambda c: capacity.set_lane(c, p.config, operator="ops", lane="ENTERPRISE_RESERVED", borrowable_units=0,
                                          reason="no lending"))
    eff = policy_capacity.effective_config(p).lanes["ENTERPRISE_RESERVED"]
    assert (eff.capacity_units, eff.borrowable_units) == (300, 0)
    assert sum(c for c, _, _ in shards(conn, "lane:ENTERPRISE_RESERVED:lent")) == 0
    report = {r["lane"]: r for r in capacity.lane_report(p)}
    r = report["ENTERPRISE_RESERVED"]
    assert (r["capacity_units"], r["borrowable_units"], r["in_force_units"], r["admission_open"]) == (300, 0, 300, True)
    assert r["override"]["updated_by"] == "ops" and r["override"]["version"] == 2
    assert {"queued_units", "queued_tasks", "running_units", "oldest_wait_seconds"} <= set(r)
    assert report["PAID_SHARED"]["override"] is None
    rows = audit_rows(conn, "lane.set")
    assert [(x["old_value"]["capacity_units"], x["new_value"]["capacity_units"]) for x in rows] == [(500, 300), (300, 300)]
    assert [(x["old_value"]["borrowable_units"], x["new_value"]["borrowable_units"]) for x in rows] == [(200, 100), (100, 0)]
    assert [x["reason"] for x in rows] == ["rebalance", "no lending"]

    pool = change(p, lambda c: capacity.set_pool(c, p.config, operator="ops", key="worker:gpu", capacity_units=4,
                                                 reason="two GPUs down"))
    assert (pool["capacity_units"], pool["configured_units"]) == (4, 32)
    with p.db.connection() as c:
        [gpu] = capacity.pool_report(c, p.config, policy_capacity.load_overrides(c), "worker:gpu")
    assert (gpu["capacity_units"], gpu["in_force_units"], gpu["configured_units"]) == (4, 4, 32)
    [row] = audit_rows(conn, "pool.set")
    assert (row["target"], row["old_value"], row["new_value"]) == ("pool:worker:gpu", {"capacity_units": 32},
                                                                   {"capacity_units": 4})


# --- switches -------------------------------------------------------------------------------------------

def _admit(p, t, body=BODY):
    return json.loads(admit(p, t.caller, GenerationRequest(**body), body, f"k-{time.monotonic_ns()}").body)


def _rejected(p, t, body=BODY) -> str | None:
    try:
        _admit(p, t, body)
    except Rejected as r:
        return r.decision
    return None


def _within_seconds(fn, seconds: float = 5.0):
    deadline = time.monotonic() + seconds
    while True:
        v = fn()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(0.1)


def test_a_closed_resource_class_is_refused_in_every_process_within_seconds_and_reopens(make_platform, conn):
    admin_side, api_side = make_platform(), make_platform()  # two processes: separate caches
    t = new_tenant(api_side, credits=100_000)
    assert _rejected(api_side, t) is None  # reads (and caches) the switches: all open
    change(admin_side, lambda c: capacity.set_switch(c, admin_side.config, operator="ops", resource_class="video-standard",
                                                     open=False, reason="provider incident"))
    assert _within_seconds(lambda: _rejected(api_side, t) == "REJECT_RESOURCE_CLASS_DISABLED",
                           policy_capacity.CACHE_SECONDS + 2)
    assert _rejected(api_side, t, {**BODY, "resolution": "4k"}) is None  # another class is still open
    [sw] = [s for s in capacity.switch_report(admin_side.config, policy_capacity.overrides(admin_side))
            if s["switch"] == "resource_class:video-standard"]
    assert sw["open"] is False and sw["override"]["reason"] == "provider incident"
    change(admin_side, lambda c: capacity.set_switch(c, admin_side.config, operator="ops", resource_class="video-standard",
                                                     open=True, reason="resolved"))
    assert _within_seconds(lambda: _rejected(api_side, t) is None, policy_capacity.CACHE_SECONDS + 2)
    rows = audit_rows(conn, "switch.set")
    assert [(r["old_value"], r["new_value"], r["target"]) for r in rows] == [
        ({"open": True}, {"open": False}, "switch:resource_class:video-standard"),
        ({"open": False}, {"open": True}, "switch:resource_class:video-standard")]


def test_a_closed_lane_is_refused_and_its_queued_work_still_runs(make_platform, conn):
    p = make_platform()
    t = new_tenant(p, credits=100_000, **{**OPEN, **UNCAPPED})
    queued = submit(p, t.tenant_id, t.user_id, body=BODY_1U, n=2)
    change(p, lambda c: capacity.set_switch(c, p.config, operator="ops", lane="PAID_SHARED", open=False, reason="drain"))
    assert _rejected(p, t) == "REJECT_RESOURCE_CLASS_DISABLED"
    assert {r["lane"]: r for r in capacity.lane_report(p)}["PAID_SHARED"]["admission_open"] is False
    with p.db.connection() as c:
        apply_config(c, p.config, p.clock)
    Scheduler(p).tick(5)
    states = {r["state"] for r in conn.execute("select state from generation_task where task_id = any(%s)",
                                               (queued,)).fetchall()}
    assert states == {"DISPATCHING"}  # a closed lane admits nothing new; what it had queued runs
    change(p, lambda c: capacity.set_switch(c, p.config, operator="ops", lane="PAID_SHARED", open=True, reason="done"))
    assert _rejected(p, t) is None


# --- price versions -------------------------------------------------------------------------------------

def test_price_versions_never_overlap_and_a_refusal_changes_nothing(make_platform, conn):
    p = make_platform()
    now = p.clock.now()
    with p.db.connection() as c:
        config_version = price_book.ensure_price_book(c, p.config, now)
    later = now + timedelta(hours=1)
    doc = change(p, lambda c: prices.create_price_version(
        c, p.config, operator="fin-ann", effective_from=later, models={"video-model-x": {"per_second_amount": 12}},
        reason="new rates", now=p.clock.now()))
    assert doc["supersedes"] == str(config_version) and doc["effective_to"] is None
    assert doc["rules"]["models"]["video-model-x"]["per_second_amount"] == 12
    assert doc["rules"]["models"]["video-model-x"]["base_amount"] == 20  # left out: kept from the version it follows
    closed = conn.execute("select effective_to from price_book where price_version_id = %s", (config_version,)).fetchone()
    assert closed["effective_to"] == later

    before = footprint(conn)
    for start, why in ((now + timedelta(minutes=30), "inside the config version's range, now closed"),
                       (later, "the same start as the new version"),
                       (now - timedelta(days=1), "in the past, over the version in force")):
        with pytest.raises(InvalidRequest) as e:
            capacity.run_change(p, lambda c, s=start: prices.create_price_version(
                c, p.config, operator="fin-ann", effective_from=s, models={}, reason="again", now=p.clock.now()))
        assert "effective_from" in e.value.fields and "overlaps" in e.value.fields["effective_from"], why
    assert footprint(conn) == before  # nothing changed, not even an audit row

    # A version after the open one supersedes it at its start; a bounded one then refuses what it covers.
    doc2 = change(p, lambda c: prices.create_price_version(
        c, p.config, operator="fin-ann", effective_from=later + timedelta(hours=1),
        effective_to=later + timedelta(hours=2), models={}, reason="promo", now=p.clock.now()))
    assert doc2["supersedes"] == doc["price_version_id"]
    with pytest.raises(InvalidRequest) as e:
        change(p, lambda c: prices.create_price_version(
            c, p.config, operator="fin-ann", effective_from=later + timedelta(hours=1, minutes=30), models={},
            reason="overlap", now=p.clock.now()))
    assert "effective_from" in e.value.fields
    listed = price_book.list_price_versions(conn, limit=2)
    assert [v["price_version_id"] for v in listed["items"]] == [doc2["price_version_id"], doc["price_version_id"]]
    assert listed["next_cursor"] is not None
    rest = price_book.list_price_versions(conn, limit=2, cursor=listed["next_cursor"])
    assert [v["price_version_id"] for v in rest["items"]] == [str(config_version)] and rest["next_cursor"] is None
    rows = audit_rows(conn, "price.create")
    assert [r["new_value"]["price_version_id"] for r in rows] == [doc["price_version_id"], doc2["price_version_id"]]
    assert rows[0]["old_value"] == {"price_version_id": str(config_version), "effective_to": None}


def test_a_version_from_now_prices_the_next_admission_and_a_start_keeps_it(make_platform, conn):
    p = make_platform()
    t = new_tenant(p, credits=100_000)
    assert _admit(p, t)["quote"]["quoted_amount"] == PRICE
    doc = change(p, lambda c: prices.create_price_version(
        c, p.config, operator="fin", effective_from=None, models={"video-model-x": {"base_amount": 30}},
        reason="base up", now=p.clock.now()))
    time.sleep(1.1)  # admission caches the version in force for a second
    q = _admit(p, t)["quote"]
    assert (q["price_version_id"], q["quoted_amount"]) == (doc["price_version_id"], PRICE + 10)
    with p.db.connection() as c:  # a process start: the config's prices do not replace the operator's
        assert str(price_book.ensure_price_book(c, p.config, p.clock.now())) == doc["price_version_id"]


# --- bad input ------------------------------------------------------------------------------------------

BAD = [
    ("set_lane", dict(lane="PAID_SHARED", capacity_units=-1), "capacity_units"),
    ("set_lane", dict(lane="PAID_SHARED", capacity_units=1.5), "capacity_units"),
    ("set_lane", dict(lane="PAID_SHARED", capacity_units="12"), "capacity_units"),
    ("set_lane", dict(lane="PAID_SHARED", capacity_units=True), "capacity_units"),
    ("set_lane", dict(lane="PAID_SHARED", capacity_units=10, borrowable_units=11), "borrowable_units"),
    ("set_lane", dict(lane="ENTERPRISE_RESERVED", capacity_units=100), "capacity_units"),  # below its borrowable 200
    ("set_lane", dict(lane="GOLD", capacity_units=10), "lane"),
    ("set_lane", dict(lane="PAID_SHARED"), "capacity_units"),
    ("set_lane", dict(lane="PAID_SHARED", capacity_units=10, reason=""), "reason"),
    ("set_pool", dict(key="worker:tpu", capacity_units=1), "key"),
    ("set_pool", dict(key="lane:PAID_SHARED", capacity_units=1), "key"),
    ("set_pool", dict(key="worker:gpu", capacity_units=-3), "capacity_units"),
    ("set_provider_account", dict(provider="nope", account_id=ACCOUNT, max_concurrency=1), "provider"),
    ("set_provider_account", dict(provider=PROVIDER, account_id="acct-9", max_concurrency=1), "account_id"),
    ("set_provider_account", dict(provider=PROVIDER, account_id=ACCOUNT, max_concurrency=0), "max_concurrency"),
    ("set_provider_account", dict(provider=PROVIDER, account_id=ACCOUNT, max_concurrency="2"), "max_concurrency"),
    ("set_switch", dict(resource_class="video-8k", open=False), "resource_class"),
    ("set_switch", dict(lane="GOLD", open=False), "lane"),
    ("set_switch", dict(lane="PAID_SHARED", open="no"), "open"),
    ("set_switch", dict(lane=["PAID_SHARED"], open=False), "lane"),
    ("set_switch", dict(lane="PAID_SHARED", resource_class="video-4k", open=False), "lane"),
]


def test_bad_input_names_the_field_and_writes_nothing_not_even_an_audit_row(make_platform, conn):
    p = make_platform(config())
    with p.db.connection() as c:
        apply_config(c, p.config, p.clock)
    ent = new_tenant(p, service_class="ENTERPRISE_RESERVED", reserved_units=200)
    before = footprint(conn)
    with pytest.raises(InvalidRequest) as e:  # below what a tenant of the lane has reserved
        change(p, lambda c: capacity.set_lane(c, p.config, operator="ops", lane="ENTERPRISE_RESERVED", capacity_units=150,
                                              borrowable_units=100, reason="shrink"))
    assert str(ent.tenant_id) in e.value.fields["capacity_units"]
    for fn, kw, field in BAD:
        kw = {"reason": "test", **kw}
        with pytest.raises(InvalidRequest) as e:
            change(p, lambda c, fn=fn, kw=kw: getattr(capacity, fn)(c, p.config, operator="ops", **kw))
        assert field in e.value.fields, (fn, kw, e.value.fields)
    for models, field in (({"video-model-y": {}}, "rules.models.video-model-y"),
                          ({"video-model-x": {"base_amount": -1}}, "rules.models.video-model-x.base_amount"),
                          ({"video-model-x": {"resolution_multiplier_pct": {"720p": 100}}},
                           "rules.models.video-model-x.resolution_multiplier_pct"),
                          ({"video-model-x": {"charge_policy_code": "FREE"}}, "rules.models.video-model-x.charge_policy_code")):
        with pytest.raises(InvalidRequest) as e:
            change(p, lambda c, m=models: prices.create_price_version(c, p.config, operator="fin", effective_from=None,
                                                                          models=m, reason="x", now=p.clock.now()))
        assert field in e.value.fields, (models, e.value.fields)
    soon = p.clock.now() + timedelta(hours=1)
    with pytest.raises(InvalidRequest) as e:
        change(p, lambda c: prices.create_price_version(c, p.config, operator="fin", effective_from=soon,
                                                            effective_to=soon, models={}, reason="x", now=p.clock.now()))
    assert "effective_to" in e.value.fields
    assert footprint(conn) == before
    assert policy_capacity.effective_config(p) == p.config


def test_unreadable_overrides_fall_back_to_the_last_read(make_platform):
    p = make_platform()
    change(p, lambda c: capacity.set_switch(c, p.config, operator="ops", lane="STANDARD", open=False, reason="x"))
    assert policy_capacity.effective_config(p).lanes["STANDARD"].admission_open is False

    class Broken:
        def execute(self, *a, **k):
            raise psycopg.OperationalError("gone")

    p.extras[policy_capacity._CACHE] = (time.monotonic() - 60, *p.extras[policy_capacity._CACHE][1:])  # stale
    assert policy_capacity.effective_config(p, Broken()).lanes["STANDARD"].admission_open is False
