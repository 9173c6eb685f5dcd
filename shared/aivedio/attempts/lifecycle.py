"""The attempt's writes (ch. 18.8, 18.14 to 18.16): one place where a provider's word about a job
becomes a task state, whoever heard it (a poll, a callback, the SUBMIT_UNKNOWN lookup, a cancel).

Every write here runs in the caller's transaction, under the task's row lock, and is fenced: it
applies only while the task's current attempt and fencing token are the ones the writer holds. A
refused write changes nothing but the orphan record, so a paused worker that wakes after its
attempt was replaced cannot move the task. Terminal states never change; the transaction that
moves a task to a terminal state also releases the attempt's reservations (by CAS, so only one
transaction decrements) and writes the terminal event, which therefore exists exactly once."""
from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg.types.json import Jsonb

from aivedio import outbox, tasks
from aivedio.faults import safeguards
from aivedio.media import pipeline
from aivedio.metrics_catalog import ATTEMPTS_REQUEUED, REVIEW_ADOPTED, STALE_WRITES_REFUSED, TASKS_FINISHED
from aivedio.observability import logger, publish
from aivedio.providers.adapter import ProviderJob
from aivedio.scheduling.resources import release_attempt
from aivedio.spend import budgets
from aivedio.tasks import ATTEMPT_LIVE
from aivedio.terminal_events import provider_charged, provider_report, write_terminal_event

# Progress a provider status proves; a late or reordered report never moves a task backwards.
_RANK = {"DISPATCHING": 0, "SUBMIT_UNKNOWN": 0, "SUBMITTED": 1, "RUNNING": 2}


@dataclass(frozen=True)
class AttemptRef:
    """What a workflow execution holds: the attempt it works for and the fencing token it was
    claimed with. Every write checks both against the task row."""

    tenant_id: UUID
    task_id: UUID
    attempt_id: UUID
    fencing_token: int

    @classmethod
    def of(cls, doc: dict[str, Any]) -> "AttemptRef":
        return cls(UUID(str(doc["tenant_id"])), UUID(str(doc["task_id"])), UUID(str(doc["attempt_id"])),
                   int(doc["fencing_token"]))

    def as_dict(self) -> dict[str, Any]:
        return {"tenant_id": str(self.tenant_id), "task_id": str(self.task_id), "attempt_id": str(self.attempt_id),
                "fencing_token": self.fencing_token}

    def log(self) -> dict[str, str]:
        return {"tenant_id": str(self.tenant_id), "task_id": str(self.task_id), "attempt_id": str(self.attempt_id)}


@dataclass(frozen=True)
class Loaded:
    task: dict
    attempt: dict
    current: bool  # the attempt is still the task's current one, with the same fencing token


def load(conn: psycopg.Connection, ref: AttemptRef, *, lock: bool) -> Loaded | None:
    """The task (locked FOR UPDATE when `lock`) and the attempt. None if either is missing."""
    task = conn.execute(
        "select * from generation_task where tenant_id = %s and task_id = %s" + (" for update" if lock else ""),
        (ref.tenant_id, ref.task_id),
    ).fetchone()
    attempt = conn.execute("select * from task_attempt where tenant_id = %s and attempt_id = %s",
                           (ref.tenant_id, ref.attempt_id)).fetchone()
    if task is None or attempt is None:
        return None
    current = (task["current_attempt_id"] == ref.attempt_id and task["current_fencing_token"] == ref.fencing_token
               and attempt["fencing_token"] == ref.fencing_token)
    if lock and not current and safeguards.broken("fencing"):
        current = True  # chaos only: a stale writer's write (every write locks the task) goes through
    return Loaded(task, attempt, current)


