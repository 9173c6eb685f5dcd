"""Where work goes: which function consumes each outbox event type, and which functions run on a
schedule. The one table both runtimes read:

- locally, aivedio_tools.local.runtime registers each subscription as an in-process SQS-style consumer
  and turns each schedule into a loop whose interval comes from the config file (time_scale);
- in AWS, the CDK app (infra_cdk/messaging.py) makes one SQS queue, with its DLQ, per consuming
  function, points AIVEDIO_EVENT_QUEUES of the outbox relay at it for each of its event types, and
  makes one EventBridge schedule per entry of SCHEDULES.

A continuous schedule (the outbox relay, the scheduler tick) is on the path from an event to the
work it starts, so in AWS its handler does not end when idle: each run keeps polling until near its
timeout, every `local_interval` when idle, woken earlier by aivedio.wakeups; the CDK app gives it a
timeout of two schedule periods and reserved concurrency for two, so a new run starts every minute
while the last is still polling and one is always in progress. WAKES says which relayed event types
wake which loop: a terminal task released its capacity, so the tick runs at once.

AWS_EVENTS are the exception to "both runtimes": events an AWS service emits on EventBridge (Batch
job state changes) that a function consumes from its own SQS queue, with its DLQ, in AWS only;
each names what does that work locally instead.

A capability that adds a consumer or a periodic job adds one line here, and both places follow.
One event type has at most one consumer: the relay sends each event to one queue (see
functions/outbox_relay). Event types nobody consumes go to the catch-all queue in AWS and to no one
locally, so an unconsumed type is never an error."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aivedio.config import PlatformConfig
from aivedio.reconcile import room


@dataclass(frozen=True)
class Subscription:
    event_type: str
    consumer: str  # a directory under functions/: its handler.py consumes SQS batches

    @property
    def module(self) -> str:
        return f"functions.{self.consumer}.handler"


@dataclass(frozen=True)
class AwsEvents:
    """An AWS service's EventBridge events, consumed in AWS only: the CDK app makes a rule matching
    `source`, `detail_type` and `detail` (narrowed further by the app, e.g. to its own resources)
    that sends them to the consumer's own SQS queue (aivedio-<stage>-<consumer>, DLQ and alarm as
    for any consumer); its handler consumes SQS batches whose bodies are the EventBridge events."""

    name: str  # the rule: aivedio-<stage>-<name>
    source: str
    detail_type: str
    detail: dict[str, list[str]]
    consumer: str  # a directory under functions/
    local: str  # what does the same work under `aivedio serve`, where nothing emits these

    @property
    def module(self) -> str:
        return f"functions.{self.consumer}.handler"


@dataclass(frozen=True)
class Wake:
    event_type: str  # once the relay has published an event of this type ...
    loop: str  # ... it wakes this loop (a name of SCHEDULES)


@dataclass(frozen=True)
class Schedule:
    name: str  # the loop name locally; the EventBridge rule is aivedio-<stage>-<name>
    function: str  # a directory under functions/
    local_interval: Callable[[PlatformConfig], float]  # platform seconds between local runs (and idle polls)
    # EventBridge's finest rate is one minute; the handler loops within a run. A maintenance
    # service's rate comes from its module's DEFAULTS, read when asked: loading this table loads
    # no service module (a process importing the outbox would otherwise import every repair).
    every_minutes: int | Callable[[], int]
    continuous: bool = False  # in AWS a run polls until near its timeout, and two overlap (see above)
    payload: dict[str, str] | None = None  # the schedule's input (else EventBridge's scheduled event)

    @property
    def module(self) -> str:
        return f"functions.{self.function}.handler"

    @property
    def aws_every_minutes(self) -> int:
        return self.every_minutes() if callable(self.every_minutes) else self.every_minutes


SUBSCRIPTIONS: tuple[Subscription, ...] = (
    Subscription("TaskQueued", "queue_indexer"),
    Subscription("TaskDispatchRequested", "dispatch"),
    Subscription("TaskSucceeded", "settlement"),
    Subscription("TaskFailed", "settlement"),
    Subscription("TaskCancelled", "settlement"),
    Subscription("TaskMediaIngestFailed", "settlement"),
)

RELAY, TICK = "outbox-relay", "scheduler-tick"
MEDIA_DISPATCH = "media-dispatch"

# Batch job state changes of the media job queues (infra_cdk/media.py adds the queues' ARNs).
AWS_EVENTS: tuple[AwsEvents, ...] = (
    AwsEvents("media-job-state", "aws.batch", "Batch Job State Change", {"status": ["SUCCEEDED", "FAILED"]},
              "media_events", local="the local media dispatcher completes each job from its worker's stdout"),
)


def _maintenance(s: room.Service) -> Schedule:
    return Schedule(s.name, s.function, s.interval_seconds, lambda: s.defaults.aws_every_minutes, payload=s.payload)


# The two continuous loops, then every service of the maintenance room (aivedio.reconcile.room).
SCHEDULES: tuple[Schedule, ...] = (
    Schedule(RELAY, "outbox_relay", lambda c: c.timers.outbox_relay_seconds, 1, continuous=True),
    Schedule(TICK, "scheduler_tick", lambda c: c.timers.scheduler_tick_seconds, 1, continuous=True),
    # Claims media jobs whose worker slots fit and starts their workers (functions/media_submit): in
    # AWS Batch jobs, each run claiming until nothing more fits; locally worker subprocesses.
    Schedule(MEDIA_DISPATCH, "media_submit", lambda c: c.media.dispatch_seconds, 1),
    *(_maintenance(s) for s in room.SERVICES),
)


# A terminal task released its reservations in the transaction that wrote its event: the tick may
# claim the next task on the freed capacity. (A requeue writes TaskQueued, whose consumer, the queue
# indexer, wakes the tick once the tenant is on its ring.)
WAKES: tuple[Wake, ...] = (
    Wake("TaskSucceeded", TICK),
    Wake("TaskFailed", TICK),
    Wake("TaskCancelled", TICK),
    Wake("TaskMediaIngestFailed", TICK),
)


def schedule(name: str) -> Schedule:
    for s in SCHEDULES:
        if s.name == name:
            return s
    raise KeyError(f"no schedule {name!r} in aivedio.events_routing.SCHEDULES")


def woken_by(event_types) -> list[str]:
    """The loops to wake once events of these types were published, in table order, once each."""
    types = set(event_types)
    return list(dict.fromkeys(w.loop for w in WAKES if w.event_type in types))


def consumers() -> dict[str, tuple[str, ...]]:
    """Consuming function -> the event types it receives, in table order."""
    out: dict[str, list[str]] = {}
    for s in SUBSCRIPTIONS:
        out.setdefault(s.consumer, []).append(s.event_type)
    return {k: tuple(v) for k, v in out.items()}


def queue_consumers() -> dict[str, tuple[str, ...]]:
    """Every function that consumes an SQS queue of its own -> what feeds it: the outbox event types
    it receives, or the AwsEvents names (AWS only)."""
    return {**consumers(), **{e.consumer: (e.name,) for e in AWS_EVENTS}}


def check() -> None:
    """The table's own rules; the CDK app and the tests call it."""
    outbox_consumers = {s.consumer for s in SUBSCRIPTIONS}
    for e in AWS_EVENTS:
        if e.consumer in outbox_consumers:
            raise ValueError(f"{e.consumer} consumes outbox events and AWS events {e.name!r}: one queue, one feed")
    if len({e.consumer for e in AWS_EVENTS}) != len(AWS_EVENTS):
        raise ValueError("two AwsEvents entries share a consumer")
    seen: dict[str, str] = {}
    for s in SUBSCRIPTIONS:
        if s.event_type in seen and seen[s.event_type] != s.consumer:
            raise ValueError(f"event type {s.event_type!r} has two consumers ({seen[s.event_type]}, {s.consumer}); "
                             "the outbox relay sends an event to one queue")
        seen[s.event_type] = s.consumer
    names = [s.name for s in SCHEDULES]
    if len(names) + len(AWS_EVENTS) != len(set(names) | {e.name for e in AWS_EVENTS}):
        raise ValueError("two schedules or AWS event rules share a name")
    for s in SCHEDULES:
        if s.aws_every_minutes < 1:
            raise ValueError(f"schedule {s.name}: EventBridge rates are whole minutes")
        if s.continuous and s.aws_every_minutes != 1:
            raise ValueError(f"schedule {s.name}: a continuous schedule starts a run every minute")
    for w in WAKES:
        if w.loop not in names:
            raise ValueError(f"wake {w.event_type} -> {w.loop!r}: no such schedule")
