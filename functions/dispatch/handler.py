"""Dispatch: consumes TaskDispatchRequested (at least once, SQS with partial batch failures) and
starts the attempt's workflow, named after the attempt, so a repeated message starts nothing new.
The workflow's first step checks that the attempt is still current before anything is sent."""
from __future__ import annotations

import json

from aws_lambda_powertools.utilities.batch import BatchProcessor, EventType, process_partial_response
from aws_lambda_powertools.utilities.data_classes.sqs_event import SQSRecord

from aivedio.attempts import executions
from aivedio.attempts.lifecycle import AttemptRef
from aivedio.config import settings_from_env
from aivedio.context import get_platform
from aivedio.observability import logger

processor = BatchProcessor(event_type=EventType.SQS)


_settings = settings_from_env()
_extras: dict = {}


def record_handler(record: SQSRecord) -> None:
    ref = AttemptRef.of(json.loads(record.body)["payload"])
    if _settings.attempt_state_machine_arn:  # AWS: Step Functions; no database connection needed
        executions.start_with(_settings, _extras, ref)
    else:  # locally: the workflow runner of the platform this process serves
        executions.start(get_platform(), ref)


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    return process_partial_response(event=event, record_handler=record_handler, processor=processor, context=context)
