"""The queue indexer: consumes TaskQueued from SQS (partial batch failures) and puts the tenant on
its lane's ring in Redis. Losing an update is harmless: the rebuilder re-adds from PostgreSQL."""
from __future__ import annotations

import json
from uuid import UUID

from aws_lambda_powertools.utilities.batch import BatchProcessor, EventType, process_partial_response
from aws_lambda_powertools.utilities.data_classes.sqs_event import SQSRecord

from aivedio.context import get_platform
from aivedio.observability import logger
from aivedio.scheduling.ring import Ring

processor = BatchProcessor(event_type=EventType.SQS)


def record_handler(record: SQSRecord) -> None:
    envelope = json.loads(record.body)
    payload = envelope["payload"]
    platform = get_platform()
    Ring(platform).add(payload["queue_class"], UUID(payload["tenant_id"]))
    platform.wake("scheduler-tick")


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    return process_partial_response(event=event, record_handler=record_handler, processor=processor, context=context)
