"""Scheduled idempotency maintenance: deletes idempotency records whose TTL has passed, in batches
(aivedio.reconcile.idempotency_purge)."""
from __future__ import annotations

from aivedio.context import get_platform
from aivedio.observability import logger
from aivedio.reconcile import idempotency_purge


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    return idempotency_purge.run_once(get_platform()).as_dict()
