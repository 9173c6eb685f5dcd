"""Settlement: consumes TaskSucceeded, TaskFailed and TaskCancelled (at least once, SQS with partial
batch failures; locally the outbox relay delivers them) and settles each in one transaction with
aivedio.billing.settlement. A redelivered message is acknowledged without a second effect; input
that cannot be applied is parked for reconciliation and acknowledged; only a failure (the database
unreachable, say) reports the record as failed, so SQS delivers it again and then to the DLQ."""
from __future__ import annotations

from aws_lambda_powertools.utilities.batch import BatchProcessor, EventType, process_partial_response
from aws_lambda_powertools.utilities.data_classes.sqs_event import SQSRecord

from aivedio.billing.settlement import settle
from aivedio.context import get_platform
from aivedio.events import EventEnvelope
from aivedio.observability import logger

processor = BatchProcessor(event_type=EventType.SQS)


def record_handler(record: SQSRecord) -> None:
    envelope = EventEnvelope.model_validate_json(record.body)
    platform = get_platform()
    with platform.db.connection() as conn:
        result = settle(conn, envelope.payload, platform.clock.now(), event_type=envelope.event_type,
                        event_id=envelope.event_id)
    logger.debug("settlement", extra={"event_id": str(envelope.event_id), "outcome": result.outcome,
                                      "task_id": str(result.task_id) if result.task_id else None})


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    return process_partial_response(event=event, record_handler=record_handler, processor=processor, context=context)
