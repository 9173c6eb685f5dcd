"""Why a queued task waits (issue 16): the limit that binds it now, its place in the queues and an
estimated start, for GET /admin/v1/tasks/{id}/waiting and, trimmed, the tenant's own
GET /v1/generations/{id}.

Computed with the claim's own rules, never a second copy of them: the keys and units of
claim.claim_demands (caps from claim.tenant_demands), each checked against resources.rooms (the
claim's conditional increment, read without a lock), over router.route's routes and
scheduler.claim_options in the order of scheduler.first_fit, then budgets.would_refuse for the
attempt's budgets (scheduler.budget_no_room maps a refusal to its key, as the claim does). So the
key named here is the key the next claim of the task would fail on. A dry-run claim rolled back
would be exact too, but it locks the lane's hot shards and writes; a read polled by tenants must
not contend with the scheduler. Everything is a snapshot: the next tick may change it."""
from __future__ import annotations

import dataclasses
import math
from datetime import timedelta
from uuid import UUID

import psycopg
from psycopg import sql

from aivedio import degraded
from aivedio.cache.client import CacheUnavailable
from aivedio.errors import NotFound
from aivedio.scheduling import drr, queue_stats, router
from aivedio.scheduling.claim import LENDER_KEY, NoRoom, claim_demands, tenant_demands
from aivedio.scheduling.resources import rooms
from aivedio.scheduling.ring import DISABLED, DOWN, READY, Ring, active_tenants_pg
from aivedio.scheduling.scheduler import (
    PAUSED_WHEN_CONSERVATIVE,
    LaneView,
    PoolTurn,
    Scheduler,
    _policy,
    budget_no_room,
    claim_options,
    first_fit,
    pool_of,
)
from aivedio.spend import budgets

# binding_limit codes
NOT_YET_ELIGIBLE = "NOT_YET_ELIGIBLE"  # backoff after a provider 429, a deferral (a spent project budget)
LANE_PAUSED = "LANE_PAUSED"  # conservative mode (Redis index down, a suspect counter) pauses this lane
USER_RUNNING_TASKS, USER_RUNNING_UNITS = "USER_RUNNING_TASKS", "USER_RUNNING_UNITS"
TENANT_RUNNING_TASKS, TENANT_RUNNING_UNITS = "TENANT_RUNNING_TASKS", "TENANT_RUNNING_UNITS"
LANE_CAPACITY = "LANE_CAPACITY"
PROVIDER_SLOTS = "PROVIDER_SLOTS"  # an account's (or account x model's) concurrency
NO_PROVIDER = "NO_PROVIDER"  # no route: no capable provider, or every capable one's breaker is open
MODEL_CAPACITY = "MODEL_CAPACITY"
PLATFORM_COST_RATE = "PLATFORM_COST_RATE"
WORKER_CAPACITY = "WORKER_CAPACITY"
BUDGET = "BUDGET"
FAIR_SHARE_TURN = "FAIR_SHARE_TURN"  # it fits; other backlogged tenants' DRR turns come first
TENANT_QUEUE_ORDER = "TENANT_QUEUE_ORDER"  # it fits; its own tenant's earlier tasks in the lane come first
NONE = "NONE"  # nothing holds it: the next tick claims it

OWN_LIMITS = frozenset({USER_RUNNING_TASKS, USER_RUNNING_UNITS, TENANT_RUNNING_TASKS, TENANT_RUNNING_UNITS})
# No estimate is honest while these bind: they lift by an operator's or a provider's hand, not by the queue moving.
NO_ESTIMATE = frozenset({LANE_PAUSED, NO_PROVIDER, BUDGET})


def limit_of(key: str) -> str:
    """The binding_limit of a NoRoom key (the keys of claim.claim_demands and budget_no_room)."""
    if key.startswith("user:"):
        return USER_RUNNING_UNITS if key.endswith(":running_units") else USER_RUNNING_TASKS
    if key.startswith("tenant:"):
        if key.endswith(":budget"):
            return BUDGET
        return TENANT_RUNNING_UNITS if key.endswith(":running_units") else TENANT_RUNNING_TASKS
    if key.startswith(("project:", "budget:")):
        return BUDGET
    if key == LENDER_KEY or key.startswith("lane:"):
        return LANE_CAPACITY
    if key == "provider:none":
        return NO_PROVIDER
    if key.startswith(("provider-account:", "provider:")):
        return PROVIDER_SLOTS
    if key.startswith("model:"):
        return MODEL_CAPACITY
    if key == "cost:platform":
        return PLATFORM_COST_RATE
    if key.startswith("worker:"):
        return WORKER_CAPACITY
    return key.split(":", 1)[0].upper()


