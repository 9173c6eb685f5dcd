"""Why a queued task waits (issue 16, part 5), over the real PostgreSQL and Redis and the real
scheduler: each limit is made to bind by the scheduler's own claims, and the answer is checked
against what the claim itself says (the scheduler's _claim_one, rolled back) and against the next
tick, which must leave the task queued exactly when a hard limit binds.

- a user at its running cap: USER_RUNNING_TASKS; a tenant at its units cap: TENANT_RUNNING_UNITS;
  a full lane: LANE_CAPACITY; a full provider account: PROVIDER_SLOTS; a spent tenant budget: BUDGET;
  a backoff: NOT_YET_ELIGIBLE; BEST_EFFORT without Redis: LANE_PAUSED;
- nothing binding: the DRR turn (FAIR_SHARE_TURN with the tenants ahead on the ring), the tenant's
  own order (TENANT_QUEUE_ORDER), or NONE for the ring's next tenant, and the next tick claims them;
- GET /v1/generations/{id} shows `waiting` for the tenant's own QUEUED task only (not once it
  runs), with only the tenant's own numbers; another tenant's id stays 404 exactly like a missing
  one; the admin route answers for any task behind tenant.read.

Each test gets a database of its own: pools and queues are global."""
from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import jsonschema_rs
import pytest

from aivedio.admin import operators
from aivedio import caching
from aivedio.config import LaneConfig, Limits, PlatformConfig, ProviderAccount, ProviderConfig
from aivedio.context import set_platform
from aivedio.errors import NotFound
from aivedio_tools.local.apigw import to_event
from aivedio_tools.local.lambda_context import FakeLambdaContext
from aivedio.scheduling import why_waiting
from aivedio.scheduling.claim import NoRoom
from aivedio.scheduling.resources import ensure_platform_pools
from aivedio.scheduling.ring import Ring, built_key, next_tenant_pg
from aivedio.scheduling.scheduler import LaneView, Scheduler, _policy
from tests.admission_support import new_tenant
from tests.conftest import create_test_database, drop_test_database
from tests.scheduler_support import OPEN, UNCAPPED, pick_attempts, submit

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis_cluster]
ENT, PAID = "ENTERPRISE_RESERVED", "PAID_SHARED"


@pytest.fixture
def db_url():
    """A fresh database per test (overrides the per-module one of conftest)."""
    url = create_test_database("why_waiting")
    yield url
    drop_test_database(url)


def make_config(*, lane_units: int = 500, account_slots: int = 500) -> PlatformConfig:
    return PlatformConfig(
        providers=[ProviderConfig(name="sim-a", accounts=[ProviderAccount(account_id="a1", max_concurrency=account_slots)])],
        lanes={ENT: LaneConfig(capacity_units=500, borrowable_units=0), PAID: LaneConfig(capacity_units=lane_units)},
        limits=Limits(pool_shards=2),
    )


@pytest.fixture
def start(make_platform):
    def _start(config: PlatformConfig, **kw):
        p = make_platform(config, **kw)
        with p.db.connection() as c:
            ensure_platform_pools(c, config)
        set_platform(p)
        return p

    yield _start
    set_platform(None)


def tenant(p, weight: int = 1, **policy):
    return new_tenant(p, service_class=PAID, weight=weight, credits=10_000_000, **{**OPEN, **UNCAPPED, **policy})


def state(p, task_id) -> str:
    return p.db.fetchone("select state from generation_task where task_id = %s", (task_id,))["state"]


def why(p, task_id) -> dict:
    with p.db.connection() as c:
        return why_waiting.for_operator(p, c, task_id)


class _Rollback(Exception):
    pass


def claim_says(p, task_id) -> str | None:
    """The key the scheduler's own claim of the task fails on now (None: it would claim); rolled back."""
    s, out = Scheduler(p), {}
    try:
        with p.db.connection() as c, c.transaction():
            task = c.execute("select * from generation_task where task_id = %s", (task_id,)).fetchone()
            policy, lane = _policy(c, task["tenant_id"]), task["queue_class"]
            try:
                s._claim_one(c, task, policy, LaneView(p, c, lane), s._tier(c, lane, task, policy), p.clock.now())
                out["key"] = None
            except NoRoom as e:
                out["key"] = e.key
            raise _Rollback
    except _Rollback:
        pass
    return out["key"]


