"""Cancel (ch. 20.4.3): before dispatch it is a CAS from QUEUED to CANCELLED with a RELEASE of the
reservation in the same transaction. After dispatch it becomes CANCEL_REQUESTED, and the attempt
lifecycle asks the provider; the outcome follows the provider's stage.

That holds for every state that is not terminal, PROVIDER_SUCCEEDED, MEDIA_PROCESSING and
MANUAL_REVIEW included: the answer is 202 CANCEL_REQUESTED. A job the provider already finished
keeps its result, and the task succeeds and is charged as its charge policy says for a success; a
task in review goes through the same cancel path (aivedio.attempts.lifecycle.reopen_for_cancel),
which cancels it at the provider when it can and gives it back to review when it cannot decide.
Only a terminal task answers TASK_TERMINAL: SUCCEEDED, FAILED, CANCELLED, and MEDIA_INGEST_FAILED
(the media pipeline retries within the output version's own budget while the task stays
MEDIA_PROCESSING, and ends it there only once that is spent: aivedio.media.pipeline). A cancel
during the media step keeps the provider's result: the media step goes on and decides the end."""
from __future__ import annotations

from uuid import UUID

from aivedio import outbox, tasks
from aivedio.admission.decisions import Rejected
from aivedio.admission.rate_limits import take
from aivedio.attempts.lifecycle import reopen_for_cancel
from aivedio.auth import Caller
from aivedio.billing.ledger import lock_wallet
from aivedio.billing.reservations import release_remaining
from aivedio.errors import Conflict, DomainError, NotFound
from aivedio.observability import logger


class TaskTerminal(DomainError):
    code = "TASK_TERMINAL"


def cancel(platform, caller: Caller, task_id: UUID) -> dict:
    with platform.db.connection() as conn:
        policy = conn.execute("select cancel_rate_per_minute from tenant_scheduling_policy where tenant_id = %s",
                              (caller.tenant_id,)).fetchone()
    r = take(platform, f"tenant:{caller.tenant_id}:cancel", policy["cancel_rate_per_minute"], slot=str(caller.tenant_id))
    if not r.allowed:
        raise Rejected("REJECT_CANCEL_RATE_LIMIT", "cancel rate exceeded", r.retry_after_seconds)

    def tx(conn) -> dict:
        now = platform.clock.now()
        wallet = lock_wallet(conn, caller.tenant_id)  # lock order: wallet, then task, as admission does
        task = conn.execute("select * from generation_task where tenant_id = %s and task_id = %s for update",
                            (caller.tenant_id, task_id)).fetchone()
        if task is None:
            raise NotFound("no such task")
        state = task["state"]
        if tasks.is_terminal(state):
            raise TaskTerminal(f"task is already {state}", details={"state": state})
        if state == "CANCEL_REQUESTED":
            return {"task_id": str(task_id), "state": state}
        if state == "QUEUED":
            row = tasks.cas_transition(conn, tenant_id=caller.tenant_id, task_id=task_id, from_state="QUEUED",
                                       version=task["version"], to_state="CANCELLED", now=now, finished_at=now,
                                       error_code="CANCELLED_BY_USER")
            if row is None:
                raise Conflict("task changed concurrently; retry")
            release_remaining(conn, wallet=wallet, task_id=task_id, reason_code="CANCELLED_BEFORE_DISPATCH")
            outbox.write_event(conn, "TaskCancelled", aggregate_type="generation_task", aggregate_id=task_id,
                               tenant_id=caller.tenant_id, payload={"task_id": str(task_id), "stage": "BEFORE_DISPATCH"})
            logger.info("task cancelled before dispatch", extra={"tenant_id": str(caller.tenant_id), "task_id": str(task_id)})
            return {"task_id": str(task_id), "state": "CANCELLED"}
        if "CANCEL_REQUESTED" not in tasks.TRANSITIONS[state]:
            raise TaskTerminal(f"task in {state} can no longer be cancelled", details={"state": state})
        row = tasks.cas_transition(conn, tenant_id=caller.tenant_id, task_id=task_id, from_state=state,
                                   version=task["version"], to_state="CANCEL_REQUESTED", now=now,
                                   cancel_requested_at=task["cancel_requested_at"] or now)
        if row is None:
            raise Conflict("task changed concurrently; retry")
        attempt = conn.execute("select * from task_attempt where tenant_id = %s and attempt_id = %s and fencing_token = %s",
                               (caller.tenant_id, task["current_attempt_id"], task["current_fencing_token"])).fetchone()
        if attempt is not None:
            reopen_for_cancel(conn, row, attempt, now)  # a workflow that has ended is started again
        else:
            logger.error("cancel requested for a task without a current attempt",
                         extra={"tenant_id": str(caller.tenant_id), "task_id": str(task_id), "from_state": state})
        outbox.write_event(conn, "TaskCancelRequested", aggregate_type="generation_task", aggregate_id=task_id,
                           tenant_id=caller.tenant_id, payload={"task_id": str(task_id), "from_state": state})
        logger.info("cancel requested", extra={"tenant_id": str(caller.tenant_id), "task_id": str(task_id), "from_state": state})
        return {"task_id": str(task_id), "state": "CANCEL_REQUESTED"}

    return platform.db.transaction(tx)
