"""Room service `capacity-counters` (ch. 18.16.6: the reservations are the facts, never a cached
count; ch. 18.18: "容量计数异常 → 进入保守容量模式并触发全量重建").

Each resource_pool_shard.used_units must equal the sum of its ACTIVE resource_reservation rows: a
claim increments the shard and writes its reservations in one transaction, a release marks them
RELEASED and decrements in one. Each run:
1. compares every shard with its reservations in one statement (one snapshot, so a claim or a
   release is seen whole or not at all: no false alarm from work in flight);
2. when some disagree: logs an ALERT, records the capacity_counters degraded mode (degraded_mode,
   committed first, so every scheduler ticks conservatively and /healthz shows it), then repairs in
   batches: each batch takes its shard rows FOR UPDATE SKIP LOCKED, sums their reservations again
   under that lock (a claim or release on the shard must wait for it), sets used_units to the sum
   (capacity_units is raised to it if need be, so the row's check holds) and appends one audit_log
   row per shard (operator system:capacity-counters, old and new value);
3. ends the degraded mode once every mismatch it found is repaired or found consistent; a shard it
   had to skip (locked by a claim that instant) keeps the mode until the next run.
It never moves a reservation: the counter follows the facts, not the other way round."""
from __future__ import annotations

from aivedio import audit, degraded
from aivedio.observability import logger
from aivedio.reconcile import room
from aivedio.reconcile.room import Defaults, Report

NAME = "capacity-counters"
OPERATOR = "system:capacity-counters"
DEFAULTS = Defaults(interval_seconds=300.0, batch_size=200, max_batches=20)

# Every shard against its ACTIVE reservations, in one snapshot. resource_reservation has no index
# by shard (migration 0060 dropped it to keep claims cheap): one scan per run, not per shard.
MISMATCHES = """
with truth as (
    select resource_key, shard_no, sum(reserved_units)::bigint as used
      from resource_reservation where state = 'ACTIVE' group by resource_key, shard_no)
select s.resource_key, s.shard_no, s.used_units as counted, coalesce(t.used, 0) as reserved
  from resource_pool_shard s left join truth t using (resource_key, shard_no)
 where s.used_units <> coalesce(t.used, 0)
 order by s.resource_key, s.shard_no
"""
COUNT_SHARDS = "select count(*) as n from resource_pool_shard"
LOCK_SHARDS = """select resource_key, shard_no, used_units, capacity_units from resource_pool_shard
                  where (resource_key, shard_no) in (select * from unnest(%(keys)s::text[], %(shards)s::int[]))
                  order by resource_key, shard_no
                    for update skip locked"""
RESERVED_ON = """select resource_key, shard_no, sum(reserved_units)::bigint as used from resource_reservation
                  where state = 'ACTIVE' and resource_key = any(%(keys)s::text[])
                  group by resource_key, shard_no"""
REPAIR = """update resource_pool_shard set used_units = %(used)s, capacity_units = greatest(capacity_units, %(used)s),
                   version = version + 1, updated_at = now()
             where resource_key = %(key)s and shard_no = %(shard)s"""


def detect(platform) -> list[dict]:
    """The shards whose counter disagrees with their reservations; when there are some, the
    capacity_counters degraded mode is recorded (committed) before this returns."""
    with platform.db.connection() as conn:
        rows = conn.execute(MISMATCHES).fetchall()
    if rows:
        logger.error("ALERT capacity counters disagree with their reservations: conservative capacity mode until repaired",
                     extra={"shards": len(rows), "first": f"{rows[0]['resource_key']}#{rows[0]['shard_no']}",
                            "counted": rows[0]["counted"], "reserved": rows[0]["reserved"]})
        platform.db.transaction(lambda conn: degraded.enter_stored(
            conn, degraded.CAPACITY_COUNTERS,
            f"{len(rows)} capacity counter(s) disagree with their ACTIVE reservations: conservative scheduling until "
            "the capacity-counters service commits the repair",
            shards=[f"{r['resource_key']}#{r['shard_no']}" for r in rows[:20]]))
    return rows


def run_once(platform) -> Report:
    report = Report(NAME)
    found = detect(platform)
    with platform.db.connection() as conn:
        report.details["shards_compared"] = int(conn.execute(COUNT_SHARDS).fetchone()["n"])
    if not found:
        # Nothing wrong (any more): a mode left by a run that died mid-repair ends here.
        if platform.db.transaction(lambda conn: degraded.leave_stored(conn, degraded.CAPACITY_COUNTERS)):
            report.count("degraded_mode_ended")
        return report
    todo = [(r["resource_key"], r["shard_no"]) for r in found]
    skipped: list[tuple[str, int]] = []

    def batch(limit: int) -> tuple[int, int]:
        taken, todo[:] = todo[:limit], todo[limit:]
        if not taken:
            return 0, 0

        def tx(conn) -> int:
            locked = conn.execute(LOCK_SHARDS, {"keys": [k for k, _ in taken], "shards": [s for _, s in taken]}).fetchall()
            got = {(r["resource_key"], r["shard_no"]) for r in locked}
            skipped.extend(t for t in taken if t not in got)  # a claim holds it this instant: next run
            truth = {(r["resource_key"], r["shard_no"]): int(r["used"]) for r in conn.execute(
                RESERVED_ON, {"keys": sorted({k for k, _ in got})}).fetchall()} if got else {}
            fixed = 0
            for r in locked:
                key = (r["resource_key"], r["shard_no"])
                used = truth.get(key, 0)
                if used == r["used_units"]:
                    report.count("consistent_under_lock")
                    continue
                conn.execute(REPAIR, {"used": used, "key": r["resource_key"], "shard": r["shard_no"]})
                audit.append(conn, operator=OPERATOR, action="capacity.counter.repair", target=f"shard:{r['resource_key']}#{r['shard_no']}",
                             old={"used_units": r["used_units"], "capacity_units": r["capacity_units"]},
                             new={"used_units": used, "capacity_units": max(r["capacity_units"], used)},
                             reason="used_units reset to the sum of the shard's ACTIVE reservations (ch. 18.16.6)")
                logger.error("ALERT capacity counter repaired", extra={"resource_key": r["resource_key"], "shard_no": r["shard_no"],
                                                                       "old_used_units": r["used_units"], "new_used_units": used})
                fixed += 1
            return fixed

        return len(taken), platform.db.transaction(tx)

    room.in_batches(report, room.tuning(platform, NAME), batch)
    report.details["mismatches_found"] = len(found)
    if skipped:
        report.details["skipped_locked"] = [f"{k}#{s}" for k, s in skipped]
        report.complete = False
    if report.complete:
        platform.db.transaction(lambda conn: degraded.leave_stored(conn, degraded.CAPACITY_COUNTERS))
    return report
