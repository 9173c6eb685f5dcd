"""Races of the operator plane's capacity and policy changes (issue 16 review), each between two
processes (two Platforms on one database, each with its own cached overrides) or two open
transactions:

- `converge` in a process whose cached overrides predate a change re-splits the pool to the change,
  never back to the capacity it remembers;
- a lane's capacity and a tenant's reserved_units (reserved_units <= the lane's capacity) are
  checked under one lock, the policy-set lock, so neither change validates against the other's
  uncommitted state: the second waits and is refused;
- a process start (serve, db migrate) during a drain keeps the drain's exact limits instead of
  splitting the lowered capacity evenly over the shards;
- the adaptive 429 limit (AIMD) of a provider account takes its target from the overrides in force,
  under the shards' locks, so a stale process cannot lift a drain's limits; and it never waits for a
  second pooled connection inside its own transaction."""
from __future__ import annotations

import threading
import time

import psycopg
import pytest
from psycopg.rows import dict_row

from aivedio.admin import capacity
from aivedio.scheduling import resources
from aivedio.policy import capacity as policy_capacity
from aivedio.policy import tenant_policy as policy
from aivedio.attempts import aimd
from aivedio.bootstrap import apply_config
from aivedio.config import LaneConfig, Limits, PlatformConfig, ProviderAccount, ProviderConfig
from aivedio.context import set_platform
from aivedio.errors import InvalidRequest
from aivedio.scheduling.resources import account_key
from tests.admission_support import new_tenant
from tests.conftest import create_test_database, drop_test_database

pytestmark = pytest.mark.timeout(120)
LANE, LANE_KEY = "PAID_SHARED", "lane:PAID_SHARED"
PROVIDER, ACCOUNT = "sim-cap", "acct-1"
BLOCKED_SECONDS = 1.0  # how long the second change must still be waiting while the first is open


@pytest.fixture
def db_url():
    """A database per test: overrides and pools are platform-wide."""
    url = create_test_database("capacity_races")
    yield url
    drop_test_database(url)


def lane_config(units: int = 500) -> PlatformConfig:
    return PlatformConfig(lanes={LANE: LaneConfig(capacity_units=units, borrowable_units=0)}, limits=Limits(pool_shards=2))


def account_config(slots: int = 6) -> PlatformConfig:
    return PlatformConfig(providers=[ProviderConfig(name=PROVIDER, accounts=[ProviderAccount(account_id=ACCOUNT,
                                                                                            max_concurrency=slots)])],
                          limits=Limits(pool_shards=2))


def started(make_platform, config: PlatformConfig, **kw):
    p = make_platform(config, **kw)
    p.db.transaction(lambda c: apply_config(c, p.config, p.clock))
    return p


def shards(p, key: str) -> list[tuple[int, int, int | None]]:
    with p.db.connection() as c:
        return [(r["capacity_units"], r["used_units"], r["limit_units"]) for r in c.execute(
            "select capacity_units, used_units, limit_units from resource_pool_shard where resource_key = %s order by shard_no",
            (key,)).fetchall()]


def most_usable(rows: list[tuple[int, int, int | None]]) -> int:
    """The units the pool's claims could have in use at most: what runs plus each shard's room."""
    return sum(max(u, min(cap, cap if lim is None else lim)) for cap, u, lim in rows)


def set_lane(p, units: int):
    return capacity.run_change(p, lambda c: capacity.set_lane(c, p.config, operator="op:lane", lane=LANE,
                                                              capacity_units=units))


def lane_capacity_and_reserved(p, tenant_id) -> tuple[int, int]:
    with p.db.connection() as c:
        lane = policy_capacity.apply_overrides(p.config, policy_capacity.load_overrides(c)).lanes[LANE]
        row = c.execute("select reserved_units from tenant_scheduling_policy where tenant_id = %s", (tenant_id,)).fetchone()
    return lane.capacity_units, row["reserved_units"]


