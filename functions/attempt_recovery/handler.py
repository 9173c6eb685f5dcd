"""Scheduled: the attempt lease scanner, room service `attempt-recovery` (aivedio.reconcile.room).
Restarts the workflow of every live attempt whose lease expired (its execution was lost); the
restarted workflow resumes from PostgreSQL."""
from __future__ import annotations

from aivedio.context import get_platform
from aivedio.observability import logger
from aivedio.reconcile import room


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    return room.run(get_platform(), "attempt-recovery").as_dict()
