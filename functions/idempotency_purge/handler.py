"""Scheduled idempotency maintenance, room service `idempotency-purge` (aivedio.reconcile.room):
deletes idempotency records whose TTL has passed, in batches."""
from __future__ import annotations

from aivedio.context import get_platform
from aivedio.observability import logger
from aivedio.reconcile import room


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    return room.run(get_platform(), "idempotency-purge").as_dict()
