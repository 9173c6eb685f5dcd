"""Scheduled scheduler maintenance: aging, the starvation detector and the queue-index rebuilder."""
from __future__ import annotations

from aivedio.context import get_platform
from aivedio.observability import logger
from aivedio.scheduling.maintenance import age_tasks, detect_starvation
from aivedio.scheduling.ring import Ring


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    platform = get_platform()
    promoted = age_tasks(platform)
    starving = detect_starvation(platform)
    rebuilt = 0
    ring = Ring(platform)
    with platform.db.connection() as conn:
        for lane in platform.config.lanes:
            rebuilt += ring.rebuild(conn, lane)
    return {"promoted": promoted, "starvation_interventions": starving, "ring_tenants_readded": rebuilt}
