"""Scheduled: the attempt lease scanner. Restarts the workflow of every live attempt whose lease
expired (its execution was lost); the restarted workflow resumes from PostgreSQL."""
from __future__ import annotations

from aivedio.attempts.recovery import restart_expired
from aivedio.context import get_platform
from aivedio.observability import logger


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    return {"restarted": restart_expired(get_platform())}
