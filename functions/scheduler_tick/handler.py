"""The scheduling tick, a continuous schedule (aivedio.events_routing): in AWS each run keeps
ticking until near its timeout, claiming in small batches; while idle it ticks every
`timers.scheduler_tick_seconds`, and at once when woken (aivedio.wakeups): by the queue indexer
when a tenant joins a ring, by the outbox relay when a terminal task freed capacity. A new run
starts every minute and two overlap, so one is always ticking. Replicas are safe: claims are CAS
and conditional increments, and a tenant's DRR row is locked SKIP LOCKED. Locally the
`scheduler-tick` loop calls it, one tick a run, at the same interval and woken the same way.

After a tick that claimed, the relay is woken, so the claims' TaskDispatchRequested go out now."""
from __future__ import annotations

from aivedio import events_routing
from aivedio.context import get_platform
from aivedio.observability import logger
from aivedio.scheduling.gauges import publish_gauges
from aivedio.scheduling.scheduler import Scheduler
from aivedio.wakeups import ContinuousRun

RESERVE_MILLIS = 5_000


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    platform = get_platform()
    scheduler = Scheduler(platform)
    run = ContinuousRun(platform, events_routing.TICK, context, reserve_millis=RESERVE_MILLIS)
    total = visits = 0
    conservative = False
    while (budget := min(platform.config.scheduler.tick_budget_seconds, run.seconds_left())) > 0:
        report = scheduler.tick(budget)
        total, visits = total + report.claims, visits + report.visits
        conservative |= report.conservative
        if report.claims:
            platform.wake(events_routing.RELAY)
        publish_gauges(platform)  # at most once a minute per process
        if report.claims and not run.local:
            continue  # there may be more it can claim now (locally the loop calls again)
        if not run.idle():
            break
    if total:
        logger.info("scheduler tick", extra={"claims": total, "visits": visits, "conservative": conservative})
    return {"claims": total, "visits": visits, "conservative": conservative}