def _iso(ts) -> str:
    return ts.strftime("%Y-%m-%dT%H:%M:%SZ")  # as admission's estimated_start_at


# --- the limit that binds ----------------------------------------------------------------------------

def check_claim(platform, conn: psycopg.Connection, task: dict, policy: dict, now, seen: dict[str, dict]) -> router.Route:
    """The route the task's claim would take now, or NoRoom with the key it would fail on. `seen`
    collects each key looked at (units needed, room) for the answer's detail."""
    lane = task["queue_class"]
    tier = Scheduler(platform)._tier(conn, lane, task, policy)
    routes = router.route(platform, task, tier, conn=conn)
    shards = platform.config.limits.pool_shards
    caps = {d.key: cap for d, cap in tenant_demands(task, policy)}
    with_budgets = bool(routes) and budgets.in_force(platform, conn)

    def attempt(lane_key: str, borrowed: bool, r: router.Route) -> router.Route:
        demands = claim_demands(task, r, policy, lane_key=lane_key, borrowed=borrowed, shards=shards)
        have = rooms(conn, [d.key for d in demands])
        for d in demands:  # in the claim's order: the first without room is the claim's NoRoom
            got = have.get(d.key)
            used = got.used if got else 0
            if d.key in caps:  # the claim first sets the tenant's pools to the policy's caps (claim.claim)
                capacity, room = caps[d.key], caps[d.key] - used
            else:
                capacity, room = (got.capacity, got.room) if got else (0, 0)
            seen[d.key] = {"resource": d.key, "needed_units": d.units, "in_use_units": used, "capacity_units": capacity,
                           "room_units": max(0, room)}
            if d.units > room:
                raise NoRoom(d.key)
        if with_budgets:
            refused = budgets.would_refuse(
                conn, scopes=budgets.attempt_scopes(task["tenant_id"], r.provider, r.account, r.model, r.region,
                                                    project=task["project_id"]),
                amount=r.expected_cost, currency=r.currency, now=now, config=platform.config.billing,
                costly=lane == "EXPENSIVE", low_priority=task["priority_band"] >= budgets.LOW_PRIORITY_BAND)
            if refused is not None:
                e = budget_no_room(task, refused["scope"])
                seen[e.key] = {"resource": e.key, **refused}
                raise e
        return r

    return first_fit(routes, claim_options(LaneView(platform, conn, lane), task), attempt)


def _conservative(platform, lane: str) -> bool:
    """Whether ticks run this lane in conservative mode (Scheduler.tick), which pauses the
    PAUSED_WHEN_CONSERVATIVE lanes: Redis down or not configured, or a suspect capacity counter. A
    MISSING index is not counted: the next tick rebuilds it and is conservative only once."""
    return Ring(platform).index_state(lane) in (DOWN, DISABLED) or degraded.capacity_suspect(platform)


def _binding(platform, conn, task: dict, policy: dict, pos: dict, now) -> tuple[str, dict]:
    lane = task["queue_class"]
    if task["next_eligible_at"] > now:  # the tick does not look at it before then (scheduler.head_tasks)
        return NOT_YET_ELIGIBLE, {"eligible_at": _iso(task["next_eligible_at"]),
                                  "seconds": math.ceil((task["next_eligible_at"] - now).total_seconds())}
    if lane in PAUSED_WHEN_CONSERVATIVE and _conservative(platform, lane):
        return LANE_PAUSED, {"lane": lane, "reason": "conservative capacity mode pauses this lane"}
    seen: dict[str, dict] = {}
    try:
        route = check_claim(platform, conn, task, policy, now, seen)
    except NoRoom as e:
        detail = dict(seen.get(e.key) or {"resource": e.key})
        if e.key == "provider:none":
            detail["open_breakers"] = sorted(router.open_breakers(platform))
        # Every key found without room on the ways the claim tries (another account may be full too).
        detail["blocked"] = sorted(k for k, v in seen.items() if v.get("needed_units", 0) > v.get("room_units", 0) or "why" in v)
        return limit_of(e.key), detail
    # It would fit now: what stands before it is the order of turns.
    fits = {"provider": route.provider, "provider_account": route.account}
    if pos["tenants_ahead"]:
        return FAIR_SHARE_TURN, {**fits, "tenants_ahead": pos["tenants_ahead"], "deficit": pos["deficit"],
                                 "quantum": pos["quantum"], "units": task["fairness_units"]}
    if pos["tenant_tasks_ahead"]:
        return TENANT_QUEUE_ORDER, {**fits, "tasks_ahead": pos["tenant_tasks_ahead"], "units_ahead": pos["tenant_units_ahead"]}
    return NONE, fits