def assert_binds(p, task_id, limit: str, key: str) -> dict:
    """`limit` binds on `key`, the claim says so too, and a tick leaves the task queued."""
    w = why(p, task_id)
    assert w["binding_limit"] == limit, w
    assert w["detail"]["resource"] == key, w
    assert key in w["detail"]["blocked"], w
    assert claim_says(p, task_id) == key
    Scheduler(p).tick(5)
    assert state(p, task_id) == "QUEUED"
    return w


# --- the limit that binds ---------------------------------------------------------------------------------

def test_a_user_at_its_running_cap(start):
    p = start(make_config())
    t = tenant(p, max_user_running_tasks=1)
    first, second = submit(p, t.tenant_id, t.user_id, n=2)
    Scheduler(p).tick(5)
    assert (state(p, first), state(p, second)) == ("DISPATCHING", "QUEUED")
    w = assert_binds(p, second, "USER_RUNNING_TASKS", f"user:{t.tenant_id}:{t.user_id}:running_tasks")
    assert (w["detail"]["capacity_units"], w["detail"]["in_use_units"], w["detail"]["needed_units"]) == (1, 1, 1)
    assert w["position"]["rank_in_tenant_lane"] == 1 and w["position"]["tenant_queued_tasks"] == 1
    assert w["estimated_start_seconds"] is not None and w["estimated_start_seconds"] >= 0
    assert w["estimated_start_at"].endswith("Z") and w["position"]["lane"] == PAID


def test_a_tenant_at_its_running_units_cap(start):
    p = start(make_config())
    t = tenant(p, max_running_units=1)
    first, second = submit(p, t.tenant_id, t.user_id, n=2)
    Scheduler(p).tick(5)
    assert state(p, first) == "DISPATCHING"
    assert_binds(p, second, "TENANT_RUNNING_UNITS", f"tenant:{t.tenant_id}:running_units")


def test_a_full_lane(start):
    p = start(make_config(lane_units=2))
    t = tenant(p)
    tasks = submit(p, t.tenant_id, t.user_id, n=3)
    Scheduler(p).tick(5)
    assert [state(p, x) for x in tasks] == ["DISPATCHING", "DISPATCHING", "QUEUED"]
    w = assert_binds(p, tasks[2], "LANE_CAPACITY", f"lane:{PAID}")
    assert (w["detail"]["capacity_units"], w["detail"]["in_use_units"], w["detail"]["room_units"]) == (2, 2, 0)


def test_a_full_provider_account(start):
    p = start(make_config(account_slots=1))
    t = tenant(p)
    first, second = submit(p, t.tenant_id, t.user_id, n=2)
    Scheduler(p).tick(5)
    assert (state(p, first), state(p, second)) == ("DISPATCHING", "QUEUED")
    w = assert_binds(p, second, "PROVIDER_SLOTS", "provider-account:sim-a:a1")
    assert w["detail"]["capacity_units"] == 1 and w["detail"]["in_use_units"] == 1


def test_a_spent_tenant_budget(start):
    p = start(make_config())
    t = tenant(p)
    [task] = submit(p, t.tenant_id, t.user_id)
    now = datetime.now(timezone.utc)
    with p.db.connection() as c:  # spent: consumed at its limit (admission came before it)
        c.execute("""insert into budget_account (scope_type, scope_id, tenant_id, period_start, period_end, limit_amount,
                                                 currency, consumed_amount)
                     values ('TENANT', %s, %s, %s, %s, %s, %s, %s)""",
                  (str(t.tenant_id), t.tenant_id, now - timedelta(days=1), now + timedelta(days=1), Decimal("1"),
                   p.config.providers[0].currency, Decimal("2")))
    caching.clear(p)  # budgets.in_force is cached a second per process
    w = assert_binds(p, task, "BUDGET", f"tenant:{t.tenant_id}:budget")
    assert w["detail"]["why"] == "REJECT" and w["detail"]["scope"] == f"TENANT:{t.tenant_id}"
    assert w["estimated_start_at"] is None and w["estimated_start_seconds"] is None


def test_a_task_in_backoff_is_not_yet_eligible(start):
    p = start(make_config())
    t = tenant(p)
    [task] = submit(p, t.tenant_id, t.user_id)
    with p.db.connection() as c:
        c.execute("update generation_task set next_eligible_at = now() + interval '120 seconds' where task_id = %s", (task,))
    w = why(p, task)
    assert w["binding_limit"] == "NOT_YET_ELIGIBLE" and 110 <= w["detail"]["seconds"] <= 120, w
    assert w["estimated_start_seconds"] >= 110
    Scheduler(p).tick(5)
    assert state(p, task) == "QUEUED"


