"""The atomic claim (ch. 18.10). In one transaction with a fixed lock order (the task first, then
resource keys in sorted order): CAS the task QUEUED -> DISPATCHING, conditionally increment each
resource shard it needs (any failure rolls the claim back), write the resource_reservation rows, the
task_attempt with a fencing token from a monotonic sequence, and the TaskDispatchRequested outbox
event. Nothing external happens before that commit."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

import psycopg

from aivedio import outbox
from aivedio.scheduling.resources import Demand, account_key, ensure_pools, preferred_shard, provider_key, try_increment
from aivedio.scheduling.router import Route

ENTERPRISE = "ENTERPRISE_RESERVED"
LENDER_KEY = f"lane:{ENTERPRISE}:lent"


class NoRoom(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key

    @property
    def tenant_bound(self) -> bool:
        """The tenant's or user's own caps: other tasks of this tenant would not fit either."""
        return self.key.startswith(("tenant:", "user:"))


@dataclass(frozen=True)
class Claimed:
    task_id: uuid.UUID
    attempt_id: uuid.UUID
    fencing_token: int
    route: Route
    capacity_mode: str
    units: int


def tenant_demands(task: dict, policy: dict) -> list[tuple[Demand, int]]:
    """(demand, capacity) of the tenant's and the user's running caps; one shard each."""
    t, u = task["tenant_id"], task["user_id"]
    return [
        (Demand(f"tenant:{t}:running_tasks", 1), policy["max_running_tasks"]),
        (Demand(f"tenant:{t}:running_units", task["fairness_units"]), policy["max_running_units"]),
        (Demand(f"user:{t}:{u}:running_tasks", 1), policy["max_user_running_tasks"]),
        (Demand(f"user:{t}:{u}:running_units", task["fairness_units"]), policy["max_user_running_units"]),
    ]


def demands_for(task: dict, route: Route, *, lane_key: str, borrowed: bool, shards: int) -> list[Demand]:
    units = task["fairness_units"]
    d = [
        Demand(lane_key, units, shards),
        Demand(account_key(route.provider, route.account), task["provider_slot_units"], shards),
        Demand(provider_key(route.provider, route.account, route.region, route.model), task["provider_slot_units"], shards),
        Demand(f"model:{route.model}", task["provider_slot_units"], shards),
        Demand("cost:platform", task["estimated_cost_units"], shards),
    ]
    if task["media_units"]:
        d.append(Demand("worker:cpu", task["media_units"], shards))
    if task["gpu_units"]:
        d.append(Demand("worker:gpu", task["gpu_units"], shards))
    if borrowed:
        d.append(Demand(LENDER_KEY, units, 1))
    return d


def claim(
    conn: psycopg.Connection,
    task: dict,
    route: Route,
    policy: dict,
    *,
    lane_key: str,
    borrowed: bool,
    shards: int,
    lease_seconds: float,
    now: datetime,
    ensured: set[tuple[str, int]],
    prefer: int | None = None,
) -> Claimed:
    """Claim one task inside the caller's transaction, under a savepoint: on NoRoom everything this
    claim wrote is rolled back and the task stays QUEUED. `prefer` picks the shard of every sharded
    key; a caller claiming several tasks in one transaction passes the same value for all of them,
    so the transaction locks one shard per key, in key order, and two batches never deadlock."""
    attempt_id = uuid.uuid4()
    mode = "BORROWED" if borrowed else "NORMAL"
    with conn.transaction():
        row = conn.execute(
            """update generation_task
                  set state = 'DISPATCHING', version = version + 1, updated_at = %(now)s,
                      current_attempt_id = %(a)s, current_fencing_token = nextval('fencing_token_seq'),
                      selected_provider = %(p)s, selected_account = %(acct)s, capacity_mode = %(mode)s
                where task_id = %(t)s and tenant_id = %(tenant)s and state = 'QUEUED' and version = %(v)s
                returning version, current_fencing_token""",
            {"now": now, "a": attempt_id, "p": route.provider, "acct": route.account, "mode": mode,
             "t": task["task_id"], "tenant": task["tenant_id"], "v": task["version"]},
        ).fetchone()
        if row is None:
            raise NoRoom("task:moved")
        fencing = row["current_fencing_token"]
        # Pools of per-tenant caps follow the policy version; the missing ones in one round trip.
        caps = {d.key: cap for d, cap in tenant_demands(task, policy)}
        missing = [(key, cap) for key, cap in caps.items() if (key, cap) not in ensured]
        if missing:
            ensure_pools(conn, [(key, cap, 1) for key, cap in missing])
        all_demands = sorted(demands_for(task, route, lane_key=lane_key, borrowed=borrowed, shards=shards)
                             + [d for d, _ in tenant_demands(task, policy)], key=lambda d: d.key)
        if prefer is None:
            prefer = preferred_shard(task["task_id"])
        taken: list[tuple[Demand, int]] = []
        for d in all_demands:
            if d.units <= 0:
                continue
            shard = try_increment(conn, d.key, d.units, prefer, d.shards)
            if shard is None and d.key in caps and (d.key, caps[d.key]) in ensured and not _pool_exists(conn, d.key):
                # `ensured` outlives transactions: a visit retried after a deadlock rolled back the
                # pool it noted. Without the pool every claim of the tenant would fail as CAPPED.
                ensure_pools(conn, [(d.key, caps[d.key], 1)])
                shard = try_increment(conn, d.key, d.units, prefer, d.shards)
            if shard is None:
                raise NoRoom(d.key)
            taken.append((d, shard))
        lease_until = now.timestamp() + lease_seconds
        conn.execute(
            """insert into task_attempt (attempt_id, task_id, tenant_id, attempt_no, provider, provider_account, region,
                                         model_code, provider_request_key, state, fencing_token, estimated_cost_amount,
                                         estimated_cost_currency, capacity_mode, lease_until, created_at, updated_at)
               select %(a)s, %(t)s, %(tenant)s, coalesce(max(attempt_no), 0) + 1, %(p)s, %(acct)s, %(region)s, %(model)s,
                      %(t)s::text || ':' || (coalesce(max(attempt_no), 0) + 1)::text, 'DISPATCHING', %(f)s, %(cost)s,
                      %(cur)s, %(mode)s, to_timestamp(%(lease)s), %(now)s, %(now)s
                 from task_attempt where task_id = %(t)s""",
            {"a": attempt_id, "t": task["task_id"], "tenant": task["tenant_id"], "p": route.provider, "acct": route.account,
             "region": route.region, "model": route.model, "f": fencing, "cost": route.expected_cost, "cur": route.currency,
             "mode": mode, "lease": lease_until, "now": now},
        )
        with conn.cursor() as cur:
            cur.executemany(
                """insert into resource_reservation (task_id, attempt_id, tenant_id, resource_key, shard_no, reserved_units,
                                                     state, lease_until, fencing_token, capacity_mode, created_at)
                   values (%s, %s, %s, %s, %s, %s, 'ACTIVE', to_timestamp(%s), %s, %s, %s)""",
                [(task["task_id"], attempt_id, task["tenant_id"], d.key, shard, d.units, lease_until, fencing, mode, now)
                 for d, shard in taken],
            )
        outbox.write_event(conn, "TaskDispatchRequested", aggregate_type="generation_task", aggregate_id=task["task_id"],
                           tenant_id=task["tenant_id"], payload={
                               "task_id": str(task["task_id"]), "attempt_id": str(attempt_id), "tenant_id": str(task["tenant_id"]),
                               "queue_class": task["queue_class"], "provider": route.provider, "provider_account": route.account,
                               "model_code": route.model, "resource_class": task["resource_class"], "fencing_token": fencing,
                               "policy_version": task["policy_version"], "aggregate_version": row["version"],
                               "capacity_mode": mode, "created_at": now.isoformat()})
    # Noted only once the savepoint holds: a claim that failed rolled its new pools back with it.
    ensured.update(missing)
    return Claimed(task["task_id"], attempt_id, fencing, route, mode, task["fairness_units"])


def _pool_exists(conn: psycopg.Connection, key: str) -> bool:
    return conn.execute("select exists(select 1 from resource_pool_shard where resource_key = %s) as e", (key,)).fetchone()["e"]