# --- its position ---------------------------------------------------------------------------------------

# Its rank among its tenant's queued tasks of the lane, in the order a visit takes heads
# (scheduler.head_tasks: band, eligibility, FIFO; task_id breaks ties), and its FIFO place in the lane.
# The lane is inlined (ring._lane explains why: the generic plan of `queue_class = $1` scans).
TENANT_RANK = sql.SQL(
    """select count(*) filter (where (priority_band, next_eligible_at, enqueue_at, task_id) < (%(band)s, %(elig)s, %(enq)s, %(id)s)) as ahead,
              coalesce(sum(fairness_units) filter (where (priority_band, next_eligible_at, enqueue_at, task_id)
                                                          < (%(band)s, %(elig)s, %(enq)s, %(id)s)), 0)::bigint as units_ahead,
              count(*) as queued
         from generation_task where state = 'QUEUED' and queue_class = {lane} and tenant_id = %(t)s""")
LANE_RANK = sql.SQL(
    """select count(*) filter (where (enqueue_at, task_id) < (%(enq)s, %(id)s)) as ahead,
              coalesce(sum(fairness_units) filter (where (enqueue_at, task_id) < (%(enq)s, %(id)s)), 0)::bigint as units_ahead,
              count(*) as queued
         from generation_task where state = 'QUEUED' and queue_class = {lane}""")
DRR_STATE = "select * from drr_lane_tenant where lane = %s and tenant_id = %s"
PG_RING_CURSOR = "select last_tenant_id from drr_lane_cursor where lane = %s"


PAUSED_OTHERS = """select tenant_id from drr_lane_tenant
                     where lane = %s and paused_kind is not null and tenant_id <> %s"""


def ring_order(platform, conn: psycopg.Connection, lane: str, backlogged: list[UUID]) -> list[UUID]:
    """The lane's backlogged tenants in the order the ring visits them, next first: the Redis ring
    (Ring.next rotates it from the left) when its index is ready, else the PostgreSQL ring
    (ring.next_tenant_pg: tenant_id order after the lane's cursor). A tenant the Redis ring does
    not hold yet (its queue indexer has not run) is left out."""
    ring = Ring(platform)
    members = set(backlogged)
    try:
        if ring.index_state(lane) == READY:
            _, order = ring.members(lane)
            return [t for t in (UUID(x) for x in order) if t in members]
    except CacheUnavailable:
        pass
    cur = conn.execute(PG_RING_CURSOR, (lane,)).fetchone()
    last = cur["last_tenant_id"] if cur else None
    if last is None:
        return list(backlogged)
    return [t for t in backlogged if t > last] + [t for t in backlogged if t <= last]


def position(platform, conn: psycopg.Connection, task: dict, policy: dict) -> dict:
    lane, tenant = task["queue_class"], task["tenant_id"]
    p = {"band": task["priority_band"], "elig": task["next_eligible_at"], "enq": task["enqueue_at"], "id": task["task_id"],
         "t": tenant}
    mine = conn.execute(TENANT_RANK.format(lane=sql.Literal(lane)), p).fetchone()
    everyone = conn.execute(LANE_RANK.format(lane=sql.Literal(lane)), p).fetchone()
    backlogged = active_tenants_pg(conn, lane)  # the fact; the ring may still list tenants gone empty
    order = ring_order(platform, conn, lane, backlogged)
    on_ring = tenant in order
    # Ahead of it: the tenants the ring visits first, and turns that capacity paused, which resume
    # before the ring turns (Scheduler._run_lane).
    paused = {r["tenant_id"] for r in conn.execute(PAUSED_OTHERS, (lane, tenant)).fetchall()}
    ahead = (set(order[:order.index(tenant)]) if on_ring else set(order)) | (paused & set(backlogged))
    st = conn.execute(DRR_STATE, (lane, tenant)).fetchone()
    pool = pool_of(platform.config, task)  # the turn is kept per binding pool (Scheduler.visit)
    turn = PoolTurn.load(st, pool).get(pool, PoolTurn()) if st else PoolTurn()
    return {
        "lane": lane,
        "rank_in_tenant_lane": int(mine["ahead"]) + 1,
        "tenant_tasks_ahead": int(mine["ahead"]),
        "tenant_units_ahead": int(mine["units_ahead"]),
        "tenant_queued_tasks": int(mine["queued"]),
        "lane_tasks_ahead": int(everyone["ahead"]),
        "lane_units_ahead": int(everyone["units_ahead"]),
        "lane_queued_tasks": int(everyone["queued"]),
        "backlogged_tenants": len(set(backlogged) | {tenant}),
        "on_ring": on_ring,
        "ring_position": order.index(tenant) if on_ring else None,  # 0: the ring visits this tenant next
        "tenants_ahead": len(ahead),
        "paused_turns_ahead": len(paused & set(backlogged)),
        "pool": pool,
        "deficit": turn.deficit,
        "quantum": drr.quantum(platform.config.scheduler.base_quantum, policy["weight"]),
        "turn_paused_on": turn.on,
    }


