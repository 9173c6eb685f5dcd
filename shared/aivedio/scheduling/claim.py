"""The atomic claim (ch. 18.10). In one transaction with a fixed lock order (the task first, then
resource keys in sorted order): CAS the task QUEUED -> DISPATCHING, conditionally increment each
resource shard it needs (any failure rolls the claim back), write the resource_reservation rows, the
task_attempt with a fencing token from a monotonic sequence, and the TaskDispatchRequested outbox
event. Nothing external happens before that commit. The steps run server-side, in the
aivedio_claim function of migration 0050, so a claim costs one round trip."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.types.json import Jsonb

from aivedio.faults import safeguards
from aivedio.scheduling.resources import Demand, account_key, ensure_pools, preferred_shard, provider_key
from aivedio.scheduling.router import Route

ENTERPRISE = "ENTERPRISE_RESERVED"
LENDER_KEY = f"lane:{ENTERPRISE}:lent"


class NoRoom(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key

    @property
    def tenant_bound(self) -> bool:
        """The tenant's or user's own caps: no other route (account, region, lane) gives room."""
        return self.key.startswith(("tenant:", "user:"))

    @property
    def user_bound(self) -> bool:
        """One user's own caps: that user's other tasks would not fit, the tenant's other users' may."""
        return self.key.startswith("user:")


@dataclass(frozen=True)
class Claimed:
    task_id: uuid.UUID
    attempt_id: uuid.UUID
    fencing_token: int
    route: Route
    capacity_mode: str
    units: int
    enqueued_at: datetime | None = None  # for the queue-wait histogram


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


def claim_demands(task: dict, route: Route, policy: dict, *, lane_key: str, borrowed: bool, shards: int) -> list[Demand]:
    """Every key a claim increments, in the order it does (sorted: the lock order), so the first
    key without room is the one NoRoom names (aivedio.scheduling.why_waiting checks the same list)."""
    demands = (demands_for(task, route, lane_key=lane_key, borrowed=borrowed, shards=shards)
               + [d for d, _ in tenant_demands(task, policy)])
    if safeguards.broken("capacity-check"):
        # A chaos run only: the provider account's slots are not taken, so a full account never refuses a claim.
        account = {account_key(route.provider, route.account),
                   provider_key(route.provider, route.account, route.region, route.model)}
        demands = [d for d in demands if d.key not in account]
    return sorted((d for d in demands if d.units > 0), key=lambda d: d.key)


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
    """Claim one task inside the caller's transaction: one call of the aivedio_claim function
    (migration 0050), which does every step of the module docstring in one subtransaction. On
    NoRoom nothing it wrote remains and the task stays QUEUED. `prefer` picks the shard of every
    sharded key; a caller claiming several tasks in one transaction passes the same value for all
    of them, so the transaction locks one shard per key, in key order, and two batches never
    deadlock."""
    caps = {d.key: cap for d, cap in tenant_demands(task, policy)}
    missing = [(key, cap) for key, cap in caps.items() if (key, cap) not in ensured]
    if not missing:
        return _claim(conn, task, route, policy, caps, lane_key=lane_key, borrowed=borrowed, shards=shards,
                      lease_seconds=lease_seconds, now=now, ensured=ensured, prefer=prefer)
    # First contact (or a new policy version): the tenant's pools are created with the claim, under a
    # savepoint, so a claim that finds no room takes them back with it.
    with conn.transaction():
        ensure_pools(conn, [(key, cap, 1) for key, cap in missing])
        claimed = _claim(conn, task, route, policy, caps, lane_key=lane_key, borrowed=borrowed, shards=shards,
                         lease_seconds=lease_seconds, now=now, ensured=ensured, prefer=prefer)
    # Noted only once the savepoint holds: a claim that failed rolled its new pools back with it.
    ensured.update(missing)
    return claimed


def _claim(conn: psycopg.Connection, task: dict, route: Route, policy: dict, caps: dict[str, int], *, lane_key: str,
           borrowed: bool, shards: int, lease_seconds: float, now: datetime, ensured: set[tuple[str, int]],
           prefer: int | None) -> Claimed:
    attempt_id = uuid.uuid4()
    mode = "BORROWED" if borrowed else "NORMAL"
    demands = claim_demands(task, route, policy, lane_key=lane_key, borrowed=borrowed, shards=shards)
    if prefer is None:
        prefer = preferred_shard(task["task_id"])
    event_id = uuid.uuid4()
    payload = {"task_id": str(task["task_id"]), "attempt_id": str(attempt_id), "tenant_id": str(task["tenant_id"]),
               "queue_class": task["queue_class"], "provider": route.provider, "provider_account": route.account,
               "model_code": route.model, "resource_class": task["resource_class"], "policy_version": task["policy_version"],
               "capacity_mode": mode, "created_at": now.isoformat()}
    params = {"task": task["task_id"], "tenant": task["tenant_id"], "version": task["version"], "attempt": attempt_id,
              "provider": route.provider, "account": route.account, "region": route.region, "model": route.model,
              "mode": mode, "cost": route.expected_cost, "currency": route.currency,
              "lease": datetime.fromtimestamp(now.timestamp() + lease_seconds, tz=now.tzinfo), "now": now,
              "keys": [d.key for d in demands], "units": [d.units for d in demands], "shards": [d.shards for d in demands],
              "prefer": prefer, "event_id": event_id, "payload": Jsonb(payload)}
    for _ in range(2):
        row = conn.execute(CLAIM, params).fetchone()
        if row["status"] == "OK":
            break
        key = row["detail"]
        if key in caps and (key, caps[key]) in ensured and not _pool_exists(conn, key):
            # `ensured` outlives transactions: a visit retried after a deadlock rolled back the
            # pools it noted. Without them every claim of the tenant would fail as CAPPED.
            ensure_pools(conn, [(k, cap, 1) for k, cap in caps.items()])
            continue
        raise NoRoom(key)
    else:
        raise NoRoom(row["detail"])
    return Claimed(task["task_id"], attempt_id, row["fencing"], route, mode, task["fairness_units"], task.get("enqueue_at"))


CLAIM = """select status, detail, fencing, task_version
             from aivedio_claim(%(task)s, %(tenant)s, %(version)s, %(attempt)s, %(provider)s, %(account)s, %(region)s,
                                %(model)s, %(mode)s, %(cost)s, %(currency)s, %(lease)s, %(now)s, %(keys)s::text[],
                                %(units)s::bigint[], %(shards)s::integer[], %(prefer)s, %(event_id)s, %(payload)s)"""


def _pool_exists(conn: psycopg.Connection, key: str) -> bool:
    return conn.execute("select exists(select 1 from resource_pool_shard where resource_key = %s) as e", (key,)).fetchone()["e"]