def renew_lease(conn: psycopg.Connection, ref: AttemptRef, now: datetime, lease_until: datetime) -> bool:
    """The running workflow's heartbeat: the lease scanner leaves a leased attempt alone. Fenced like
    every write: only a live attempt is renewed (replacing or finishing an attempt moves it out of
    ATTEMPT_LIVE in the same transaction), so a worker that wakes after its attempt was replaced renews
    nothing. True when renewed."""
    renewed = conn.execute(
        "update task_attempt set lease_until = %s, updated_at = %s where attempt_id = %s and fencing_token = %s and state = any(%s)",
        (lease_until, now, ref.attempt_id, ref.fencing_token, list(ATTEMPT_LIVE))).rowcount
    if renewed:
        conn.execute("update resource_reservation set lease_until = %s where attempt_id = %s and state = 'ACTIVE'",
                     (lease_until, ref.attempt_id))
    return bool(renewed)


def set_attempt(conn: psycopg.Connection, ref: AttemptRef, now: datetime, **fields: Any) -> None:
    sets = "".join(f", {k} = %({k})s" for k in fields)
    conn.execute(f"update task_attempt set updated_at = %(now)s{sets} where attempt_id = %(a)s and fencing_token = %(f)s",
                 {"now": now, "a": ref.attempt_id, "f": ref.fencing_token,
                  **{k: Jsonb(v) if isinstance(v, dict) else v for k, v in fields.items()}})


def move(conn: psycopg.Connection, loaded: Loaded, to_state: str, now: datetime, **fields: Any) -> dict:
    """CAS the (locked) task to `to_state`; returns the new row. The lock makes the CAS win unless
    the transition is illegal, which is a bug, not a race."""
    task = loaded.task
    row = tasks.cas_transition(conn, tenant_id=task["tenant_id"], task_id=task["task_id"], from_state=task["state"],
                               version=task["version"], to_state=to_state, now=now, **fields)
    if row is None:
        raise RuntimeError(f"task {task['task_id']} moved under its row lock")
    return row


