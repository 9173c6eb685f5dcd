"""Settlement: consumes TaskSucceeded, TaskFailed and TaskCancelled (at least once, SQS with partial
batch failures; locally the outbox relay delivers them) with aivedio.billing.settlement. A
redelivered message is acknowledged without a second effect; input that cannot be applied is
parked for reconciliation and acknowledged; only a failure (the database unreachable, say) reports
the record as failed, so SQS delivers it again and then to the DLQ.

The batch is first settled in ONE transaction (settle_many: a handful of set-based statements for
all of it). If that fails, nothing of it was written, and each record is settled on its own under
Powertools' partial-batch processing, so one bad record fails alone."""
from __future__ import annotations

from aws_lambda_powertools.utilities.batch import BatchProcessor, EventType, process_partial_response
from aws_lambda_powertools.utilities.data_classes.sqs_event import SQSRecord
from pydantic import ValidationError

from aivedio.billing.settlement import Terminal, settle, settle_many
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


def _settle_batch(records: list[dict]) -> bool:
    """Settle every record in one transaction; False (and nothing written) when any part fails."""
    try:
        envelopes = [EventEnvelope.model_validate_json(r["body"]) for r in records]
    except (ValidationError, KeyError, TypeError):
        return False  # one by one: the bad record fails alone
    platform = get_platform()
    try:
        with platform.db.connection() as conn:
            results = settle_many(conn, [Terminal(e.payload, e.event_type, e.event_id) for e in envelopes], platform.clock.now())
    except Exception:
        logger.warning("settlement batch failed; settling its records one by one", exc_info=True,
                       extra={"records": len(records)})
        return False
    logger.debug("settlement batch", extra={"records": len(records), "outcomes": [r.outcome for r in results]})
    return True


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    records = event.get("Records") or []
    if len(records) > 1 and _settle_batch(records):
        return {"batchItemFailures": []}
    return process_partial_response(event=event, record_handler=record_handler, processor=processor, context=context)
