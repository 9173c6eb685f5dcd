"""The outbox relay Lambda, a continuous schedule (aivedio.events_routing): in AWS each run keeps
relaying until near its timeout, polling every `timers.outbox_relay_seconds` while idle and at
once when a writer wakes it (aivedio.wakeups); a new run starts every minute and two overlap, so one
is always relaying. Locally the `outbox-relay` loop calls it at the same interval.

Events come in chains: a TaskQueued is followed within milliseconds by its claim's
TaskDispatchRequested, a terminal event by the next claim on the freed slot, written by processes
that may not be able to wake the relay. So after a pass that published, the relay polls every
RELAY_HOT_POLL_SECONDS for RELAY_HOT_SECONDS (aivedio.outbox, in both runtimes) before it goes back
to its idle interval.

In AWS each event goes to the SQS queue configured for its type (AIVEDIO_EVENT_QUEUES, with "*" as
a catch-all). The local runtime puts an in-process deliver() in platform.extras instead. Once a
batch is out, the loops its event types wake are woken (events_routing.WAKES: a terminal task freed
capacity, so the scheduler tick runs now)."""
from __future__ import annotations

import json
import time
from functools import cache
from typing import Any

from aivedio import events_routing
from aivedio.context import get_platform
from aivedio.metrics_catalog import OUTBOX_BACKLOG
from aivedio.observability import due, logger, publish
from aivedio.outbox import RELAY_HOT_POLL_SECONDS, RELAY_HOT_SECONDS, Deliver, backlog, relay_once
from aivedio.wakeups import ContinuousRun

BATCH = 100
BACKLOG_EVERY_SECONDS = 60.0  # the backlog gauge costs a count: once a minute per process
RESERVE_MILLIS = 5_000  # stop starting batches this close to the timeout, so none is cut short


@cache
def _sqs():
    import boto3  # lazy: boto3 takes most of a second to import; only the AWS bus needs it

    return boto3.client("sqs")


class NoQueueForEvent(LookupError):
    """No queue is configured for this event type; the relay retries, then marks it FAILED."""


def sqs_deliver(queue_urls: dict[str, str]) -> Deliver:
    def deliver(envelope: dict[str, Any]) -> None:
        url = queue_urls.get(envelope["event_type"]) or queue_urls.get("*")
        if url is None:
            raise NoQueueForEvent(f"no queue for event type {envelope['event_type']!r} in AIVEDIO_EVENT_QUEUES")
        _sqs().send_message(
            QueueUrl=url,
            MessageBody=json.dumps(envelope),
            MessageAttributes={"event_type": {"DataType": "String", "StringValue": envelope["event_type"]}},
        )

    return deliver


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    platform = get_platform()
    deliver = platform.extras.get("outbox_deliver") or sqs_deliver(platform.settings.event_queue_urls)
    run = ContinuousRun(platform, events_routing.RELAY, context, reserve_millis=RESERVE_MILLIS)
    published, hot_until = 0, 0.0
    while True:
        types: set[str] = set()
        n = relay_once(platform, deliver, batch=BATCH, published_types=types)
        published += n
        for loop in events_routing.woken_by(types):
            platform.wake(loop)
        if due("outbox-backlog", BACKLOG_EVERY_SECONDS):
            with platform.db.connection() as conn:
                publish(OUTBOX_BACKLOG, backlog(conn))
        if n == BATCH and run.seconds_left() > 0:
            continue  # a full batch: more are due now
        if n:
            hot_until = time.monotonic() + RELAY_HOT_SECONDS
        if time.monotonic() < hot_until and run.seconds_left() > 0:
            run.pause(RELAY_HOT_POLL_SECONDS)  # what this batch causes is usually written within milliseconds
            continue
        if not run.idle():
            return {"published": published}
