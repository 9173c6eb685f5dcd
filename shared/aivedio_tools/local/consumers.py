"""Local stand-in for the SQS queues events fan out to: consumers register per event type, and the
outbox relay's local deliver() calls each in-process. Delivery is at least once, as with SQS: a
consumer that raises makes the event be delivered again later (to every consumer of that type, so
consumers deduplicate with aivedio.outbox.mark_processed)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Consumer = Callable[[dict[str, Any]], None]
CONSUMERS: dict[str, list[Consumer]] = {}


class DeliveryFailed(Exception):
    """One or more consumers raised; the relay retries the event."""


def register(event_type: str, fn: Consumer) -> Consumer:
    """Subscribe fn to event_type. Registering the same fn twice subscribes it once."""
    fns = CONSUMERS.setdefault(event_type, [])
    if fn not in fns:
        fns.append(fn)
    return fn


def unregister(event_type: str, fn: Consumer) -> None:
    fns = CONSUMERS.get(event_type, [])
    if fn in fns:
        fns.remove(fn)


def deliver(envelope: dict[str, Any]) -> None:
    """Hand the event to every consumer of its type. All are called even when one raises, as
    separate queues would; then the failures are raised together."""
    errors: list[str] = []
    for fn in list(CONSUMERS.get(envelope["event_type"], ())):
        try:
            fn(envelope)
        except Exception as e:
            log.warning("consumer %s failed on %s %s: %r", getattr(fn, "__qualname__", fn), envelope["event_type"], envelope["event_id"], e)
            errors.append(f"{getattr(fn, '__qualname__', fn)}: {e!r}")
    if errors:
        raise DeliveryFailed("; ".join(errors))
