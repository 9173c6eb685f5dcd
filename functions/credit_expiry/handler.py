"""Scheduled credit maintenance: subscription period grants, then the expiry sweeper that books
EXPIRE for credit lots that expired unused (aivedio.billing.subscriptions, aivedio.billing.expiry),
then a retry of settlement events parked because their task was not known yet."""
from __future__ import annotations

from aivedio.billing import expiry, subscriptions
from aivedio.billing.settlement import retry_parked
from aivedio.context import get_platform
from aivedio.observability import logger


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    platform = get_platform()
    now = platform.clock.now()
    granted = subscriptions.grant_due(platform, now)
    expired = expiry.sweep(platform, now)
    retried = retry_parked(platform, now)
    return {"subscriptions": granted, "expiry": expired, "parked_settlements": retried}