def in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["doc"] = fn()
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


# --- converge ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("first", [None, 300])
def test_converge_on_stale_cached_overrides_never_puts_an_old_capacity_back(make_platform, first):
    scheduler, admin = started(make_platform, lane_config()), make_platform(lane_config())
    if first is not None:
        set_lane(admin, first)
    policy_capacity.overrides(scheduler)  # the scheduler's tick has read the overrides (within CACHE_SECONDS)
    set_lane(admin, 100)
    assert sum(cap for cap, _, _ in shards(admin, LANE_KEY)) == 100
    resources.converge(scheduler, force=True)
    after = shards(admin, LANE_KEY)
    assert sum(cap for cap, _, _ in after) == 100 and most_usable(after) == 100, after


def test_converge_re_splits_a_drained_pool_to_the_capacity_in_force(make_platform):
    """The fresh read inside converge still does its job: a drain that has ended is re-split."""
    scheduler, admin = started(make_platform, lane_config(100)), make_platform(lane_config(100))
    admin.db.transaction(lambda c: c.execute(
        "update resource_pool_shard set capacity_units = case shard_no when 0 then 80 else 50 end, "
        "used_units = case shard_no when 0 then 80 else 0 end where resource_key = %s", (LANE_KEY,)))
    set_lane(admin, 300)
    policy_capacity.overrides(scheduler)  # cached: 300
    set_lane(admin, 60)  # 80 running on shard 0: drains
    assert most_usable(shards(admin, LANE_KEY)) == 80
    admin.db.transaction(lambda c: c.execute("update resource_pool_shard set used_units = 0 where resource_key = %s",
                                             (LANE_KEY,)))
    assert resources.converge(scheduler, force=True) == 1
    assert shards(admin, LANE_KEY) == [(30, 0, None), (30, 0, None)]


# --- the lane's capacity against reserved_units ----------------------------------------------------

def test_a_lane_lowered_while_a_policy_change_is_open_waits_for_it_and_is_refused(make_platform, db_url):
    p = started(make_platform, lane_config())
    set_platform(p)
    try:
        t = new_tenant(p, service_class=LANE, max_running_units=1000)
        open_tx = psycopg.connect(db_url, row_factory=dict_row)  # not autocommit: one open transaction
        try:
            doc = policy.set_policy(open_tx, operator="op:policy", tenant_id=t.tenant_id, changes={"reserved_units": 400})
            assert doc["reserved_units"] == 400  # validated against 500, uncommitted
            th, out = in_thread(lambda: set_lane(p, 200))
            th.join(BLOCKED_SECONDS)
            assert th.is_alive(), f"the lane change did not wait for the open policy change: {out}"
            open_tx.commit()
            th.join(30)
        finally:
            open_tx.close()
        assert isinstance(out.get("error"), InvalidRequest), out
        assert "capacity_units" in out["error"].details["fields"]
        cap, reserved = lane_capacity_and_reserved(p, t.tenant_id)
        assert (cap, reserved) == (500, 400)
    finally:
        set_platform(None)


def test_a_policy_change_while_a_lane_change_is_open_waits_for_it_and_is_refused(make_platform, db_url):
    p = started(make_platform, lane_config())
    set_platform(p)
    try:
        t = new_tenant(p, service_class=LANE, max_running_units=1000)
        open_tx = psycopg.connect(db_url, row_factory=dict_row)
        try:
            capacity.set_lane(open_tx, p.config, operator="op:lane", lane=LANE, capacity_units=200)  # uncommitted
            th, out = in_thread(lambda: policy.change_policy(p, operator="op:policy", tenant_id=t.tenant_id,
                                                             changes={"reserved_units": 400}))
            th.join(BLOCKED_SECONDS)
            assert th.is_alive(), f"the policy change did not wait for the open lane change: {out}"
            open_tx.commit()
            th.join(30)
        finally:
            open_tx.close()
        assert isinstance(out.get("error"), InvalidRequest), out
        assert "reserved_units" in out["error"].details["fields"]
        cap, reserved = lane_capacity_and_reserved(p, t.tenant_id)
        assert (cap, reserved) == (200, 0)
    finally:
        set_platform(None)


