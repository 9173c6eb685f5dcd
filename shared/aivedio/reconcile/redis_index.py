"""Room service `redis-index` (ch. 18.16.6 QueueIndexRebuilder; ch. 18.18: "恢复后重建 Redis 索引").

Each lane's ring in Redis should hold exactly the tenants with QUEUED tasks in that lane, each once
in the ring's list and once in its membership set. PostgreSQL is the fact. Each run:
- notices a lane whose index_built marker is missing (Redis came back empty after a restart or a
  FLUSHALL, or a process marked the lane stale after a write it could not make) and rebuilds it
  from PostgreSQL, as the scheduler tick also does;
- otherwise compares the lane's ring with PostgreSQL's set of tenants with queued work and repairs,
  in batches: a missing tenant is added (Ring.add: it waits one turn of the others, like a
  newcomer); a tenant with nothing queued, or one the list and the set disagree about, is taken
  out, then PostgreSQL is asked again and the tenant put back if it has queued work now. Taking
  out first and asking after means a task admitted meanwhile is never lost from the ring: either
  the second look sees it, or its queue indexer runs after the removal and adds the tenant;
- publishes every degraded mode's gauge (aivedio.health.publish_gauges), so the DegradedMode
  line is drawn even while nobody asks /healthz.
Deficits and paused turns are PostgreSQL's (drr_lane_tenant) and are left alone: the ring only says
who is visited. With Redis down the run does nothing but report it: the tick schedules from
PostgreSQL meanwhile, and the next run after Redis answers repairs."""
from __future__ import annotations

from psycopg import sql

from aivedio import health
from aivedio.cache.client import CacheUnavailable
from aivedio.reconcile import room
from aivedio.reconcile.room import Defaults, Report
from aivedio.scheduling.ring import DISABLED, DOWN, MISSING, Ring, active_tenants_pg

NAME = "redis-index"
DEFAULTS = Defaults(interval_seconds=60.0, batch_size=500, max_batches=20)

# Which of these tenants have queued work in the lane (the lane inlined, as in ring.py: its own plan).
STILL_QUEUED = """select distinct tenant_id::text as t from generation_task
                   where state = 'QUEUED' and queue_class = {lane} and tenant_id = any(%s::uuid[])"""


def _lane_sql(lane: str):
    return sql.SQL(STILL_QUEUED).format(lane=sql.Literal(lane))


def run_once(platform) -> Report:
    report = Report(NAME)
    health.publish_gauges(platform)
    ring = Ring(platform)
    tuning = room.tuning(platform, NAME)
    work: list[tuple[str, str, str]] = []  # (add | reset, lane, tenant id)
    compared = 0
    try:
        for lane in platform.config.lanes:
            state = ring.index_state(lane)
            if state in (DISABLED, DOWN):
                report.details["redis"] = state
                report.complete = state == DISABLED
                return report
            with platform.db.connection() as conn:
                if state == MISSING:
                    added = ring.rebuild(conn, lane)
                    report.count("lanes_rebuilt")
                    report.count("tenants_added", added)
                    report.repaired += added
                    continue
                queued = {str(t) for t in active_tenants_pg(conn, lane)}
            members, listed = ring.members(lane)
            compared += len(members | queued)
            counts: dict[str, int] = {}
            for t in listed:
                counts[t] = counts.get(t, 0) + 1
            bad = {t for t in members | set(counts) if t not in members or counts.get(t) != 1}  # list and set disagree
            work += [("add", lane, t) for t in sorted(queued - members - bad)]
            work += [("reset", lane, t) for t in sorted((members - queued) | bad)]
    except CacheUnavailable as e:
        report.details["redis"] = f"down: {e}"
        report.complete = False
        return report

    def batch(limit: int) -> tuple[int, int]:
        taken, work[:] = work[:limit], work[limit:]
        repaired = 0
        for action, lane, t in taken:
            if action == "add":
                ring.add(lane, t)
                report.count("tenants_added")
                repaired += 1
        resets: dict[str, list[str]] = {}
        for action, lane, t in taken:
            if action == "reset":
                ring.drop(lane, t)
                resets.setdefault(lane, []).append(t)
        if resets:
            with platform.db.connection() as conn:
                for lane, tenants in resets.items():
                    back = {r["t"] for r in conn.execute(_lane_sql(lane), (tenants,)).fetchall()}
                    for t in tenants:
                        if t in back:  # queued after all (admitted meanwhile, or a list/set mismatch): put back once
                            ring.add(lane, t)
                            report.count("tenants_reset")
                        else:
                            report.count("tenants_removed")
                        repaired += 1
        return len(taken), repaired

    try:
        room.in_batches(report, tuning, batch)
    except CacheUnavailable as e:
        report.details["redis"] = f"down: {e}"
        report.complete = False
    report.examined += compared
    report.details["tenants_compared"] = compared
    return report
