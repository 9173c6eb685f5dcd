"""Usage against fair share (issue 16, part 5) over real claims: two tenants at weights 2:1 keep a
small lane saturated through the real scheduler, and each one's delivered cost units over the
window come out at its entitlement (the lane's delivered units x weight / backlogged weight); a
tenant that was not backlogged is entitled to nothing; claims older than the window do not count;
the admin route answers the same behind fair_share.read, and bad queries are 422 naming the field.

Each test gets a database of its own: pools and queues are global."""
from __future__ import annotations

import json
import uuid
from collections import Counter
from urllib.parse import urlencode

import pytest

from aivedio.admin import operators
from aivedio.admin.fair_share import lane_shares, tenant_fair_share
from aivedio.config import LaneConfig, Limits, PlatformConfig, ProviderAccount, ProviderConfig, SchedulerConfig
from aivedio.context import set_platform
from aivedio.errors import InvalidRequest, NotFound
from aivedio_tools.local.apigw import to_event
from aivedio_tools.local.lambda_context import FakeLambdaContext
from aivedio.scheduling.resources import ensure_platform_pools
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import new_tenant
from tests.conftest import create_test_database, drop_test_database
from tests.scheduler_support import OPEN, UNCAPPED, finish_all, submit

pytestmark = pytest.mark.timeout(240)
ENT, PAID = "ENTERPRISE_RESERVED", "PAID_SHARED"


@pytest.fixture
def db_url():
    url = create_test_database("fair_share")
    yield url
    drop_test_database(url)


@pytest.fixture
def p(make_platform):
    config = PlatformConfig(
        providers=[ProviderConfig(name="sim-a", accounts=[ProviderAccount(account_id="a1", max_concurrency=500)])],
        lanes={ENT: LaneConfig(capacity_units=500, borrowable_units=0), PAID: LaneConfig(capacity_units=3)},
        limits=Limits(pool_shards=1), scheduler=SchedulerConfig(base_quantum=1))
    platform = make_platform(config)
    with platform.db.connection() as c:
        ensure_platform_pools(c, config)
    set_platform(platform)
    yield platform
    set_platform(None)


def tenant(p, weight: int):
    return new_tenant(p, service_class=PAID, weight=weight, credits=10_000_000, **{**OPEN, **UNCAPPED})


def run_while_backlogged(p, tenants: dict) -> Counter:
    """Tick and complete the claimed work while every tenant has queued work; claims per tenant."""
    served: Counter = Counter()
    for _ in range(300):
        queued = {r["tenant_id"] for r in p.db.fetchall("select distinct tenant_id from generation_task where state = 'QUEUED'")}
        if not set(tenants) <= queued:
            break
        Scheduler(p).tick(5)
        for a in finish_all(p):
            served[a.tenant_id] += 1
    return served


def share(p, tenant_id, **kw) -> dict:
    with p.db.connection() as c:
        return tenant_fair_share(p, c, tenant_id, **kw)