# --- the answer -----------------------------------------------------------------------------------------

def explain(platform, conn: psycopg.Connection, task: dict) -> dict | None:
    """{binding_limit, detail, position, estimated_start_at, estimated_start_seconds} for a QUEUED
    task row; None for any other state. Reads only."""
    if task["state"] != "QUEUED":
        return None
    now = platform.clock.now()
    policy = _policy(conn, task["tenant_id"])
    pos = position(platform, conn, task, policy)
    binding, detail = _binding(platform, conn, task, policy, pos, now)
    # The admission estimate (queue_stats.expected_wait_seconds) over what is ahead of this task now:
    # the lane's units queued before it, and its tenant's units ahead of it at its weighted share.
    stats = queue_stats.lane_stats(platform, task["queue_class"], conn=conn)
    ahead = dataclasses.replace(stats, queued_units=pos["lane_units_ahead"])
    wait = queue_stats.expected_wait_seconds(ahead, tenant_weight=policy["weight"], tenant_queued_units=pos["tenant_units_ahead"],
                                             tenant_active=True, units=task["fairness_units"])
    if binding == NOT_YET_ELIGIBLE:
        wait = max(wait, (task["next_eligible_at"] - now).total_seconds())
    pos["level"] = queue_stats.position_level(wait, platform.clock.real_seconds(policy["max_wait_seconds"]))
    known = binding not in NO_ESTIMATE and math.isfinite(wait)
    return {
        "binding_limit": binding,
        "detail": detail,
        "position": pos,
        "estimated_start_at": _iso(now + timedelta(seconds=min(wait, 10 * 365 * 86400))) if known else None,
        "estimated_start_seconds": math.ceil(wait) if known else None,
    }


TASK_OF_TENANT = "select * from generation_task where tenant_id = %s and task_id = %s"
TASK_BY_ID = "select * from generation_task where task_id = %s"


def for_operator(platform, conn: psycopg.Connection, task_id: UUID) -> dict:
    """Any tenant's task (the admin API): {task_id, tenant_id, state, binding_limit, ...}, with
    binding_limit and the rest null once the task is no longer QUEUED."""
    task = conn.execute(TASK_BY_ID, (task_id,)).fetchone()
    if task is None:
        raise NotFound("no such task", details={"task_id": str(task_id)})
    w = explain(platform, conn, task) or dict.fromkeys(
        ("binding_limit", "detail", "position", "estimated_start_at", "estimated_start_seconds"))
    return {"task_id": str(task["task_id"]), "tenant_id": str(task["tenant_id"]), "state": task["state"],
            "queue_class": task["queue_class"], **w}


def for_tenant(platform, conn: psycopg.Connection, task: dict) -> dict | None:
    """The `waiting` object of GET /v1/generations/{id}: the tenant's own numbers only (its caps,
    its queue), never the platform's internals (provider accounts, lane and provider capacities)
    or anything about other tenants: not even how many are ahead of it or backlogged, which would
    tell a customer how many others are active (the operator's view, for_operator, has them)."""
    w = explain(platform, conn, task)
    if w is None:
        return None
    d = w["detail"]
    if w["binding_limit"] in OWN_LIMITS:
        detail = {"cap": d["capacity_units"], "in_use": d["in_use_units"], "needed": d["needed_units"]}
    elif w["binding_limit"] == NOT_YET_ELIGIBLE:
        detail = {"eligible_at": d["eligible_at"]}
    elif w["binding_limit"] == TENANT_QUEUE_ORDER:
        detail = {"tasks_ahead": d["tasks_ahead"]}
    else:
        detail = {}
    p = w["position"]
    position_ = {k: p[k] for k in ("rank_in_tenant_lane", "tenant_tasks_ahead", "tenant_queued_tasks", "level")}
    return {**w, "detail": detail, "position": position_}


def for_tenant_task(platform, conn: psycopg.Connection, tenant_id: UUID, task_id: UUID) -> dict | None:
    """for_tenant by id, inside the tenant boundary: another tenant's id is NotFound like a missing one."""
    task = conn.execute(TASK_OF_TENANT, (tenant_id, task_id)).fetchone()
    if task is None:
        raise NotFound("no such task")
    return for_tenant(platform, conn, task)