# --- a process start during a drain --------------------------------------------------------------------

def test_a_start_during_a_drain_keeps_the_drains_limits(make_platform):
    p = started(make_platform, lane_config(100))
    # 80 units run on shard 0, as claims would have left them.
    p.db.transaction(lambda c: c.execute(
        "update resource_pool_shard set capacity_units = case shard_no when 0 then 80 else 50 end, "
        "used_units = case shard_no when 0 then 80 else 0 end where resource_key = %s", (LANE_KEY,)))
    set_lane(p, 60)
    drain = shards(p, LANE_KEY)
    assert most_usable(drain) == 80  # nothing new until 20 units have drained
    restarted = make_platform(lane_config(100))
    restarted.db.transaction(lambda c: apply_config(c, restarted.config, restarted.clock))  # serve start, db migrate
    after = shards(p, LANE_KEY)
    assert most_usable(after) == 80 and after == drain, after


def test_a_start_applies_a_changed_config_and_creates_missing_pools(make_platform):
    """The other half of ensure_platform_pools: pools without shards are created, and a pool with no
    override moves to the config's new capacity."""
    p = started(make_platform, lane_config(100))
    p.db.transaction(lambda c: c.execute("delete from resource_pool_shard where resource_key = 'worker:cpu'"))
    bigger = make_platform(lane_config(140))
    bigger.db.transaction(lambda c: apply_config(c, bigger.config, bigger.clock))
    assert shards(p, LANE_KEY) == [(70, 0, None), (70, 0, None)]
    assert sum(cap for cap, _, _ in shards(p, "worker:cpu")) == bigger.config.pools.worker_cpu_units


# --- the adaptive 429 limit ----------------------------------------------------------------------------

def test_a_stale_aimd_increase_does_not_lift_a_drain(make_platform):
    worker = started(make_platform, account_config(6))
    admin = make_platform(account_config(6))
    key = account_key(PROVIDER, ACCOUNT)
    worker.db.transaction(lambda c: c.execute("update resource_pool_shard set used_units = 2 where resource_key = %s", (key,)))
    policy_capacity.overrides(worker)  # the worker's cache: max_concurrency 6
    capacity.run_change(admin, lambda c: capacity.set_provider_account(c, admin.config, operator="op:a", provider=PROVIDER,
                                                                       account_id=ACCOUNT, max_concurrency=2))
    drain = shards(admin, key)
    assert most_usable(drain) == 4  # 4 running, nothing new until 2 have finished
    assert aimd.increase(worker, PROVIDER, ACCOUNT) is None
    assert shards(admin, key) == drain
    assert aimd.decrease(worker, PROVIDER, ACCOUNT) is None
    assert shards(admin, key) == drain


def test_aimd_never_waits_for_a_second_connection_inside_its_transaction(make_platform):
    """One pooled connection: a cache refresh on another connection inside the transaction would wait
    for the pool (30 s) while holding the only one."""
    worker = started(make_platform, account_config(6), pool_size=1)
    key = account_key(PROVIDER, ACCOUNT)
    assert aimd.decrease(worker, PROVIDER, ACCOUNT) is not None
    before = shards(worker, key)
    assert any(lim is not None for _, _, lim in before)
    policy_capacity.invalidate(worker)  # the overrides' cache is stale: the next read must use the caller's connection
    t0 = time.monotonic()
    assert aimd.increase(worker, PROVIDER, ACCOUNT) is not None
    assert time.monotonic() - t0 < 5
    assert sum(lim for _, _, lim in shards(worker, key) if lim is not None) > sum(lim for _, _, lim in before)
