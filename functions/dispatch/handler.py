"""Dispatch: consumes TaskDispatchRequested (at least once, SQS with partial batch failures) and
starts the attempt's workflow, named after the attempt, so a repeated message starts nothing new.
The workflow's first step checks that the attempt is still current before anything is sent."""
from __future__ import annotations

import json

from aws_lambda_powertools.utilities.batch import BatchProcessor, EventType, process_partial_response
from aws_lambda_powertools.utilities.data_classes.sqs_event import SQSRecord

from aivedio.attempts import executions
from aivedio.attempts.lifecycle import AttemptRef
from aivedio.context import get_platform
from aivedio.observability import logger

processor = BatchProcessor(event_type=EventType.SQS)


def record_handler(record: SQSRecord) -> None:
    payload = json.loads(record.body)["payload"]
    executions.start(get_platform(), AttemptRef.of(payload))


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    return process_partial_response(event=event, record_handler=record_handler, processor=processor, context=context)