def lock_job(conn: psycopg.Connection, provider: str, job_id: str) -> None:
    """Serializes adopting a job with parking it as unmapped (a transaction-scoped advisory lock)."""
    conn.execute("select pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"provider-job:{provider}:{job_id}",))


def record_orphan(conn: psycopg.Connection, provider: str, job_id: str, account: str | None, attempt_id: UUID | None,
                  reason: str, payload: dict | None = None) -> bool:
    """A provider job the platform no longer (or never) runs for: kept for reconciliation, since it
    may still be billed. True when it is new."""
    return conn.execute(
        """insert into orphan_provider_job (provider, provider_job_id, provider_account, attempt_id, reason, payload)
           values (%s, %s, %s, %s, %s, %s) on conflict do nothing""",
        (provider, job_id, account, attempt_id, reason, Jsonb(payload or {})),
    ).rowcount == 1


# --- terminal outcomes --------------------------------------------------------------------------------

def attempt_outcome(job: ProviderJob | None, *, state: str, stage: str, error_code: str | None = None) -> dict[str, Any]:
    """The attempt's columns once it is final: its state and reason, the provider's last answer, its
    actual cost and whether the provider bills it."""
    fields: dict[str, Any] = {"state": state, "final_reason": stage, "lease_until": None}
    if error_code is not None:
        fields["error_code"] = error_code[:100]
    if job is not None:
        fields["raw_last_response"] = job.doc or {"id": job.id, "status": job.status}
        if job.usage is not None:
            fields.update(actual_cost_amount=job.usage.cost_amount, actual_cost_currency=job.usage.currency)
        if provider_charged(job):
            fields["billable_state"] = "BILLABLE"
    return fields


def finish(conn: psycopg.Connection, loaded: Loaded, to_state: str, *, stage: str, now: datetime,
           job: ProviderJob | None = None, attempt_state: str | None = None, error_code: str | None = None,
           error_message: str | None = None) -> dict:
    """Move the task to a terminal state (through PROVIDER_SUCCEEDED for a success), finish the
    attempt, release its reservations and write the terminal event: all in the caller's
    transaction, so each happens exactly once. (With the media pipeline on, a provider's success
    does not come here: apply_job hands it to the media step, _to_media.)"""
    task, attempt = loaded.task, loaded.attempt
    extra: dict[str, Any] = {"finished_at": now}
    if error_code is not None:
        # The internal code and the provider's text stay with the platform (the tenant's view maps
        # the code through aivedio.tenant_errors); the provider's whole answer is on the attempt.
        extra.update(error_code=error_code, error_message=(error_message or "")[:1000] or None)
    if to_state == "SUCCEEDED":
        if task["state"] not in ("PROVIDER_SUCCEEDED", "MEDIA_PROCESSING"):  # a media stage may have got there first
            mid = move(conn, loaded, "PROVIDER_SUCCEEDED", now)
            loaded = Loaded(mid, attempt, loaded.current)
        if job is not None and job.output_url:
            conn.execute(
                """insert into task_output (task_id, tenant_id, output_version, asset_type, object_key, url, content_type)
                   values (%s, %s, 1, 'video', %s, %s, 'video/mp4') on conflict do nothing""",
                (task["task_id"], task["tenant_id"], f"provider/{attempt['provider']}/{job.id}", job.output_url),
            )
    row = move(conn, loaded, to_state, now, **extra)
    ref = AttemptRef(task["tenant_id"], task["task_id"], attempt["attempt_id"], attempt["fencing_token"])
    set_attempt(conn, ref, now, **attempt_outcome(job, state=attempt_state or to_state, stage=stage, error_code=error_code))
    released = release_attempt(conn, attempt["attempt_id"], now)
    write_terminal_event(conn, task, attempt["attempt_id"], to_state, stage=stage, report=provider_report(attempt, job),
                         error_code=error_code, now=now)
    publish(TASKS_FINISHED, state=to_state, stage=stage)
    logger.info("task finished", extra={"tenant_id": str(task["tenant_id"]), "task_id": str(task["task_id"]),
                                        "attempt_id": str(attempt["attempt_id"]), "state": to_state, "stage": stage,
                                        "reservations_released": len(released)})
    return row


def requeue(conn: psycopg.Connection, loaded: Loaded, *, attempt_state: str, reason: str, now: datetime,
            eligible_at: datetime, **task_fields: Any) -> dict:
    """Give the task back to the scheduler: this attempt is over without a provider job (a 429, or
    an absence confirmed by lookup). Its reservations are released here, once, and a new attempt
    with a new fencing token is claimed later. `task_fields` are further columns of the task to set
    (a review's requeue clears the review's error code)."""
    task, attempt = loaded.task, loaded.attempt
    row = move(conn, loaded, "QUEUED", now, next_eligible_at=eligible_at, current_attempt_id=None,
               current_fencing_token=None, selected_provider=None, selected_account=None, capacity_mode=None,
               **task_fields)
    ref = AttemptRef(task["tenant_id"], task["task_id"], attempt["attempt_id"], attempt["fencing_token"])
    set_attempt(conn, ref, now, state=attempt_state, final_reason=reason, lease_until=None)
    release_attempt(conn, attempt["attempt_id"], now)
    budgets.release_attempt(conn, attempt_id=attempt["attempt_id"], now=now)  # no job: the attempt cost nothing
    # The queue index learns of the task again, as at admission.
    outbox.write_event(conn, "TaskQueued", aggregate_type="generation_task", aggregate_id=task["task_id"],
                       tenant_id=task["tenant_id"], payload={
                           "task_id": str(task["task_id"]), "tenant_id": str(task["tenant_id"]),
                           "queue_class": task["queue_class"], "priority_band": task["priority_band"],
                           "fairness_units": task["fairness_units"], "enqueue_at": task["enqueue_at"].isoformat(),
                           "requeued": True, "reason": reason, "next_eligible_at": eligible_at.isoformat()})
    publish(ATTEMPTS_REQUEUED, reason=reason)
    logger.info("task requeued", extra={"tenant_id": str(task["tenant_id"]), "task_id": str(task["task_id"]),
                                        "attempt_id": str(attempt["attempt_id"]), "reason": reason})
    return row


def reopen_for_cancel(conn: psycopg.Connection, task: dict, attempt: dict, now: datetime) -> str | None:
    """A cancel reached a task whose attempt workflow has ended (MANUAL_REVIEW, or a task past the
    provider's success whose execution is gone): make the attempt live again with its lease already
    expired, so the lease scanner (aivedio.attempts.recovery) starts a new execution. Its Begin reads
    CANCEL_REQUESTED and takes the usual cancel path: ask the provider and apply its answer (a job
    that already finished keeps its result), look the job up by its key when none is known, cancel
    before submit when nothing was sent, or hand the task back to MANUAL_REVIEW when that cannot
    decide. Either way it ends terminal, with its reservations released, or reviewable again;
    nothing is left holding reservations with no workflow to finish it. A live attempt is left
    alone: its running workflow reads the new state at its next step. Returns the attempt's new
    state, or None when it was live. Runs under the task's row lock, in the caller's transaction."""
    if attempt["state"] in ATTEMPT_LIVE:
        return None
    if attempt["provider_job_id"] is not None:
        last = attempt["raw_last_response"] if isinstance(attempt["raw_last_response"], dict) else {}
        state = "RUNNING" if last.get("status") == "running" else "SUBMITTED"
    elif attempt["submit_started_at"] is None:
        state = "DISPATCHING"  # never sent: the submit step cancels it before submitting
    else:
        state = "SUBMIT_UNKNOWN"  # maybe sent: only a lookup by its key can tell
    ref = AttemptRef(task["tenant_id"], task["task_id"], attempt["attempt_id"], attempt["fencing_token"])
    # cancel_sent_at cleared: this cancel is sent to the provider, whatever an earlier one did.
    set_attempt(conn, ref, now, state=state, final_reason=None, lease_until=now, cancel_sent_at=None)
    logger.info("attempt reopened for a cancel", extra={**ref.log(), "from_state": attempt["state"], "state": state})
    return state


def reopen_adopted(conn: psycopg.Connection, loaded: Loaded, job: ProviderJob, *, source: str, now: datetime,
                   media: Any = None) -> Applied:
    """A job found for an attempt in MANUAL_REVIEW (an operator's `review resolve --action adopt`,
    or the stuck-submits service's lookup by key): go on as if the workflow's own lookup had found
    it. The attempt is live again with its lease already expired, so the lease scanner starts a new
    execution that polls (or cancels) it; the task leaves review for the state the job proves (or
    CANCEL_REQUESTED when the tenant asked to cancel meanwhile); and the job's report is applied
    by apply_job like any other, so a job that already finished finishes the task here, releasing
    its reservations once. The caller holds the task's row lock and the job's lock (lock_job) and
    has checked that the task is in review with this attempt current."""
    task, attempt = loaded.task, loaded.attempt
    ref = AttemptRef(task["tenant_id"], task["task_id"], attempt["attempt_id"], attempt["fencing_token"])
    # SUBMIT_UNKNOWN ranks below every report, so apply_job moves the attempt to what the job says.
    # A fresh restart budget: the person's decision is new information, the old failures are not.
    set_attempt(conn, ref, now, state="SUBMIT_UNKNOWN", final_reason=None, lease_until=now, cancel_sent_at=None,
                recoveries_base=attempt["recoveries"])
    cur = load(conn, ref, lock=True)
    assert cur is not None
    cleared = {"error_code": None, "error_message": None}
    if task["cancel_requested_at"] is not None:
        move(conn, cur, "CANCEL_REQUESTED", now, **cleared)
    elif not job.terminal:
        move(conn, cur, "RUNNING" if job.status == "running" else "SUBMITTED", now, **cleared,
             **({"started_at": task["started_at"] or now} if job.status == "running" else {}))
    applied = apply_job(conn, ref, job, source=source, now=now, media=media)
    logger.info("job adopted out of review", extra={**ref.log(), "job_id": job.id, "source": source, "status": job.status,
                                                    "task_state": applied.task_state})
    publish(REVIEW_ADOPTED, source=source)
    return applied


def cancel_stage(attempt: dict) -> str:
    """Where a cancelled job was (ch. 20.6.6): the charge policy prices each stage differently."""
    if attempt["provider_job_id"] is None and attempt["state"] == "DISPATCHING":
        return "BEFORE_SUBMIT"
    return "PROVIDER_RUNNING" if attempt["state"] == "RUNNING" else "PROVIDER_QUEUED"


# --- the transition function --------------------------------------------------------------------------

@dataclass(frozen=True)
class Applied:
    outcome: str  # APPLIED | UNCHANGED | TERMINAL (the task is terminal now) | STALE | MISSING
    task_state: str | None = None


def apply_job(conn: psycopg.Connection, ref: AttemptRef, job: ProviderJob, *, source: str, now: datetime,
              media: Any = None) -> Applied:
    """What the provider says of the attempt's job, applied to the task. Polling, callbacks, the
    SUBMIT_UNKNOWN lookup and cancel all come here. Idempotent: the same report twice changes
    nothing the second time; a report older than what is known is ignored.

    `media` is the platform's MediaConfig (platform.config.media; every caller with a platform
    passes it). With the pipeline enabled a success goes to PROVIDER_SUCCEEDED and a media job
    (_to_media), not to SUCCEEDED: the outcome is TERMINAL for the
    attempt, whose work is done, with task_state PROVIDER_SUCCEEDED (or where the media step is).
    None, or enabled = false: the old path, the provider's success is the task's."""
    loaded = load(conn, ref, lock=True)
    if loaded is None:
        return Applied("MISSING")
    task, attempt = loaded.task, loaded.attempt
    if not loaded.current:
        if record_orphan(conn, attempt["provider"], job.id, attempt["provider_account"], attempt["attempt_id"],
                         "STALE_ATTEMPT", {"status": job.status, "source": source}):
            logger.warning("report for a replaced attempt refused", extra={**ref.log(), "job_id": job.id, "source": source,
                                                                           "current_attempt_id": str(task["current_attempt_id"])})
        publish(STALE_WRITES_REFUSED, source=source)
        return Applied("STALE", task["state"])
    if tasks.is_terminal(task["state"]):
        return Applied("TERMINAL", task["state"])
    if task["state"] in ("PROVIDER_SUCCEEDED", "MEDIA_PROCESSING") and job.status != "succeeded":
        # The provider's success is known and the media step has the task: a late or contrary report
        # (a reordered webhook saying "running") changes nothing.
        return Applied("UNCHANGED", task["state"])
    if attempt["provider_job_id"] is not None and attempt["provider_job_id"] != job.id:
        # The same key never yields two jobs; a second id is the provider's bug, kept for review.
        record_orphan(conn, attempt["provider"], job.id, attempt["provider_account"], attempt["attempt_id"],
                      "SECOND_JOB_FOR_KEY", job.doc)
        logger.error("provider reported a second job for one attempt", extra={**ref.log(), "job_id": job.id})
        return Applied("UNCHANGED", task["state"])
    if attempt["provider_job_id"] is None:
        lock_job(conn, attempt["provider"], job.id)
        set_attempt(conn, ref, now, provider_job_id=job.id)
        # A webhook that overtook the submit's answer was parked as unmapped; the job has its attempt now.
        conn.execute("delete from orphan_provider_job where provider = %s and provider_job_id = %s and reason = 'UNMAPPED'",
                     (attempt["provider"], job.id))
    cancelling = task["state"] == "CANCEL_REQUESTED"
    if job.status == "succeeded":
        if media is not None and media.enabled:
            if job.output_url or source != "submit":
                return Applied("TERMINAL", _to_media(conn, loaded, job, now=now, media=media))
            # A submit's answer (a replayed key) names a finished job, not its output: the task goes
            # on as running, and the next poll reads the whole job.
        else:
            finish(conn, loaded, "SUCCEEDED", stage="PROVIDER_SUCCEEDED", now=now, job=job)
            return Applied("TERMINAL", "SUCCEEDED")
    if job.status == "failed":
        err = job.error
        finish(conn, loaded, "FAILED", stage="PROVIDER_FAILED", now=now, job=job,
               error_code=f"PROVIDER_{err.code}".upper() if err else "PROVIDER_FAILED", error_message=err.message if err else None)
        return Applied("TERMINAL", "FAILED")
    if job.status == "cancelled":
        if cancelling:
            finish(conn, loaded, "CANCELLED", stage=cancel_stage(attempt), now=now, job=job)
            return Applied("TERMINAL", "CANCELLED")
        # Cancelled by the provider, not by us: for the tenant it failed.
        finish(conn, loaded, "FAILED", stage="PROVIDER_FAILED", now=now, job=job, attempt_state="CANCELLED",
               error_code="PROVIDER_CANCELLED", error_message="the provider cancelled the job")
        return Applied("TERMINAL", "FAILED")
    # queued / running (or succeeded, as far as a submit's answer shows): progress only forwards
    target = "RUNNING" if job.status in ("running", "succeeded") else "SUBMITTED"
    if job.status == "succeeded":
        job = ProviderJob(id=job.id, status="running", created_at=job.created_at)
    fields: dict[str, Any] = {"raw_last_response": job.doc or {"id": job.id, "status": job.status}}
    if _RANK.get(attempt["state"], 3) < _RANK[target]:
        fields["state"] = target
    set_attempt(conn, ref, now, **fields)
    if cancelling or _RANK.get(task["state"], 3) >= _RANK[target]:
        return Applied("UNCHANGED", task["state"])
    extra = {"started_at": task["started_at"] or now} if target == "RUNNING" else {}
    row = move(conn, loaded, target, now, **extra)
    return Applied("APPLIED", row["state"])


def _to_media(conn: psycopg.Connection, loaded: Loaded, job: ProviderJob, *, now: datetime, media) -> str:
    """The provider's success with the pipeline on (apply_job, under the task's row lock): the task
    to PROVIDER_SUCCEEDED, the attempt finished as the provider's, its reservations released, and
    the provider's report handed to the media step (pipeline.queue_job). Returns the task's state
    after it.

    Idempotent: a second report of the same success finds the media job and changes nothing. A
    cancel that reached the task during the media step reopened the attempt (aivedio.admission.cancel):
    its workflow's report of the finished job lands here, closes the attempt again and gives the task
    back to where its media job stands (the provider's job is done, so the cancel keeps its result)."""
    task, attempt = loaded.task, loaded.attempt
    ref = AttemptRef(task["tenant_id"], task["task_id"], attempt["attempt_id"], attempt["fencing_token"])
    existing = pipeline.latest_job(conn, task["task_id"])
    if existing is not None:
        if attempt["state"] in ATTEMPT_LIVE:  # reopened for a cancel: final again, its media slots kept
            set_attempt(conn, ref, now, state="SUCCEEDED", final_reason="PROVIDER_SUCCEEDED", lease_until=None)
        state = task["state"]
        if state == "CANCEL_REQUESTED" and existing["state"] in ("PENDING", "RUNNING"):
            state = move(conn, loaded, "PROVIDER_SUCCEEDED" if existing["state"] == "PENDING" else "MEDIA_PROCESSING",
                         now)["state"]
            logger.info("cancel after the provider's success: the media step goes on",
                        extra={**ref.log(), "media_job_state": existing["state"]})
        return state
    if task["state"] not in ("PROVIDER_SUCCEEDED", "MEDIA_PROCESSING"):
        loaded = Loaded(move(conn, loaded, "PROVIDER_SUCCEEDED", now), attempt, loaded.current)
    set_attempt(conn, ref, now, **attempt_outcome(job, state="SUCCEEDED", stage="PROVIDER_SUCCEEDED"))
    released = release_attempt(conn, attempt["attempt_id"], now)
    return pipeline.queue_job(conn, loaded.task, attempt, report=provider_report(attempt, job),
                              source_url=job.output_url or "", now=now, media=media, released=len(released))


def jitter(seconds: float, spread: float = 0.2) -> float:
    return seconds * (1 + random.uniform(-spread, spread))
