"""Queues and schedules, from the one routing table (aivedio.events_routing) the local runtime reads:

- one SQS queue per consuming function, with its DLQ (after MAX_RECEIVES failed receives), fed
  by the outbox relay for each event type the function subscribes to; the consumer may consume
  from its queue and nothing else, and reports partial batch failures. A DLQ keeps its messages
  DLQ_RETENTION_DAYS, alarms as soon as it holds one (infra_cdk/observability.py), and is emptied
  back into its queue by an operator, `aivedio admin queue redrive --queue <queue name>` (SQS
  StartMessageMoveTask with the operator's credentials: no function is granted anything for it).
  A settlement that waits there is not lost meanwhile: `unsettled-terminals` settles its task
  from PostgreSQL;
- one SQS queue, with its DLQ, per consumer of AWS events (events_routing.AWS_EVENTS: Batch job
  state changes), the same in every respect but that an EventBridge rule feeds it (the module
  that owns those AWS resources adds the rule: infra_cdk/media.py) and the relay never sends there;
- a catch-all queue ("*") for event types no function consumes yet: the relay publishes them
  there instead of failing them, nobody consumes it, and messages expire after a day or a few;
- one EventBridge schedule per entry of SCHEDULES, invoking the function asynchronously with no
  retries and a one-minute maximum event age (the next tick replaces a lost one). A continuous
  schedule (the relay, the tick) must have a function whose run outlasts the schedule period
  (timeout >= CONTINUOUS_PERIODS periods: its handler polls until near the timeout) and room for
  two runs at once (reserved concurrency, where the stage reserves any, >= CONTINUOUS_RUNS): a run
  starts every minute while the last still polls, so one is always in progress."""
from __future__ import annotations

import json

from aws_cdk import Duration, Stack
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_lambda_event_sources as sources
from aws_cdk import aws_sqs as sqs
from constructs import Construct

from aivedio import events_routing
from infra_cdk.functions import Functions
from infra_cdk.nag import suppress
from infra_cdk.stages import StageConfig

MAX_RECEIVES = 5
DLQ_RETENTION_DAYS = 14  # SQS's longest: time to fix the cause and redrive
BATCH_SIZE = 10
VISIBILITY_TIMEOUT_FACTOR = 6  # AWS's advice for SQS event sources: 6 x the function timeout
CONTINUOUS_PERIODS = 2  # a continuous schedule's function timeout, in schedule periods
CONTINUOUS_RUNS = 2  # the runs of a continuous schedule that overlap


def _queue(scope: Construct, cid: str, *, name: str, retention_days: int, visibility: Duration | None = None,
           dlq: sqs.IQueue | None = None) -> sqs.Queue:
    return sqs.Queue(
        scope, cid, queue_name=name, encryption=sqs.QueueEncryption.SQS_MANAGED, enforce_ssl=True,
        retention_period=Duration.days(retention_days), visibility_timeout=visibility,
        dead_letter_queue=sqs.DeadLetterQueue(queue=dlq, max_receive_count=MAX_RECEIVES) if dlq else None,
    )


class Messaging(Construct):
    def __init__(self, scope: Construct, cid: str, *, stage: StageConfig, functions: Functions) -> None:
        super().__init__(scope, cid)
        events_routing.check()
        self.queues: dict[str, sqs.Queue] = {}  # consumer -> queue
        self.dlqs: dict[str, sqs.Queue] = {}
        queue_urls: dict[str, str] = {}
        outbox_consumers = events_routing.consumers()
        for consumer, event_types in events_routing.queue_consumers().items():
            fn = functions[consumer]
            dlq = _queue(self, f"{consumer}-dlq", name=f"{stage.prefix}-{consumer}-dlq", retention_days=DLQ_RETENTION_DAYS)
            queue = _queue(self, consumer, name=f"{stage.prefix}-{consumer}", retention_days=stage.queue_retention_days,
                           visibility=Duration.seconds(fn.profile.timeout_seconds * VISIBILITY_TIMEOUT_FACTOR), dlq=dlq)
            # Grants the consumer ReceiveMessage/DeleteMessage/ChangeMessageVisibility/GetQueue* on
            # this queue only.
            fn.function.add_event_source(sources.SqsEventSource(
                queue, batch_size=BATCH_SIZE, report_batch_item_failures=True,
                max_concurrency=max(2, stage.consumer_max_concurrency)))
            self.queues[consumer], self.dlqs[consumer] = queue, dlq
            for event_type in event_types if consumer in outbox_consumers else ():
                queue_urls[event_type] = queue.queue_url

        self.unrouted = _queue(self, "unrouted", name=f"{stage.prefix}-unrouted",
                               retention_days=stage.unrouted_retention_days)
        suppress(self.unrouted, ("AwsSolutions-SQS3", "The catch-all queue has no consumer, so nothing ever fails on "
                                                      "it; its messages simply expire (parity with local delivery to "
                                                      "no consumer)."))
        queue_urls["*"] = self.unrouted.queue_url
        for fn in functions:
            if fn.profile.publishes_events:
                fn.add_environment("AIVEDIO_EVENT_QUEUES", _json(self, queue_urls))
                for queue in [*(self.queues[c] for c in outbox_consumers), self.unrouted]:
                    queue.grant_send_messages(fn.role)

        self.rules: dict[str, events.Rule] = {}
        configured: set[str] = set()
        for s in events_routing.SCHEDULES:
            fn = functions[s.function]
            if s.continuous:
                _check_continuous(s, fn, stage)
            if s.function not in configured:  # once per function: the maintenance Lambda runs several schedules
                fn.function.configure_async_invoke(retry_attempts=0, max_event_age=Duration.minutes(1))
                configured.add(s.function)
            rule = events.Rule(self, f"schedule-{s.name}", rule_name=f"{stage.prefix}-{s.name}",
                               description=f"invokes {fn.function.function_name} ({s.name})",
                               schedule=events.Schedule.rate(Duration.minutes(s.aws_every_minutes)))
            rule.add_target(targets.LambdaFunction(
                fn.function, retry_attempts=0, max_event_age=Duration.minutes(1),
                # A maintenance service's schedule names the service (functions/maintenance reads it).
                event=events.RuleTargetInput.from_object(s.payload) if s.payload is not None else None))
            self.rules[s.name] = rule


def _check_continuous(s: events_routing.Schedule, fn, stage: StageConfig) -> None:
    period = 60 * s.aws_every_minutes
    if fn.profile.timeout_seconds < CONTINUOUS_PERIODS * period:
        raise SystemExit(f"schedule {s.name} is continuous: {s.function}'s timeout ({fn.profile.timeout_seconds}s) must be at "
                         f"least {CONTINUOUS_PERIODS * period}s, so each run polls past the next one's start "
                         "(infra_cdk/functions.py PROFILES)")
    reserved = stage.reserved_concurrency.get(s.function)
    if reserved is not None and reserved < CONTINUOUS_RUNS:
        raise SystemExit(f"schedule {s.name} is continuous: stage {stage.name} reserves {reserved} concurrency for "
                         f"{s.function}; two runs overlap, so it needs at least {CONTINUOUS_RUNS} (infra_cdk/stages.py)")


def _json(scope: Construct, value: dict[str, str]) -> str:
    """JSON whose values are CDK tokens (queue URLs), rendered by CloudFormation at deploy time."""
    return Stack.of(scope).to_json_string(value)