def test_a_lane_paused_in_conservative_mode(start):
    p = start(make_config(), redis=False)  # without Redis every tick is conservative: BEST_EFFORT waits
    t = new_tenant(p, service_class="BEST_EFFORT", weight=1, credits=10_000_000, **{**OPEN, **UNCAPPED})
    [task] = submit(p, t.tenant_id, t.user_id)
    w = why(p, task)
    assert w["binding_limit"] == "LANE_PAUSED" and w["queue_class"] == "BEST_EFFORT", w
    assert w["estimated_start_at"] is None and w["position"]["tenants_ahead"] == 0
    Scheduler(p).tick(5)
    assert state(p, task) == "QUEUED"


# --- nothing binds: the order of turns ------------------------------------------------------------------

def test_nothing_binding_but_other_tenants_ahead_is_the_drr_turn(start):
    p = start(make_config())
    with p.db.connection() as c:
        Ring(p).rebuild(c, PAID)  # the lane's Redis index is READY: the tick serves the Redis ring
    tenants = [tenant(p) for _ in range(3)]
    first = {t.tenant_id: submit(p, t.tenant_id, t.user_id)[0] for t in tenants}
    t0 = tenants[0]
    second = submit(p, t0.tenant_id, t0.user_id)[0]  # behind its tenant's first task
    answers = {tid: why(p, task) for tid, task in first.items()}
    assert sorted(a["position"]["tenants_ahead"] for a in answers.values()) == [0, 1, 2]
    for tid, a in answers.items():
        assert claim_says(p, first[tid]) is None  # it would fit: no limit binds
        assert a["position"]["backlogged_tenants"] == 3 and a["position"]["on_ring"]
        assert a["position"]["ring_position"] == a["position"]["tenants_ahead"]
        if a["position"]["tenants_ahead"]:
            assert a["binding_limit"] == "FAIR_SHARE_TURN", a
            assert a["detail"]["tenants_ahead"] == a["position"]["tenants_ahead"]
            assert a["detail"]["quantum"] == 1 and a["detail"]["units"] == 1
        else:
            assert a["binding_limit"] == "NONE", a
    # The ring's next tenant is the one with nobody ahead (Ring.next rotates, so ask before asking it).
    with p.db.connection() as c:
        nxt = Ring(p).next(c, PAID, True)
    assert answers[nxt]["position"]["tenants_ahead"] == 0
    # Without the Redis index the tick walks the PostgreSQL ring (tenant_id order after the cursor).
    p.cache.run(p.cache.r.delete, built_key(p.cache, PAID))
    pg = {tid: why(p, task)["position"]["tenants_ahead"] for tid, task in first.items()}
    assert pg == {tid: i for i, tid in enumerate(sorted(first))}
    with p.db.connection() as c:
        assert next_tenant_pg(c, PAID) == min(first)
    assert {tid: why(p, task)["position"]["tenants_ahead"] for tid, task in first.items()} == {
        tid: (i - 1) % 3 for i, tid in enumerate(sorted(first))}  # the cursor moved on by one
    with p.db.connection() as c:
        Ring(p).rebuild(c, PAID)
    w = why(p, second)
    assert w["position"]["rank_in_tenant_lane"] == 2 and w["position"]["tenant_tasks_ahead"] == 1
    if w["position"]["tenants_ahead"] == 0:
        assert w["binding_limit"] == "TENANT_QUEUE_ORDER" and w["detail"]["tasks_ahead"] == 1
    else:
        assert w["binding_limit"] == "FAIR_SHARE_TURN"
    Scheduler(p).tick(5)  # nothing held them: one tick claims every one
    assert {state(p, x) for x in [*first.values(), second]} == {"DISPATCHING"}


# --- the tenant's GET and the admin route ---------------------------------------------------------------

def tenant_get(path: str, key: str) -> tuple[int, bytes, dict]:
    from functions.api.handler import lambda_handler

    resp = lambda_handler(to_event("GET", path, "", [("Authorization", f"Bearer {key}")], b""), FakeLambdaContext("aivedio-api"))
    return resp["statusCode"], resp["body"].encode(), json.loads(resp["body"])


