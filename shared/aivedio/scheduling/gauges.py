"""The scheduler's gauges for the dashboard (aivedio.metrics_catalog): per lane the queued tasks and
cost units, the oldest wait, the units in use of its capacity, what its work borrows and its
utilisation against safe capacity; provider utilisation (running slots over capacity); and the
credits held by reservations in flight. The scheduling tick publishes them, at most once a minute
per process, since each costs a query."""
from __future__ import annotations

from aivedio.metrics_catalog import (
    BORROWED_UNITS,
    LANE_UTILISATION,
    OLDEST_WAIT_SECONDS,
    PROVIDER_UTILISATION,
    QUEUE_DEPTH_TASKS,
    QUEUE_DEPTH_UNITS,
    RESERVED_CREDITS_IN_FLIGHT,
    RUNNING_UNITS,
)
from aivedio.observability import due, publish
from aivedio.policy.capacity import effective_config
from aivedio.scheduling.resources import account_key

EVERY_SECONDS = 60.0


def read_gauges(platform) -> dict:
    now = platform.clock.now()
    with platform.db.connection() as conn:
        lanes = {r["queue_class"]: r for r in conn.execute(
            """select queue_class, count(*) as tasks, coalesce(sum(fairness_units), 0)::bigint as units,
                      min(enqueue_at) as oldest
                 from generation_task where state = 'QUEUED' group by queue_class""").fetchall()}
        slots = {r["resource_key"]: r for r in conn.execute(
            """select resource_key, sum(used_units)::bigint as used,
                      sum(least(capacity_units, coalesce(limit_units, capacity_units)))::bigint as cap
                 from resource_pool_shard where resource_key like 'provider-account:%%' or resource_key like 'lane:%%'
                group by resource_key""").fetchall()}
        borrowed = {r["queue_class"]: int(r["units"]) for r in conn.execute(
            """select t.queue_class, sum(r.reserved_units)::bigint as units
                 from resource_reservation r join generation_task t on t.task_id = r.task_id
                where r.state = 'ACTIVE' and r.capacity_mode = 'BORROWED' and r.resource_key like 'lane:%%'
                group by t.queue_class""").fetchall()}
        credits = conn.execute(
            """select coalesce(sum(reserved_amount - settled_amount - released_amount), 0)::bigint as held
                 from credit_reservation where state = 'ACTIVE'""").fetchone()
    out = {"lanes": {}, "providers": {}, "reserved_credits": int(credits["held"])}
    for lane, lc in effective_config(platform).lanes.items():  # with the operator's capacity overrides
        r = lanes.get(lane)
        waited = (now - r["oldest"]).total_seconds() * platform.clock.time_scale if r and r["oldest"] else 0.0
        used = int(slots[f"lane:{lane}"]["used"]) if f"lane:{lane}" in slots else 0
        safe = max(0, lc.capacity_units - lc.min_headroom_units)
        out["lanes"][lane] = {"queued_tasks": int(r["tasks"]) if r else 0, "queued_units": int(r["units"]) if r else 0,
                              "oldest_wait_seconds": round(max(0.0, waited), 1), "running_units": used,
                              "borrowed_units": borrowed.get(lane, 0),
                              "utilisation_percent": round(100.0 * used / safe, 1) if safe else 0.0}
    for p in platform.config.providers:
        used = sum(int(slots[k]["used"]) for a in p.accounts if (k := account_key(p.name, a.account_id)) in slots)
        cap = sum(int(slots[k]["cap"]) for a in p.accounts if (k := account_key(p.name, a.account_id)) in slots)
        out["providers"][p.name] = {"running": used, "capacity": cap, "percent": round(100.0 * used / cap, 1) if cap else 0.0}
    return out


def publish_gauges(platform, *, force: bool = False) -> dict | None:
    if not force and not due("scheduler-gauges", EVERY_SECONDS):
        return None
    g = read_gauges(platform)
    for lane, v in g["lanes"].items():
        publish(QUEUE_DEPTH_TASKS, v["queued_tasks"], lane=lane)
        publish(QUEUE_DEPTH_UNITS, v["queued_units"], lane=lane)
        publish(OLDEST_WAIT_SECONDS, v["oldest_wait_seconds"], lane=lane)
        publish(RUNNING_UNITS, v["running_units"], lane=lane)
        publish(BORROWED_UNITS, v["borrowed_units"], lane=lane)
        publish(LANE_UTILISATION, v["utilisation_percent"], lane=lane)
    publish(RESERVED_CREDITS_IN_FLIGHT, g["reserved_credits"])
    for provider, v in g["providers"].items():
        publish(PROVIDER_UTILISATION, v["percent"], provider=provider)
    return g
