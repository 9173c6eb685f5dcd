"""How a task ends: its one terminal event (TaskSucceeded, TaskFailed, TaskCancelled,
TaskMediaIngestFailed), written in the transaction that moves the task to its terminal state, which
settlement consumes (aivedio.billing.settlement) and every reconciliation reads.

Two rooms end tasks, and both write the event here: aivedio.attempts.lifecycle when the provider's
word ends the task, aivedio.media.pipeline when the media step does. The provider's side of the
event (its job, its charge and its usage: `provider_report`) is what the attempt hands to the media
step, which keeps it on the media job until it writes the event; so neither room imports the other
for it."""
from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any
from uuid import UUID

import psycopg

from aivedio import outbox
from aivedio.tasks import ATTEMPT_LIVE

if TYPE_CHECKING:
    from aivedio.providers.adapter import ProviderJob

TERMINAL_EVENT = {"SUCCEEDED": "TaskSucceeded", "FAILED": "TaskFailed", "CANCELLED": "TaskCancelled",
                  "MEDIA_INGEST_FAILED": "TaskMediaIngestFailed"}

# An attempt a cancel reopened while the media step ran (aivedio.admission.cancel): the provider's
# job is done, so it is final again as the provider's success. A final attempt is left as it is.
CLOSE_REOPENED = """update task_attempt set state = 'SUCCEEDED', final_reason = 'PROVIDER_SUCCEEDED', lease_until = null,
                           updated_at = %(now)s
                     where attempt_id = %(attempt)s and state = any(%(live)s)"""


def usage_of(job: ProviderJob | None) -> dict | None:
    """The provider's usage of a job, as the event carries it (decimal strings)."""
    if job is None or job.usage is None:
        return None
    return {"seconds": str(job.usage.seconds), "cost_amount": str(job.usage.cost_amount), "currency": job.usage.currency}


def provider_charged(job: ProviderJob | None) -> bool:
    return job is not None and (job.charge_id is not None or (job.usage is not None and job.usage.cost_amount > Decimal(0)))


def provider_report(attempt: dict, job: ProviderJob | None) -> dict[str, Any]:
    """What the terminal event says of the provider's side: its job, its charge and its usage. The
    media pipeline keeps it on the media job (media_job.provider_report) for the event it writes
    when the media step ends the task."""
    return {"provider": attempt["provider"], "provider_account": attempt["provider_account"],
            "provider_job_id": job.id if job is not None else attempt["provider_job_id"],
            "charge_id": job.charge_id if job is not None else None,
            "provider_charged": provider_charged(job), "usage": usage_of(job)}


def event_payload(task: dict, attempt_id: UUID, to_state: str, *, stage: str, report: dict[str, Any],
                  error_code: str | None, finished_at: str | None) -> dict[str, Any]:
    """The terminal event's payload: the task, the attempt, where it ended, the provider's report."""
    return {"task_id": str(task["task_id"]), "tenant_id": str(task["tenant_id"]),
            "attempt_id": str(attempt_id), "state": to_state, "stage": stage,
            "provider": report.get("provider"), "provider_account": report.get("provider_account"),
            "provider_job_id": report.get("provider_job_id"), "charge_id": report.get("charge_id"),
            "provider_charged": bool(report.get("provider_charged")), "usage": report.get("usage"),
            "output_seconds": task["duration_seconds"] if to_state == "SUCCEEDED" else 0,
            "error_code": error_code, "finished_at": finished_at}


def write_terminal_event(conn: psycopg.Connection, task: dict, attempt_id: UUID, to_state: str, *, stage: str,
                         report: dict[str, Any], error_code: str | None, now: datetime) -> None:
    """The task's one terminal event (TERMINAL_EVENT), which settlement consumes."""
    outbox.write_event(conn, TERMINAL_EVENT[to_state], aggregate_type="generation_task", aggregate_id=task["task_id"],
                       tenant_id=task["tenant_id"], payload=event_payload(
                           task, attempt_id, to_state, stage=stage, report=report, error_code=error_code,
                           finished_at=now.isoformat()))


def close_reopened_attempt(conn: psycopg.Connection, attempt_id: UUID, now: datetime) -> bool:
    """CLOSE_REOPENED, in the caller's transaction. True when the attempt was live."""
    return conn.execute(CLOSE_REOPENED, {"now": now, "attempt": attempt_id, "live": list(ATTEMPT_LIVE)}).rowcount == 1
