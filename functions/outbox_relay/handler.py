"""The outbox relay Lambda, run on an EventBridge schedule (locally by the `outbox-relay` loop).

In AWS each event goes to the SQS queue configured for its type (AIVEDIO_EVENT_QUEUES, with "*" as
a catch-all). The local runtime puts an in-process deliver() in platform.extras instead."""
from __future__ import annotations

import json
from functools import cache
from typing import Any

from aivedio.context import get_platform
from aivedio.metrics_catalog import OUTBOX_BACKLOG
from aivedio.observability import due, logger, publish
from aivedio.outbox import Deliver, backlog, relay_once

BATCH = 100
BACKLOG_EVERY_SECONDS = 60.0  # the backlog gauge costs a count: once a minute per process
RESERVE_MILLIS = 5_000  # stop starting batches this close to the timeout, so none is cut short


@cache
def _sqs():
    import boto3

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
    published = 0
    while True:
        n = relay_once(platform, deliver, batch=BATCH)
        published += n
        if n < BATCH or context.get_remaining_time_in_millis() < RESERVE_MILLIS:
            if due("outbox-backlog", BACKLOG_EVERY_SECONDS):
                with platform.db.connection() as conn:
                    publish(OUTBOX_BACKLOG, backlog(conn))
            return {"published": published}
