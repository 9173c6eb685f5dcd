"""Dead letters, for an operator (docs/operations.md): outbox events that failed every delivery,
and the SQS dead-letter queues in AWS. Each operation that changes something appends its audit rows
in the caller's transaction; redrive_queue, whose change is in AWS, in transactions of its own around
it. Who may call them is the edge's business: an admin API route checks the permission named
below (aivedio.policy.roles; queue.redrive has no route, it is the CLI's), and the CLI is trusted.

- list_outbox (outbox.read): the events of one status, FAILED by default, oldest first;
- redrive_outbox (outbox.redrive): FAILED events back to PENDING with their attempts reset, due now
  (aivedio.outbox.redrive), one audit row per event with its last error and the reason;
- redrive_queue (queue.redrive): an SQS DLQ's messages back to the queue they came from, with
  StartMessageMoveTask from the DLQ's ARN to its source's, audited before the move starts (the
  audit row commits first; a second one records the task handle, or the error). The DLQ is the one the source queue's
  RedrivePolicy names (infra_cdk/messaging.py, after MAX_RECEIVES receives), so either queue's name
  or URL may be given. An operator command: it runs with the operator's AWS credentials, and no
  Lambda is granted anything for it.

Neither redrive is automatic: a message that fails every time would only go round again. The
settlement it carried is not waiting for it: `unsettled-terminals` settles the task from PostgreSQL."""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg

from aivedio import audit, outbox
from aivedio.errors import DomainError, InvalidRequest, NotFound

MAX_LIST = 1000


def _jsonable(row: dict) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, (UUID, datetime)) else v) for k, v in row.items()}


def list_outbox(conn: psycopg.Connection, *, operator: str, status: str = outbox.FAILED, event_type: str | None = None,
                tenant_id: UUID | None = None, limit: int = 100) -> dict[str, Any]:
    if status not in (outbox.PENDING, outbox.PUBLISHED, outbox.FAILED):
        raise InvalidRequest("unknown status", {"status": "one of PENDING, PUBLISHED, FAILED"})
    if not 1 <= limit <= MAX_LIST:
        raise InvalidRequest("limit out of range", {"limit": f"1 to {MAX_LIST}"})
    rows = outbox.list_events(conn, status=status, event_type=event_type, tenant_id=tenant_id, limit=limit)
    return {"status": status, "dead_letters": outbox.dead_letter_count(conn), "count": len(rows),
            "events": [_jsonable(r) for r in rows]}


def redrive_outbox(conn: psycopg.Connection, *, operator: str, reason: str, event_ids: list[UUID] | None = None,
                   all_failed: bool = False, event_type: str | None = None) -> dict[str, Any]:
    """Redrive the given FAILED events, or with all_failed every FAILED one (of event_type). An id
    that is not a FAILED event is reported in `not_failed` and left alone."""
    if not reason or not reason.strip():
        raise InvalidRequest("a reason is required", {"reason": "why these events are redriven"})
    if bool(event_ids) == all_failed:
        raise InvalidRequest("name the events or all of them", {"event_id": "one or more, or --all-failed"})
    if event_ids and event_type:
        raise InvalidRequest("--event-type selects among --all-failed", {"event_type": "only with --all-failed"})
    rows = outbox.redrive(conn, event_ids=list(event_ids) if event_ids else None, event_type=event_type)
    for r in rows:
        audit.append(conn, operator=operator, action="outbox.redrive", target=f"outbox_event:{r['event_id']}",
                     tenant_id=r["tenant_id"], old={"status": outbox.FAILED, "attempts": r["attempts_before"],
                                                    "last_error": r["last_error"]},
                     new={"status": outbox.PENDING, "attempts": 0, "event_type": r["event_type"]}, reason=reason)
    done = {r["event_id"] for r in rows}
    return {"redriven": len(rows), "events": [{"event_id": str(r["event_id"]), "event_type": r["event_type"],
                                               "aggregate_id": str(r["aggregate_id"]) if r["aggregate_id"] else None,
                                               "attempts_before": r["attempts_before"]} for r in rows],
            "not_failed": [str(i) for i in (event_ids or []) if i not in done]}


# --- SQS dead-letter queues ---------------------------------------------------------------------------

