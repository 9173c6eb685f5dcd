"""The scheduling tick: EventBridge invokes it on a schedule; it loops for a bounded time, claiming
in small batches, and is safe to run as many concurrent replicas (claims are CAS and conditional
increments; a tenant's DRR row is locked SKIP LOCKED). Locally the `scheduler-tick` loop calls it,
and a release wakes that loop early."""
from __future__ import annotations

import time

from aivedio.context import get_platform
from aivedio.observability import logger
from aivedio.scheduling.gauges import publish_gauges
from aivedio.scheduling.scheduler import Scheduler

RESERVE_MILLIS = 5_000
IDLE_PAUSE_SECONDS = 1.0


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    platform = get_platform()
    scheduler = Scheduler(platform)
    total = visits = 0
    conservative = False
    while True:
        remaining = context.get_remaining_time_in_millis() - RESERVE_MILLIS
        budget = min(platform.config.scheduler.tick_budget_seconds, remaining / 1000.0)
        if budget <= 0:
            break
        report = scheduler.tick(budget)
        total, visits = total + report.claims, visits + report.visits
        conservative |= report.conservative
        if platform.extras.get("local_runtime") or report.claims == 0:
            break  # locally the loop calls again; in AWS an idle tick ends and the next schedule comes
        time.sleep(0)
    if total:
        logger.info("scheduler tick", extra={"claims": total, "visits": visits, "conservative": conservative})
    publish_gauges(platform)  # at most once a minute per process
    return {"claims": total, "visits": visits, "conservative": conservative}
