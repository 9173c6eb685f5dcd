"""The scheduler's gauges for the dashboard (aivedio.metrics_catalog): queued cost units and the
oldest wait per lane, and provider utilisation (running slots over capacity). The scheduling tick
publishes them, at most once a minute per process, since each costs a query."""
from __future__ import annotations

from aivedio.metrics_catalog import OLDEST_WAIT_SECONDS, PROVIDER_UTILISATION, QUEUE_DEPTH_UNITS
from aivedio.observability import due, publish
from aivedio.scheduling.resources import account_key

EVERY_SECONDS = 60.0


def read_gauges(platform) -> dict:
    now = platform.clock.now()
    with platform.db.connection() as conn:
        lanes = {r["queue_class"]: r for r in conn.execute(
            """select queue_class, coalesce(sum(fairness_units), 0)::bigint as units, min(enqueue_at) as oldest
                 from generation_task where state = 'QUEUED' group by queue_class""").fetchall()}
        slots = {r["resource_key"]: r for r in conn.execute(
            """select resource_key, sum(used_units)::bigint as used,
                      sum(least(capacity_units, coalesce(limit_units, capacity_units)))::bigint as cap
                 from resource_pool_shard where resource_key like 'provider-account:%%' group by resource_key""").fetchall()}
    out = {"lanes": {}, "providers": {}}
    for lane in platform.config.lanes:
        r = lanes.get(lane)
        waited = (now - r["oldest"]).total_seconds() * platform.clock.time_scale if r and r["oldest"] else 0.0
        out["lanes"][lane] = {"queued_units": int(r["units"]) if r else 0, "oldest_wait_seconds": round(max(0.0, waited), 1)}
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
        publish(QUEUE_DEPTH_UNITS, v["queued_units"], lane=lane)
        publish(OLDEST_WAIT_SECONDS, v["oldest_wait_seconds"], lane=lane)
    for provider, v in g["providers"].items():
        publish(PROVIDER_UTILISATION, v["percent"], provider=provider)
    return g