def _queue_url(sqs, queue: str) -> str:
    if queue.startswith("https://") or queue.startswith("http://"):
        return queue
    try:
        return sqs.get_queue_url(QueueName=queue)["QueueUrl"]
    except sqs.exceptions.QueueDoesNotExist:
        raise NotFound(f"no queue {queue!r}", code="QUEUE_NOT_FOUND", details={"queue": queue}) from None


def move_request(sqs, queue: str, *, max_per_second: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The StartMessageMoveTask request that empties `queue`'s DLQ into `queue` (or, given the DLQ,
    into its one source), and what it found: (request, {source, dlq, messages})."""
    url = _queue_url(sqs, queue)
    attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn", "RedrivePolicy"])["Attributes"]
    if "RedrivePolicy" in attrs:
        source_arn, dlq_arn = attrs["QueueArn"], json.loads(attrs["RedrivePolicy"])["deadLetterTargetArn"]
        dlq_url = sqs.get_queue_url(QueueName=dlq_arn.rsplit(":", 1)[1])["QueueUrl"]
    else:
        sources = sqs.list_dead_letter_source_queues(QueueUrl=url).get("queueUrls", [])
        if len(sources) != 1:
            raise InvalidRequest("not a queue with a dead-letter queue, nor the DLQ of exactly one queue",
                                 {"queue": f"{queue}: {len(sources)} source queues"}, code="NO_DEAD_LETTER_QUEUE")
        dlq_arn, dlq_url = attrs["QueueArn"], url
        source_arn = sqs.get_queue_attributes(QueueUrl=sources[0], AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    waiting = int(sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["ApproximateNumberOfMessages"])
                  ["Attributes"].get("ApproximateNumberOfMessages", 0))
    request: dict[str, Any] = {"SourceArn": dlq_arn, "DestinationArn": source_arn}
    if max_per_second is not None:
        request["MaxNumberOfMessagesPerSecond"] = max_per_second
    return request, {"source": source_arn, "dlq": dlq_arn, "messages": waiting}


def redrive_queue(platform, sqs, *, operator: str, queue: str, reason: str | None = None,
                  max_per_second: int | None = None) -> dict[str, Any]:
    """Start moving a DLQ's messages back to their queue. The move is audited BEFORE it starts: the audit row (the DLQ's and the
    source's ARNs, the reason) commits in its own transaction, then StartMessageMoveTask is called,
    and a second row records its outcome (the task handle SQS returns, or the error). A move is
    never made unaudited; if SQS refuses, the refusal is audited too and reported as
    QUEUE_MOVE_FAILED. Its own transactions: it takes the platform, not a connection."""
    from botocore.exceptions import BotoCoreError, ClientError  # lazy: boto3's, imported only where AWS is asked

    def intent(conn: psycopg.Connection) -> tuple[dict[str, Any], dict[str, Any]]:
        if max_per_second is not None and not 1 <= max_per_second <= 500:
            raise InvalidRequest("max messages per second out of range", {"max_per_second": "1 to 500 (SQS's limit)"})
        request, found = move_request(sqs, queue, max_per_second=max_per_second)
        audit.append(conn, operator=operator, action="queue.redrive", target=f"sqs:{found['dlq']}",
                     new={**found, "max_per_second": max_per_second, "status": "REQUESTED"}, reason=reason)
        return request, found

    request, found = platform.db.transaction(intent)
    doc = {**found, "max_per_second": max_per_second}
    try:
        started = sqs.start_message_move_task(**request)
    except (ClientError, BotoCoreError) as e:
        error = str(e).splitlines()[0][:500]
        platform.db.transaction(lambda conn: audit.append(
            conn, operator=operator, action="queue.redrive", target=f"sqs:{found['dlq']}",
            new={**doc, "status": "FAILED", "error": error}, reason=reason))
        raise DomainError("SQS did not start the message move", code="QUEUE_MOVE_FAILED",
                          details={**doc, "error": error}) from e
    doc["task_handle"] = started.get("TaskHandle")
    platform.db.transaction(lambda conn: audit.append(
        conn, operator=operator, action="queue.redrive", target=f"sqs:{found['dlq']}",
        new={**doc, "status": "STARTED"}, reason=reason))
    return doc
