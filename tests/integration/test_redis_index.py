"""Room service `redis-index` (aivedio.reconcile.redis_index), driven alone: each lane's Redis ring is
made to equal PostgreSQL's set of tenants with QUEUED tasks (missing ones added, idle ones and ones
the ring's list and set disagree about taken out), a lane whose index_built marker is gone is
rebuilt, DRR state is left alone, and a Redis that does not answer is reported, not written to."""
from __future__ import annotations

import pytest

from aivedio.cache.client import Cache
from aivedio.config import LaneConfig, MaintenanceService, PlatformConfig, ProviderAccount, ProviderConfig
from aivedio.reconcile import redis_index, room
from aivedio.scheduling.resources import ensure_platform_pools
from aivedio.scheduling.ring import Ring, _keys, active_tenants_pg, built_key
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import new_tenant
from tests.conftest import create_test_database, drop_test_database
from tests.redis_server import free_port
from tests.scheduler_support import OPEN, UNCAPPED, submit

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis_cluster]
NAME = redis_index.NAME
PAID, STD = "PAID_SHARED", "STANDARD"


@pytest.fixture
def db_url():
    url = create_test_database("redis_index")
    yield url
    drop_test_database(url)


def platform_with(make_platform, batch_size: int | None = None, **kw):
    cfg = PlatformConfig(providers=[ProviderConfig(name="sim-a", accounts=[ProviderAccount(account_id="a1")])],
                         lanes={PAID: LaneConfig(capacity_units=2)},
                         maintenance={NAME: MaintenanceService(batch_size=batch_size)} if batch_size else {})
    p = make_platform(cfg, **kw)
    with p.db.connection() as c:
        ensure_platform_pools(c, cfg)
    return p


def tenants_with_work(p, lane_class: str, n: int) -> list[str]:
    out = []
    for _ in range(n):
        t = new_tenant(p, service_class=lane_class, weight=1, credits=1_000_000, **{**OPEN, **UNCAPPED})
        submit(p, t.tenant_id, t.user_id, n=1, ring=False)
        out.append(str(t.tenant_id))
    return out


def assert_ring_is_postgresql(p, conn) -> None:
    ring = Ring(p)
    for lane in p.config.lanes:
        members, listed = ring.members(lane)
        assert members == {str(t) for t in active_tenants_pg(conn, lane)}, lane
        assert sorted(listed) == sorted(members), f"{lane}: each tenant once in the list"


def test_a_missing_index_is_rebuilt(make_platform, conn):
    p = platform_with(make_platform)
    tenants_with_work(p, "PAID_SHARED", 2)
    assert not p.cache.r.exists(built_key(p.cache, PAID))
    report = redis_index.run_once(p)
    assert report.details["lanes_rebuilt"] == len(p.config.lanes) and report.details["tenants_added"] == 2
    assert all(p.cache.r.exists(built_key(p.cache, lane)) for lane in p.config.lanes)
    assert_ring_is_postgresql(p, conn)
    assert redis_index.run_once(p).repaired == 0  # nothing left to do


