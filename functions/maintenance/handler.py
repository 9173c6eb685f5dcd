"""Scheduled: one service of the maintenance room (aivedio.reconcile.room), the one its EventBridge
schedule names in its input, `{"service": "<name>"}`. Every service added to the room since the
older ones runs here, one schedule each."""
from __future__ import annotations

from aivedio.context import get_platform
from aivedio.errors import InvalidRequest
from aivedio.observability import logger
from aivedio.reconcile import room


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    name = (event or {}).get("service")
    if not isinstance(name, str):
        raise InvalidRequest("the schedule's input names no maintenance service", {"service": "required"})
    svc = room.service(name)
    if svc.function != room.MAINTENANCE_FUNCTION:
        raise InvalidRequest(f"service {name!r} runs on its own function, {svc.function}", {"service": name})
    return room.run(get_platform(), name).as_dict()
