"""Where work goes: which function consumes each outbox event type, and which functions run on a
schedule. The one table both runtimes read:

- locally, aivedio.local.runtime registers each subscription as an in-process SQS-style consumer
  and turns each schedule into a loop whose interval comes from the config file (time_scale);
- in AWS, the CDK app (infra_cdk/messaging.py) makes one SQS queue, with its DLQ, per consuming
  function, points AIVEDIO_EVENT_QUEUES of the outbox relay at it for each of its event types, and
  makes one EventBridge schedule per entry of SCHEDULES.

A capability that adds a consumer or a periodic job adds one line here, and both places follow.
One event type has at most one consumer: the relay sends each event to one queue (see
functions/outbox_relay). Event types nobody consumes go to the catch-all queue in AWS and to no one
locally, so an unconsumed type is never an error."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aivedio.config import PlatformConfig
from aivedio.reconcile import idempotency_purge


@dataclass(frozen=True)
class Subscription:
    event_type: str
    consumer: str  # a directory under functions/: its handler.py consumes SQS batches

    @property
    def module(self) -> str:
        return f"functions.{self.consumer}.handler"


@dataclass(frozen=True)
class Schedule:
    name: str  # the loop name locally; the EventBridge rule is aivedio-<stage>-<name>
    function: str  # a directory under functions/
    local_interval: Callable[[PlatformConfig], float]  # platform seconds between local runs
    aws_every_minutes: int  # EventBridge's finest rate is one minute; the handler loops within a run

    @property
    def module(self) -> str:
        return f"functions.{self.function}.handler"


SUBSCRIPTIONS: tuple[Subscription, ...] = (
    Subscription("TaskQueued", "queue_indexer"),
    Subscription("TaskDispatchRequested", "dispatch"),
    Subscription("TaskSucceeded", "settlement"),
    Subscription("TaskFailed", "settlement"),
    Subscription("TaskCancelled", "settlement"),
)

SCHEDULES: tuple[Schedule, ...] = (
    Schedule("outbox-relay", "outbox_relay", lambda c: c.timers.outbox_relay_seconds, 1),
    Schedule("scheduler-tick", "scheduler_tick", lambda c: c.timers.scheduler_tick_seconds, 1),
    Schedule("scheduler-maintenance", "scheduler_maintenance", lambda c: c.timers.aging_step_seconds / 4, 1),
    Schedule("attempt-recovery", "attempt_recovery", lambda c: c.timers.attempt_recovery_seconds, 1),
    Schedule("credit-expiry", "credit_expiry", lambda c: c.billing.credit_expiry_seconds, 5),
    Schedule("wallet-check", "wallet_check", lambda c: c.billing.wallet_check_seconds, 30),
    Schedule("idempotency-purge", "idempotency_purge", lambda c: idempotency_purge.INTERVAL_SECONDS,
             idempotency_purge.AWS_EVERY_MINUTES),
)


def consumers() -> dict[str, tuple[str, ...]]:
    """Consuming function -> the event types it receives, in table order."""
    out: dict[str, list[str]] = {}
    for s in SUBSCRIPTIONS:
        out.setdefault(s.consumer, []).append(s.event_type)
    return {k: tuple(v) for k, v in out.items()}


def check() -> None:
    """The table's own rules; the CDK app and the tests call it."""
    seen: dict[str, str] = {}
    for s in SUBSCRIPTIONS:
        if s.event_type in seen and seen[s.event_type] != s.consumer:
            raise ValueError(f"event type {s.event_type!r} has two consumers ({seen[s.event_type]}, {s.consumer}); "
                             "the outbox relay sends an event to one queue")
        seen[s.event_type] = s.consumer
    names = [s.name for s in SCHEDULES]
    if len(names) != len(set(names)):
        raise ValueError("two schedules share a name")
    for s in SCHEDULES:
        if s.aws_every_minutes < 1:
            raise ValueError(f"schedule {s.name}: EventBridge rates are whole minutes")