def test_drift_is_repaired_in_batches_and_drr_state_is_left_alone(make_platform, conn):
    p = platform_with(make_platform, batch_size=2)
    assert room.tuning(p, NAME).batch_size == 2
    redis_index.run_once(p)  # every lane's index built (empty)
    missing = tenants_with_work(p, "PAID_SHARED", 3)  # nobody told the ring
    listed_only, set_only = tenants_with_work(p, "STANDARD", 2)
    ring_key, set_key = _keys(p.cache, STD)
    p.cache.r.rpush(ring_key, listed_only, listed_only)  # in the list twice, not in the set: never picked fairly
    p.cache.r.sadd(set_key, set_only)  # in the set, not in the list: never picked at all
    idle = str(new_tenant(p, weight=1, credits=0, **OPEN).tenant_id)
    p.cache.r.sadd(_keys(p.cache, PAID)[1], idle)  # nothing queued, and half on the ring besides
    conn.execute("""insert into drr_lane_tenant (lane, tenant_id, deficit, active) values (%s, %s, 3, true)""", (PAID, idle))
    drr_before = conn.execute("select * from drr_lane_tenant order by lane, tenant_id").fetchall()

    report = redis_index.run_once(p)
    # 3 adds + 3 resets, in batches of 2: three full batches, then an empty one ends the run
    assert report.complete and report.batches == 4, report
    assert (report.details["tenants_added"], report.details["tenants_reset"], report.details["tenants_removed"]) == (3, 2, 1)
    assert_ring_is_postgresql(p, conn)
    assert set(missing) == Ring(p).members(PAID)[0] and idle not in Ring(p).members(PAID)[0]
    # Deficits and turns are PostgreSQL's: the idle tenant's banked deficit is still there.
    assert conn.execute("select * from drr_lane_tenant order by lane, tenant_id").fetchall() == drr_before
    assert redis_index.run_once(p).repaired == 0


def test_without_redis_it_reports_and_writes_nothing(make_platform):
    p = platform_with(make_platform, redis=False)
    report = redis_index.run_once(p)
    assert report.details["redis"] == "disabled" and report.complete and report.repaired == 0
    down = platform_with(make_platform)
    down.cache = Cache(f"redis://127.0.0.1:{free_port()}/0", "nowhere")  # nobody listens there
    report = redis_index.run_once(down)
    assert report.details["redis"] == "down" and not report.complete and report.repaired == 0


# --- the races the ring's writers must survive (found by tests/reliability/test_redis_faults.py) ---------------

def test_a_flush_during_a_rebuild_leaves_the_lane_unmarked_so_it_is_rebuilt_again(make_platform, conn, monkeypatch):
    from aivedio.scheduling import ring as ring_mod

    p = platform_with(make_platform)
    tenants_with_work(p, "PAID_SHARED", 2)
    real = ring_mod.active_tenants_pg

    def read_then_flush(c, lane):
        found = real(c, lane)
        p.cache.delete_prefix()  # FLUSHALL between the rebuild's read and its adds
        return found

    monkeypatch.setattr(ring_mod, "active_tenants_pg", read_then_flush)
    with p.db.connection() as c:
        Ring(p).rebuild(c, PAID)
    monkeypatch.setattr(ring_mod, "active_tenants_pg", real)
    # Marked before the read, the marker went with the flush: the lane is not taken for built.
    assert not Ring(p).redis_ready(PAID)
    Scheduler(p).tick(1, lanes=[PAID])  # rebuilt for real
    assert Ring(p).members(PAID)[0] >= {str(t) for t in active_tenants_pg(conn, PAID)}


def test_a_task_queued_while_its_tenants_empty_visit_removes_it_keeps_the_tenant_on_the_ring(make_platform, conn, monkeypatch):
    p = platform_with(make_platform)
    t = new_tenant(p, weight=1, credits=1_000_000, **{**OPEN, **UNCAPPED})
    redis_index.run_once(p)  # every lane marked built
    Ring(p).add(PAID, t.tenant_id)  # on the ring, nothing queued yet: its next visit is EMPTY
    real_remove = Ring.remove
    raced = []

    def remove_after_a_new_task(self, lane, tenant_id):
        if not raced:  # the tenant's new task commits and its queue indexer adds it, just before the removal
            raced.append(submit(p, t.tenant_id, t.user_id, n=1))
        real_remove(self, lane, tenant_id)

    monkeypatch.setattr(Ring, "remove", remove_after_a_new_task)
    Scheduler(p).tick(1, lanes=[PAID])
    assert raced
    # Not stranded: put back on the ring at once, so this very tick claimed it (or it still waits on the ring).
    (task_id,) = raced[0]
    state = conn.execute("select state from generation_task where task_id = %s", (task_id,)).fetchone()["state"]
    assert state == "DISPATCHING" or (state == "QUEUED" and str(t.tenant_id) in Ring(p).members(PAID)[0]), state
