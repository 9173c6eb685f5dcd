"""Room service `scheduler-maintenance` (aivedio.scheduling.maintenance): aging, the starvation
detector (ch. 18.3.6: a task past its lane's maximum wait gets an intervention, logged and recorded
in scheduler_intervention), and the queue-index rebuild (each lane's ring re-added from
PostgreSQL's QUEUED tasks, ch. 18.16.6 QueueIndexRebuilder)."""
from __future__ import annotations

from aivedio.reconcile.room import Defaults, Report
from aivedio.scheduling.maintenance import age_tasks, detect_starvation
from aivedio.scheduling.ring import Ring

NAME = "scheduler-maintenance"
DEFAULTS = Defaults(interval_seconds=60.0)  # locally a quarter of the aging step (timers.aging_step_seconds)


def run_once(platform) -> Report:
    promoted = age_tasks(platform)
    starving = detect_starvation(platform)
    readded = 0
    ring = Ring(platform)
    with platform.db.connection() as conn:
        for lane in platform.config.lanes:
            readded += ring.rebuild(conn, lane)
    return Report(NAME, examined=promoted + starving + readded, repaired=starving + readded, batches=1,
                  details={"promoted": promoted, "starvation_interventions": starving, "ring_tenants_readded": readded})
