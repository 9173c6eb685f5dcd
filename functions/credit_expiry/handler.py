"""Scheduled credit maintenance, room service `credit-expiry` (aivedio.reconcile.room): subscription
period grants, then the expiry sweeper that books EXPIRE for credit lots that expired unused, then a
retry of settlement events parked because their task was not known yet."""
from __future__ import annotations

from aivedio.context import get_platform
from aivedio.observability import logger
from aivedio.reconcile import room


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    return room.run(get_platform(), "credit-expiry").as_dict()
