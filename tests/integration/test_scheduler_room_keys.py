"""The scheduler's view of room includes every key a claim needs (issue 14, item 1): the lane, the
provider accounts, the model caps and the worker slots. A view that knew only the lane and the
accounts granted several rounds' quanta per turn under a model cap far below both (the lane "had
room" for them), and the first tenants of a rotation spent them while the cap let nothing else in.

Each test gets a database of its own: pools and queues are global, so tests must not share them."""
from __future__ import annotations

import pytest

from aivedio.config import LaneConfig, Limits, PlatformConfig, Pools, ProviderAccount, ProviderConfig, SchedulerConfig
from aivedio.scheduling.scheduler import LaneView
from tests.admission_support import new_tenant
from tests.conftest import create_test_database, drop_test_database
from tests.integration.test_scheduler import _fairness_error, _shares_while_backlogged
from tests.scheduler_support import OPEN, UNCAPPED, submit, used

pytestmark = pytest.mark.timeout(180)
ENT, PAID = "ENTERPRISE_RESERVED", "PAID_SHARED"


@pytest.fixture
def db_url():
    url = create_test_database("scheduler_room")
    yield url
    drop_test_database(url)


def _platform(make_platform, *, model_cap: int = 10**6, pools: Pools | None = None):
    from aivedio.scheduling.resources import ensure_platform_pools

    cfg = PlatformConfig(providers=[ProviderConfig(name="sim-a", accounts=[ProviderAccount(account_id="a1", max_concurrency=500)])],
                         lanes={ENT: LaneConfig(capacity_units=500, borrowable_units=0), PAID: LaneConfig(capacity_units=200)},
                         limits=Limits(pool_shards=1, model_global_running_cap=model_cap),
                         pools=pools or Pools(), scheduler=SchedulerConfig(base_quantum=1))
    p = make_platform(cfg)
    with p.db.connection() as c:
        ensure_platform_pools(c, cfg)
    return p


def _tenant(p, weight: int):
    return new_tenant(p, service_class=PAID, weight=weight, credits=10_000_000, **{**OPEN, **UNCAPPED})


def test_weights_hold_when_a_model_cap_binds_not_the_lane_or_the_account(make_platform, conn):
    p = _platform(make_platform, model_cap=6)
    weights = {"w4": 4, "w2": 2, "w1": 1}
    tenants = {n: _tenant(p, w) for n, w in weights.items()}
    for n, t in tenants.items():
        submit(p, t.tenant_id, t.user_id, n=30 * weights[n])
    with p.db.connection() as c:
        view = LaneView(p, c, PAID)
    assert view.scarce_room == 6  # the model's cap, not the lane's 200 or the account's 500
    served = _shares_while_backlogged(p, conn, tenants, weights, finish_per_tick=2)
    assert sum(served.values()) >= 60, served
    error, shares = _fairness_error(served, weights)
    print(f"model-bound 4:2:1: shares {shares}, error {error:.4f}")
    assert error <= 0.03, (shares, served)
    model_keys = [r["resource_key"] for r in conn.execute(
        "select distinct resource_key from resource_pool_shard where resource_key like 'model:%%'").fetchall()]
    assert all(used(conn, k) <= 6 for k in model_keys)


def test_a_full_model_cap_leaves_no_room_in_the_view(make_platform, conn):
    p = _platform(make_platform, model_cap=1)
    t = _tenant(p, 1)
    submit(p, t.tenant_id, t.user_id, n=3)
    from aivedio.scheduling.scheduler import Scheduler

    assert Scheduler(p).tick(5).by_lane[PAID] == 1
    with p.db.connection() as c:
        view = LaneView(p, c, PAID)
    assert view.lane_has_room and view.provider_free > 0
    assert not view.has_room  # every model is at its cap: no claim can succeed


def test_the_workers_slots_bound_the_view_too(make_platform, conn):
    # Every generation task takes worker:cpu units (its media_units): with 2 free, the view's scarce
    # room is 2, and once they are taken no claim can succeed.
    from aivedio.scheduling.scheduler import Scheduler

    p = _platform(make_platform, pools=Pools(worker_cpu_units=2, worker_gpu_units=10**6))
    t = _tenant(p, 1)
    submit(p, t.tenant_id, t.user_id, n=4)
    with p.db.connection() as c:
        assert LaneView(p, c, PAID).scarce_room == 2
    assert Scheduler(p).tick(5).by_lane[PAID] == 2
    with p.db.connection() as c:
        view = LaneView(p, c, PAID)
    assert view.lane_has_room and view.provider_free > 0 and not view.has_room