def task_view_validator():
    from functions.api.handler import lambda_handler

    spec = json.loads(lambda_handler(to_event("GET", "/openapi.json", "", [], b""), FakeLambdaContext("aivedio-api"))["body"])
    schema = spec["paths"]["/v1/generations/{task_id}"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert "waiting" in spec["components"]["schemas"]["TaskView"]["properties"]
    assert set(spec["components"]["schemas"]["WaitingPosition"]["properties"]) == {
        "rank_in_tenant_lane", "tenant_tasks_ahead", "tenant_queued_tasks", "level"}  # nothing about other tenants
    return jsonschema_rs.Draft202012Validator({**schema, "components": spec["components"]})


def test_the_tenant_sees_waiting_on_its_own_queued_task_only(start):
    p = start(make_config())
    t = tenant(p, max_user_running_tasks=1)
    other = tenant(p)
    first, second = submit(p, t.tenant_id, t.user_id, n=2)
    Scheduler(p).tick(5)
    assert len(pick_attempts(p, 10)) == 1 and state(p, first) == "RUNNING"
    validator = task_view_validator()

    status, _, doc = tenant_get(f"/v1/generations/{second}", t.api_key)
    assert status == 200 and doc["state"] == "QUEUED", doc
    assert not list(validator.iter_errors(doc)), doc
    w = doc["waiting"]
    assert w["binding_limit"] == "USER_RUNNING_TASKS" and w["detail"] == {"cap": 1, "in_use": 1, "needed": 1}
    assert w["position"]["rank_in_tenant_lane"] == 1 and w["position"]["level"] in ("LOW", "MEDIUM", "HIGH")
    assert w["estimated_start_at"] is not None and isinstance(w["estimated_start_seconds"], int)
    assert "resource" not in json.dumps(w)  # no resource keys, provider accounts or capacities
    # Nothing about other tenants either: how many are ahead or backlogged tells a customer how
    # many others are active (the operator's view keeps them).
    assert set(w["position"]) == {"rank_in_tenant_lane", "tenant_tasks_ahead", "tenant_queued_tasks", "level"}, w
    assert "tenants" not in json.dumps(w).replace("tenant_", "")
    with p.db.connection() as c:
        assert {"tenants_ahead", "backlogged_tenants"} <= set(why_waiting.for_operator(p, c, second)["position"])

    status, _, doc = tenant_get(f"/v1/generations/{first}", t.api_key)  # running: nothing waits
    assert status == 200 and doc["state"] == "RUNNING" and doc.get("waiting") is None, doc
    assert not list(validator.iter_errors(doc))

    theirs = tenant_get(f"/v1/generations/{second}", other.api_key)
    missing = tenant_get(f"/v1/generations/{uuid.uuid4()}", other.api_key)
    assert theirs[0] == missing[0] == 404 and theirs[1] == missing[1]
    with pytest.raises(NotFound):
        with p.db.connection() as c:
            why_waiting.for_tenant_task(p, c, other.tenant_id, second)


def admin_get(path: str, token: str) -> tuple[int, dict]:
    from functions.admin_api.handler import lambda_handler

    resp = lambda_handler(to_event("GET", path, "", [("Authorization", f"Bearer {token}")], b""),
                          FakeLambdaContext("aivedio-admin-api"))
    return resp["statusCode"], json.loads(resp["body"])


def test_the_admin_route_answers_for_any_task(start):
    p = start(make_config(lane_units=1))
    t = tenant(p)
    first, second = submit(p, t.tenant_id, t.user_id, n=2)
    Scheduler(p).tick(5)
    viewer = p.db.transaction(lambda c: operators.create_operator(c, actor="test", name=f"v-{uuid.uuid4().hex[:8]}", role="viewer"))
    status, doc = admin_get(f"/admin/v1/tasks/{second}/waiting", viewer.token)
    assert status == 200 and doc["binding_limit"] == "LANE_CAPACITY", doc
    assert doc["tenant_id"] == str(t.tenant_id) and doc["state"] == "QUEUED" and doc["detail"]["resource"] == f"lane:{PAID}"
    status, doc = admin_get(f"/admin/v1/tasks/{first}/waiting", viewer.token)  # claimed: nothing waits
    assert status == 200 and doc["state"] == "DISPATCHING" and doc["binding_limit"] is None and doc["position"] is None
    for bad in (str(uuid.uuid4()), "not-a-uuid"):
        status, doc = admin_get(f"/admin/v1/tasks/{bad}/waiting", viewer.token)
        assert status == 404 and doc["error"] == "NOT_FOUND"
    status, doc = admin_get(f"/admin/v1/tasks/{second}/waiting", t.api_key)  # a tenant key is no operator token
    assert status == 403
