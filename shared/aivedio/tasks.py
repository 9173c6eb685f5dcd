"""The task state machine: a table of legal transitions, and CAS writes on (state, version); and
the states of a task's attempts.
Terminal states never change. MEDIA_INGEST_FAILED is terminal: the media pipeline
(aivedio.media.pipeline) retries a failed worker within the output version's own budget
(media_job.tries) while the task stays MEDIA_PROCESSING, and ends the task there only once that is
spent or the media itself is bad."""
from __future__ import annotations

from datetime import datetime
from uuid import UUID

import psycopg

STATES = (
    "QUEUED", "DISPATCHING", "SUBMITTED", "RUNNING", "SUBMIT_UNKNOWN", "CANCEL_REQUESTED",
    "PROVIDER_SUCCEEDED", "MEDIA_PROCESSING", "SUCCEEDED", "FAILED", "CANCELLED",
    "MEDIA_INGEST_FAILED", "MANUAL_REVIEW",
)
TERMINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "MEDIA_INGEST_FAILED"})

# task_attempt.state: an attempt is live (its workflow may still act at the provider) until it
# reaches one of ATTEMPT_FINAL (aivedio.attempts.lifecycle writes both).
ATTEMPT_LIVE = ("DISPATCHING", "SUBMITTED", "RUNNING", "SUBMIT_UNKNOWN")
ATTEMPT_FINAL = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "REJECTED", "NOT_ACCEPTED", "ABSENT_CONFIRMED",
                           "MANUAL_REVIEW"})

TRANSITIONS: dict[str, frozenset[str]] = {
    "QUEUED": frozenset({"DISPATCHING", "CANCELLED", "FAILED"}),
    # PROVIDER_SUCCEEDED: a job can finish before the submit's answer is processed (the callback
    # raced it), and the report is applied whatever the order.
    "DISPATCHING": frozenset({"SUBMITTED", "RUNNING", "SUBMIT_UNKNOWN", "QUEUED", "FAILED", "CANCEL_REQUESTED",
                              "PROVIDER_SUCCEEDED", "MANUAL_REVIEW"}),
    "SUBMITTED": frozenset({"RUNNING", "PROVIDER_SUCCEEDED", "FAILED", "CANCEL_REQUESTED", "CANCELLED", "MANUAL_REVIEW"}),
    "RUNNING": frozenset({"PROVIDER_SUCCEEDED", "FAILED", "CANCEL_REQUESTED", "CANCELLED", "MANUAL_REVIEW"}),
    "SUBMIT_UNKNOWN": frozenset({"SUBMITTED", "RUNNING", "PROVIDER_SUCCEEDED", "FAILED", "QUEUED", "CANCEL_REQUESTED", "MANUAL_REVIEW"}),
    # MEDIA_PROCESSING: a cancel that reached a task whose media worker runs; the provider's job is
    # done, so the cancel keeps its result and the media step goes on (aivedio.media.pipeline).
    "CANCEL_REQUESTED": frozenset({"CANCELLED", "PROVIDER_SUCCEEDED", "MEDIA_PROCESSING", "FAILED", "MANUAL_REVIEW"}),
    # A cancel after the provider succeeded, or during review, is recorded as CANCEL_REQUESTED: the
    # attempt workflow then asks the provider and follows its answer (a finished job keeps its
    # result), or hands the task back to review when it cannot decide (aivedio.admission.cancel).
    "PROVIDER_SUCCEEDED": frozenset({"MEDIA_PROCESSING", "SUCCEEDED", "MEDIA_INGEST_FAILED", "CANCEL_REQUESTED"}),
    "MEDIA_PROCESSING": frozenset({"SUCCEEDED", "MEDIA_INGEST_FAILED", "CANCEL_REQUESTED"}),
    # Out of review (aivedio.attempts.review): a job adopted goes to what it proves (SUBMITTED while
    # still queued at the provider), a requeue to QUEUED, a fail to FAILED.
    "MANUAL_REVIEW": frozenset({"QUEUED", "SUBMITTED", "RUNNING", "PROVIDER_SUCCEEDED", "FAILED", "CANCELLED",
                                "CANCEL_REQUESTED"}),
    "SUCCEEDED": frozenset(),
    "FAILED": frozenset(),
    "CANCELLED": frozenset(),
    "MEDIA_INGEST_FAILED": frozenset(),
}


def sql_list(states) -> str:
    """States as SQL literals ('A', 'B'), for a statement whose predicate must imply a partial index's
    (a parameter would not let the planner prove it); from the sets above, never typed out."""
    return ", ".join(f"'{s}'" for s in sorted(states))


class IllegalTransition(Exception):
    pass


def is_terminal(state: str) -> bool:
    return state in TERMINAL


def cas_transition(
    conn: psycopg.Connection,
    *,
    tenant_id: UUID,
    task_id: UUID,
    from_state: str,
    version: int,
    to_state: str,
    now: datetime,
    **fields: object,
) -> dict | None:
    """Move a task from (from_state, version) to to_state. Returns the new row, or None when the
    task has moved on (another writer won): the caller decides what that means."""
    if to_state not in TRANSITIONS[from_state]:
        raise IllegalTransition(f"{from_state} -> {to_state}")
    sets = "".join(f", {k} = %({k})s" for k in fields)
    return conn.execute(
        f"""update generation_task set state = %(to)s, version = version + 1, updated_at = %(now)s{sets}
             where tenant_id = %(tenant_id)s and task_id = %(task_id)s and state = %(from)s and version = %(version)s
             returning *""",
        {"to": to_state, "now": now, "tenant_id": tenant_id, "task_id": task_id, "from": from_state, "version": version, **fields},
    ).fetchone()
