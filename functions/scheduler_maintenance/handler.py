"""Scheduled scheduler maintenance, room service `scheduler-maintenance` (aivedio.reconcile.room):
aging, the starvation detector and the queue-index rebuilder."""
from __future__ import annotations

from aivedio.context import get_platform
from aivedio.observability import logger
from aivedio.reconcile import room


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    return room.run(get_platform(), "scheduler-maintenance").as_dict()
