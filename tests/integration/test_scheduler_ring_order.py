"""The ring holds backlogged tenants only (issue 14, whale-provider-bound): a visit that claims a
tenant's last queued task in the lane takes the tenant off the ring at once, as DRR's active list
drops a flow whose queue empties, so work it submits later makes it a newcomer that joins the round
behind the tenants already waiting. Left on the ring until a later visit found it empty, it kept its
place, and a task it submitted meanwhile went ahead of a tenant that had been waiting longer.

Each test gets a database of its own: pools and queues are global, so tests must not share them."""
from __future__ import annotations

import pytest

from aivedio.config import LaneConfig, PlatformConfig, ProviderAccount, ProviderConfig, SchedulerConfig
from aivedio.scheduling.resources import ensure_platform_pools
from aivedio.scheduling.ring import Ring
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import new_tenant
from tests.conftest import create_test_database, drop_test_database
from tests.scheduler_support import OPEN, UNCAPPED, complete, pick_attempts, submit

pytestmark = pytest.mark.timeout(180)
PAID = "PAID_SHARED"


@pytest.fixture
def db_url():
    url = create_test_database("scheduler_ring")
    yield url
    drop_test_database(url)


def _platform(make_platform, slots: int):
    config = PlatformConfig(
        providers=[ProviderConfig(name="sim-a", accounts=[ProviderAccount(account_id="a1", max_concurrency=500)])],
        lanes={"ENTERPRISE_RESERVED": LaneConfig(capacity_units=500, borrowable_units=0), PAID: LaneConfig(capacity_units=slots)},
        scheduler=SchedulerConfig(),
    )
    p = make_platform(config)
    with p.db.connection() as c:
        ensure_platform_pools(c, config)
    return p


def _tenant(p):
    return new_tenant(p, service_class="PAID_SHARED", weight=1, credits=10_000_000, **{**OPEN, **UNCAPPED})


def _ring(p) -> list[str]:
    _, ring = Ring(p).members(PAID)
    return [m.decode() if isinstance(m, bytes) else m for m in ring]


def test_a_tenant_whose_last_task_is_claimed_leaves_the_ring_and_comes_back_behind_those_waiting(make_platform, conn):
    p = _platform(make_platform, slots=2)
    whale, a, b = _tenant(p), _tenant(p), _tenant(p)
    submit(p, whale.tenant_id, whale.user_id, n=30)
    with p.db.connection() as c:
        Ring(p).rebuild(c, PAID)
    running: list = []

    def free_one_slot_and_tick() -> list:
        if running:
            assert complete(p, running.pop(0))[0]
        Scheduler(p).tick(5)  # a new Scheduler per tick, as the tick handler builds one
        claimed = pick_attempts(p, 100)
        running.extend(claimed)
        return [x.tenant_id for x in claimed]

    free_one_slot_and_tick()
    assert len(running) == 2  # the whale fills the lane
    (a_first,) = submit(p, a.tenant_id, a.user_id, n=1)
    assert free_one_slot_and_tick() == [a.tenant_id]  # the newcomer's turn comes before the whale's next
    # Its queue is empty: it is off the ring at once (not at a later visit that finds nothing)
    # and no longer active, so it comes back as a newcomer with no more than its initial burst.
    assert str(a.tenant_id) not in _ring(p)
    row = conn.execute("select active from drr_lane_tenant where lane = %s and tenant_id = %s", (PAID, a.tenant_id)).fetchone()
    assert row["active"] is False
    assert free_one_slot_and_tick() == [whale.tenant_id]
    # b has been waiting since before a submits again: b goes first, then a, each within one slot
    # per backlogged tenant. (Had a kept its place on the ring, it would have gone ahead of b.)
    submit(p, b.tenant_id, b.user_id, n=1)
    submit(p, a.tenant_id, a.user_id, n=1)
    order = []
    for _ in range(3):
        order += free_one_slot_and_tick()
    assert order == [b.tenant_id, a.tenant_id, whale.tenant_id], order
    assert _ring(p) == [str(whale.tenant_id)]


def test_a_tenant_with_work_left_stays_on_the_ring(make_platform, conn):
    # Only a drained queue takes a tenant off: one whose next task is not eligible yet, or that has
    # more tasks than its turn may take, keeps its place.
    p = _platform(make_platform, slots=1)
    whale, a = _tenant(p), _tenant(p)
    submit(p, whale.tenant_id, whale.user_id, n=5)
    submit(p, a.tenant_id, a.user_id, n=2)
    with p.db.connection() as c:
        Ring(p).rebuild(c, PAID)
    Scheduler(p).tick(5)
    assert len(pick_attempts(p, 100)) == 1
    assert set(_ring(p)) == {str(whale.tenant_id), str(a.tenant_id)}
