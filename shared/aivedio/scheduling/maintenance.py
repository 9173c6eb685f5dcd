"""Periodic scheduler maintenance, each job driven alone by its scheduled handler:
- aging (ch. 18.6.6): a waiting task moves up one priority band per aging step, never above P1,
  by a periodic UPDATE rather than by rewriting every score;
- the starvation detector: a task waiting past its lane's maximum gets an intervention, logged
  and recorded: promoted to P1 so its tenant's next visit serves it first."""
from __future__ import annotations

import json

from aivedio.metrics_catalog import STARVATION_INTERVENTIONS
from aivedio.observability import logger, publish

TOP_AGING_BAND = 1  # P0 is kept for recovery work
AGING_BATCH = 5000
STARVATION_BATCH = 500  # tasks per transaction
STARVATION_BATCHES = 20  # per lane per run: a backlog crossing the threshold at once is flagged in one run


def age_tasks(platform) -> int:
    step = platform.clock.real_seconds(platform.config.timers.aging_step_seconds)
    now = platform.clock.now()

    def tx(conn) -> int:
        return conn.execute(
            """update generation_task t set priority_band = t.priority_band - 1, aging_promotions = t.aging_promotions + 1,
                      updated_at = %(now)s, version = t.version + 1
                where t.task_id in (
                      select task_id from generation_task
                       where state = 'QUEUED' and priority_band > %(top)s
                         and enqueue_at <= %(now)s - make_interval(secs => %(step)s * (aging_promotions + 1))
                       order by enqueue_at limit %(batch)s
                       for update skip locked)
                  and t.state = 'QUEUED'""",
            {"now": now, "top": TOP_AGING_BAND, "step": step, "batch": AGING_BATCH},
        ).rowcount

    promoted = platform.db.transaction(tx)
    if promoted:
        logger.info("aging promoted tasks", extra={"promoted": promoted})
    return promoted


def detect_starvation(platform) -> int:
    now = platform.clock.now()
    found = 0
    for lane, lc in platform.config.lanes.items():
        limit = now - platform.clock.delta(lc.max_wait_seconds)

        def tx(conn, lane=lane, limit=limit) -> list[dict]:
            rows = conn.execute(
                """select task_id, tenant_id, enqueue_at, priority_band from generation_task
                    where state = 'QUEUED' and queue_class = %s and enqueue_at < %s
                      and not exists (select 1 from scheduler_intervention i where i.task_id = generation_task.task_id
                                        and i.kind = 'STARVATION')
                    order by enqueue_at limit %s for update skip locked""",
                (lane, limit, STARVATION_BATCH),
                prepare=False,  # a generic plan for queue_class = $1 would scan the whole queue
            ).fetchall()
            for r in rows:
                waited = (now - r["enqueue_at"]).total_seconds() * platform.clock.time_scale
                conn.execute(
                    "insert into scheduler_intervention (lane, tenant_id, task_id, kind, detail) values (%s, %s, %s, 'STARVATION', %s)",
                    (lane, r["tenant_id"], r["task_id"], json.dumps({"waited_seconds": round(waited, 1), "band_before": r["priority_band"]})),
                )
                conn.execute("update generation_task set priority_band = least(priority_band, %s), version = version + 1 where task_id = %s",
                             (TOP_AGING_BAND, r["task_id"]))
            return rows

        for _ in range(STARVATION_BATCHES):
            rows = platform.db.transaction(tx)
            for r in rows:
                logger.warning("starvation intervention", extra={"lane": lane, "tenant_id": str(r["tenant_id"]), "task_id": str(r["task_id"])})
            found += len(rows)
            if len(rows) < STARVATION_BATCH:
                break
    if found:
        publish(STARVATION_INTERVENTIONS, found)
    return found