def test_weights_2_to_1_deliver_their_entitlement(p):
    heavy, light, idle = tenant(p, 2), tenant(p, 1), tenant(p, 5)
    submit(p, heavy.tenant_id, heavy.user_id, n=90)
    submit(p, light.tenant_id, light.user_id, n=60)  # more than its share: the heavy one empties first
    served = run_while_backlogged(p, {heavy.tenant_id, light.tenant_id})
    total = served[heavy.tenant_id] + served[light.tenant_id]
    assert total >= 120, served

    for t, weight_share in ((heavy, 2 / 3), (light, 1 / 3)):
        doc = share(p, t.tenant_id, window_seconds=3600)
        assert doc["tenant_id"] == str(t.tenant_id) and doc["window_seconds"] == 3600
        [lane] = doc["lanes"]
        assert lane["lane"] == PAID and lane["backlogged"] and lane["backlogged_tenants"] == 2
        assert lane["delivered_units"] == lane["claims"] == served[t.tenant_id]  # one unit per claim
        assert lane["lane_delivered_units"] == total and lane["backlogged_weight"] == 3
        assert lane["weight_share"] == round(weight_share, 4)
        assert lane["entitled_units"] == pytest.approx(total * weight_share, abs=0.001)
        assert abs(lane["share"] - weight_share) <= 0.03, (lane, served)
        assert 0.95 <= lane["ratio"] <= 1.05, (lane, served)

    # Not backlogged anywhere: no lane; asked for the lane, it delivered and is entitled to nothing.
    assert share(p, idle.tenant_id, window_seconds=3600)["lanes"] == []
    [lane] = share(p, idle.tenant_id, window_seconds=3600, lane=PAID)["lanes"]
    assert (lane["delivered_units"], lane["entitled_units"], lane["backlogged"], lane["ratio"]) == (0, 0.0, False, None)
    assert lane["lane_delivered_units"] == total

    # Every backlogged tenant at once (the dashboard's view): the same figures.
    with p.db.connection() as c:
        lanes = lane_shares(p, c, window_seconds=3600)
    assert set(lanes[PAID]["tenants"]) == {heavy.tenant_id, light.tenant_id}
    assert lanes[PAID]["tenants"][heavy.tenant_id]["delivered_units"] == served[heavy.tenant_id]

    # Claims older than the window do not count; the light tenant, still queued, stays backlogged.
    with p.db.connection() as c:
        c.execute("update task_attempt set created_at = created_at - interval '2 hours' where tenant_id = %s",
                  (light.tenant_id,))
    [lane] = share(p, light.tenant_id, window_seconds=3600)["lanes"]
    assert lane["delivered_units"] == 0 and lane["backlogged"] and lane["ratio"] == 0.0
    assert lane["entitled_units"] == pytest.approx(served[heavy.tenant_id] / 3, abs=0.001)
    [lane] = share(p, heavy.tenant_id, window_seconds=3600)["lanes"]
    assert lane["share"] == 1.0 and lane["delivered_units"] == served[heavy.tenant_id]
    [lane] = share(p, light.tenant_id, window_seconds=3 * 3600)["lanes"]
    assert lane["delivered_units"] == served[light.tenant_id]


def test_bad_queries_and_unknown_tenants(p):
    t = tenant(p, 1)
    with pytest.raises(InvalidRequest) as e:
        share(p, t.tenant_id, window_seconds=0, lane="NOPE")
    assert set(e.value.fields) == {"query.window_seconds", "query.lane"}
    with pytest.raises(NotFound):
        share(p, uuid.uuid4(), window_seconds=60)


def admin_get(path: str, token: str, query: dict | None = None) -> tuple[int, dict]:
    from functions.admin_api.handler import lambda_handler

    resp = lambda_handler(to_event("GET", path, urlencode(query or {}), [("Authorization", f"Bearer {token}")], b""),
                          FakeLambdaContext("aivedio-admin-api"))
    return resp["statusCode"], json.loads(resp["body"])


def test_the_admin_route(p):
    t = tenant(p, 1)
    submit(p, t.tenant_id, t.user_id, n=2)
    Scheduler(p).tick(5)
    viewer = p.db.transaction(lambda c: operators.create_operator(c, actor="test", name=f"v-{uuid.uuid4().hex[:8]}", role="viewer"))
    path = f"/admin/v1/tenants/{t.tenant_id}/fair-share"
    status, doc = admin_get(path, viewer.token, {"window_seconds": 600})
    assert status == 200, doc
    assert doc == share(p, t.tenant_id, window_seconds=600)
    [lane] = doc["lanes"]
    assert lane["delivered_units"] == 2 and lane["ratio"] == 1.0
    status, doc = admin_get(path, viewer.token)  # the default window
    assert status == 200 and doc["window_seconds"] == 3600
    for query, field in (({"window_seconds": 0}, "query.window_seconds"), ({"window_seconds": "x"}, "query.window_seconds"),
                         ({"lane": "NOPE"}, "query.lane")):
        status, doc = admin_get(path, viewer.token, query)
        assert status == 422 and field in doc["details"]["fields"], (query, doc)
    for bad in (str(uuid.uuid4()), "not-a-uuid"):
        status, doc = admin_get(f"/admin/v1/tenants/{bad}/fair-share", viewer.token)
        assert status == 404 and doc["error"] == "NOT_FOUND"
    assert admin_get(path, t.api_key)[0] == 403  # a tenant key is no operator token
