"""Ways out of MANUAL_REVIEW (ch. 18.15, 18.16.6): what `aivedio admin review list|show|resolve`
runs, and what the stuck-submits and parked-webhooks services share with it.

The attempt workflow hands a task to a person when it cannot decide on its own, with its
reservations (capacity, credit, budget) kept, since the job may be live at the provider:
- SUBMIT_UNKNOWN_UNRESOLVED: a submit that may have been sent, whose lookups by key kept failing
  (or answered empty outside the provider's idempotency window) past the safe window;
- PROVIDER_LOST_JOB: the provider accepted the job and then answered 404 for it, poll after poll;
- RECOVERY_EXHAUSTED: the workflow was restarted max_attempt_recoveries times without finishing.

Three resolutions, each through the lifecycle functions the workflow itself uses, each audited (old state, new state, reason) in the transaction that makes it:
- adopt J: the job is fetched from the provider first (it must exist, and when the provider still
  lists the attempt's key it must be among what it lists), then mapped to the attempt under the
  job's lock (apply_job, source "review"), and the workflow goes on as if its own lookup had found
  it: the attempt is live again with an expired lease, so the lease scanner starts its execution
  (lifecycle.reopen_adopted). A job that already finished finishes the task here;
- requeue: only when absence is proven (nothing was ever sent, or a lookup by key answers empty
  inside the provider's window: steps.absence_proven), or confirmed by the operator
  (--confirm-absent, with the reason audited). Then it is lifecycle.requeue with ABSENT_CONFIRMED,
  like the workflow's own proven absence: capacity and budget released, the credit reservation
  kept for the next attempt. A task the tenant asked to cancel meanwhile is cancelled instead;
- fail: the task ends FAILED at stage ABANDONED through lifecycle.finish (capacity released there,
  credit and budget by the settlement of its terminal event, under the task's charge policy, which
  charges nothing for ABANDONED). It is the operator's way out, so it goes ahead whatever the
  provider says (down, or no longer in the config). A job found for it is cancelled at the provider
  (best effort) and recorded as an ABANDONED orphan, whose cost the orphan-jobs service records.

Nothing that may exist at the provider is forgotten by a resolution: a known job id, and (when the
provider could not be asked and no job id is known) the attempt's idempotency key, are recorded as
ABANDONED orphans of the attempt, which the orphan-jobs service keeps asking about (a job found by
the key is then attributed to the attempt) and invoice reconciliation can attribute. A requeue of an
attempt whose job id is known needs the operator's confirmation: the provider accepted that job, so
no empty answer proves it gone.

Listing and showing need review.read. Nothing here starts a workflow execution itself."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg.types.json import Jsonb

from aivedio import audit
from aivedio.attempts.lifecycle import AttemptRef, Loaded, finish, load, lock_job, reopen_adopted, requeue, set_attempt
from aivedio.attempts.steps import absence_proven
from aivedio.errors import DomainError, InvalidRequest, NotFound
from aivedio.metrics_catalog import REVIEW_FAILED, REVIEW_REQUEUED
from aivedio.observability import logger, publish
from aivedio.providers.adapter import ProviderError, ProviderJob
from aivedio.providers.registry import UnknownProvider, adapter

REASONS = ("SUBMIT_UNKNOWN_UNRESOLVED", "PROVIDER_LOST_JOB", "RECOVERY_EXHAUSTED")
ACTIONS = ("adopt", "requeue", "fail")
FAILED_CODE = "REVIEW_FAILED"  # the task's error code after `resolve --action fail` (the tenant sees GENERATION_FAILED)


class ReviewRefused(DomainError):
    """The resolution cannot be made as asked; nothing was written."""

    code = "REVIEW_REFUSED"


# --- reading ------------------------------------------------------------------------------------------

LIST_REVIEWS = """
select t.tenant_id, t.task_id, t.error_code as reason, t.error_message as message, t.updated_at as since,
       t.cancel_requested_at, a.attempt_id, a.attempt_no, a.state as attempt_state, a.provider, a.provider_account,
       a.provider_job_id, a.submit_started_at, a.review_checked_at, a.review_checks
  from generation_task t
  left join task_attempt a on a.tenant_id = t.tenant_id and a.attempt_id = t.current_attempt_id
 where t.state = 'MANUAL_REVIEW' and (%(tenant)s::uuid is null or t.tenant_id = %(tenant)s)
 order by t.updated_at, t.task_id
 limit %(limit)s
"""
COUNT_OPEN = "select count(*) as n from generation_task where state = 'MANUAL_REVIEW'"
TENANT_OF = "select tenant_id from generation_task where task_id = %s"
TASK = """select task_id, tenant_id, state, version, error_code, error_message, cancel_requested_at, current_attempt_id,
                 current_fencing_token, created_at, updated_at
            from generation_task where tenant_id = %s and task_id = %s"""
ATTEMPTS = """select attempt_id, attempt_no, state, final_reason, provider, provider_account, provider_request_key,
                     provider_job_id, fencing_token, submit_started_at, submit_finished_at, lease_until, recoveries,
                     review_checked_at, review_checks, error_code, created_at, updated_at
                from task_attempt where tenant_id = %s and task_id = %s order by attempt_no"""
HELD = """
select (select count(*) from resource_reservation r where r.tenant_id = %(tenant)s and r.task_id = %(task)s
                                                   and r.state = 'ACTIVE') as resources,
       (select count(*) from credit_reservation c where c.tenant_id = %(tenant)s and c.task_id = %(task)s
                                                 and c.state = 'ACTIVE') as credit,
       (select count(*) from budget_reservation b where b.tenant_id = %(tenant)s and b.task_id = %(task)s
                                                 and b.state = 'ACTIVE') as budget
"""
REVIEW_EVENTS = """select payload, created_at from outbox_event
                    where tenant_id = %s and aggregate_id = %s and event_type = 'TaskNeedsReview' order by created_at"""
ORPHANS = """select provider_job_id, provider_request_key, reason, attempt_id, payload, created_at, resolved_at,
                    resolution
               from orphan_provider_job where attempt_id = any(%s) or (provider = %s and provider_job_id = any(%s))"""
PARKED = """select webhook_id, event_type, state, received_at from parked_webhook
             where provider = %s and provider_job_id = any(%s) order by received_at"""
AUDIT = """select operator, action, old_value, new_value, reason, created_at from audit_log
            where tenant_id = %s and target = %s order by audit_id"""


def count_open(conn: psycopg.Connection) -> int:
    return conn.execute(COUNT_OPEN).fetchone()["n"]


def list_reviews(conn: psycopg.Connection, *, operator: str, tenant_id: UUID | None = None, limit: int = 100) -> dict:
    """The tasks in MANUAL_REVIEW, oldest first (review.read)."""
    rows = conn.execute(LIST_REVIEWS, {"tenant": tenant_id, "limit": limit}).fetchall()
    return {"items": [_plain(r) for r in rows], "count": len(rows), "open": count_open(conn)}


def show(conn: psycopg.Connection, *, operator: str, task_id: UUID, tenant_id: UUID | None = None) -> dict:
    """One task's review file: why, its attempts, what it holds, what the provider told us (review.read)."""
    tenant = _tenant_of(conn, task_id, tenant_id)
    task = conn.execute(TASK, (tenant, task_id)).fetchone()
    attempts = conn.execute(ATTEMPTS, (tenant, task_id)).fetchall()
    provider = next((a["provider"] for a in attempts if a["attempt_id"] == task["current_attempt_id"]), None)
    job_ids = [a["provider_job_id"] for a in attempts if a["provider_job_id"]]
    orphans = conn.execute(ORPHANS, ([a["attempt_id"] for a in attempts], provider, job_ids)).fetchall()
    parked = conn.execute(PARKED, (provider, job_ids)).fetchall() if job_ids else []
    return {"task": _plain(task), "attempts": [_plain(a) for a in attempts],
            "held": dict(conn.execute(HELD, {"tenant": tenant, "task": task_id}).fetchone()),
            "review_events": [_plain(e) for e in conn.execute(REVIEW_EVENTS, (tenant, task_id)).fetchall()],
            "orphans": [_plain(o) for o in orphans], "parked_webhooks": [_plain(p) for p in parked],
            "audit": [_plain(a) for a in conn.execute(AUDIT, (tenant, f"task:{task_id}")).fetchall()]}


def _tenant_of(conn: psycopg.Connection, task_id: UUID, tenant_id: UUID | None) -> UUID:
    row = conn.execute(TENANT_OF, (task_id,)).fetchone()
    if row is None or (tenant_id is not None and row["tenant_id"] != tenant_id):
        raise NotFound(f"no task {task_id}" + (f" of tenant {tenant_id}" if tenant_id else ""))
    return row["tenant_id"]


def _plain(row: Any) -> dict:
    return {k: (str(v) if isinstance(v, (UUID, datetime)) else v) for k, v in dict(row).items()}


# --- what the provider says of an attempt in review ----------------------------------------------------

@dataclass(frozen=True)
class Finding:
    """One look at the provider for an attempt: the job when one exists, else the proof of absence
    (NEVER_SENT, LOOKUP_EMPTY_IN_WINDOW) when there is one, with what was seen."""

    job: ProviderJob | None = None
    proof: str | None = None
    evidence: dict = field(default_factory=dict)
    error: str | None = None  # the provider could not be asked
    provider_unknown: bool = False  # the attempt's provider is no longer in the config


def look(platform, attempt: dict) -> Finding:
    """Ask the provider about the attempt's job: by its id when known, then by its idempotency key.
    An empty lookup proves absence only by steps.absence_proven; a failed call proves nothing, nor
    does a provider that left the config (nobody can ask it)."""
    if attempt["provider_job_id"] is None and attempt["submit_started_at"] is None:
        # submit_started_at is committed before a request leaves: without it nothing was sent.
        return Finding(proof="NEVER_SENT", evidence={"submit_started_at": None})
    try:
        prov = adapter(platform, attempt["provider"])
    except UnknownProvider as e:
        return Finding(evidence={"error": e.message, "provider_unknown": True}, error=e.message, provider_unknown=True)
    account = attempt["provider_account"]
    try:
        if attempt["provider_job_id"] is not None:
            job = prov.get(account, attempt["provider_job_id"])
            if job is not None:
                return Finding(job=job, evidence={"found_by": "id", "status": job.status})
        lookup = prov.find_by_key(account, idempotency_key=attempt["provider_request_key"])
    except ProviderError as e:
        return Finding(evidence={"error": e.message}, error=e.message)
    if lookup.items:
        return Finding(job=lookup.items[0], evidence={"found_by": "key", "job_ids": [j.id for j in lookup.items]})
    sent_at = attempt["submit_started_at"] or attempt["created_at"]
    evidence = {"lookup": "empty", "idempotency_window_seconds": lookup.idempotency_window_seconds,
                "key_age_seconds": round((platform.clock.now() - sent_at).total_seconds() * platform.clock.time_scale, 1)}
    if absence_proven(platform, attempt, lookup, prov.timeout_seconds):
        return Finding(proof="LOOKUP_EMPTY_IN_WINDOW", evidence=evidence)
    return Finding(evidence=evidence)


# --- the resolutions, in the caller's transaction ------------------------------------------------------

MAPPED_ELSEWHERE = """select attempt_id from task_attempt where provider = %s and provider_job_id = %s and attempt_id <> %s"""
ORPHAN_OF_OTHER = """select reason, attempt_id from orphan_provider_job
                      where provider = %s and provider_job_id = %s and reason <> 'UNMAPPED'
                        and attempt_id is distinct from %s"""
# The job of an abandoned attempt: attributed to it (an UNMAPPED record of a parked webhook included),
# so the orphan-jobs service stops it and records what it cost.
ABANDON_JOB = """
insert into orphan_provider_job (provider, provider_job_id, provider_account, attempt_id, reason, payload)
values (%(provider)s, %(job)s, %(account)s, %(attempt)s, 'ABANDONED', %(payload)s)
on conflict (provider, provider_job_id) do update
   set attempt_id = excluded.attempt_id, provider_account = excluded.provider_account, reason = 'ABANDONED',
       payload = orphan_provider_job.payload || excluded.payload
 where orphan_provider_job.reason = 'UNMAPPED'
"""
# A job that may exist though nobody knows its id: kept by the attempt's key (the placeholder id
# 'key:<key>', see migration 0120), so the orphan-jobs service keeps looking it up by that key.
ABANDON_KEY = """
insert into orphan_provider_job (provider, provider_job_id, provider_account, attempt_id, reason, provider_request_key,
                                 payload)
values (%(provider)s, 'key:' || %(key)s, %(account)s, %(attempt)s, 'ABANDONED', %(key)s, %(payload)s)
on conflict (provider, provider_job_id) do nothing
"""


def keep_orphans(conn: psycopg.Connection, attempt: dict, *, jobs: dict[str, str], by_key: bool, actor: str, action: str,
                 evidence: dict | None = None) -> list[str]:
    """Record what the attempt may have left at the provider as its ABANDONED orphans: each of
    `jobs` (id -> what was done there), and its idempotency key when `by_key` (no job id is known
    and the provider could not be asked). Returns the orphan ids recorded."""
    note = {"abandoned_by": actor, "action": action}
    if evidence and evidence.get("provider_unknown"):
        note["provider_unknown"] = True
    kept = []
    for job_id, done_there in jobs.items():
        conn.execute(ABANDON_JOB, {"provider": attempt["provider"], "job": job_id, "account": attempt["provider_account"],
                                   "attempt": attempt["attempt_id"], "payload": Jsonb({**note, "cancel": done_there})})
        kept.append(job_id)
    if by_key and not jobs:
        conn.execute(ABANDON_KEY, {"provider": attempt["provider"], "key": attempt["provider_request_key"],
                                   "account": attempt["provider_account"], "attempt": attempt["attempt_id"],
                                   "payload": Jsonb({**note, "lookup": evidence or {}})})
        kept.append(f"key:{attempt['provider_request_key']}")
    return kept


def in_review(conn: psycopg.Connection, ref: AttemptRef) -> Loaded:
    """The task, locked, still in review with this attempt current; ReviewRefused otherwise."""
    cur = load(conn, ref, lock=True)
    if cur is None:
        raise NotFound(f"no task {ref.task_id}")
    if not cur.current or cur.task["state"] != "MANUAL_REVIEW" or cur.attempt["state"] != "MANUAL_REVIEW":
        raise ReviewRefused(f"task {ref.task_id} is not in review (it is {cur.task['state']})", code="TASK_NOT_IN_REVIEW",
                            details={"task_state": cur.task["state"], "attempt_state": cur.attempt["state"],
                                     "current_attempt_id": str(cur.task["current_attempt_id"])})
    return cur


def _state(loaded: Loaded) -> dict:
    t, a = loaded.task, loaded.attempt
    return {"task_state": t["state"], "task_version": t["version"], "error_code": t["error_code"],
            "attempt_id": str(a["attempt_id"]), "attempt_state": a["state"], "provider_job_id": a["provider_job_id"]}


def _after(conn: psycopg.Connection, ref: AttemptRef) -> dict:
    cur = load(conn, ref, lock=False)
    assert cur is not None
    return _state(cur)


def adopt_job(conn: psycopg.Connection, platform, ref: AttemptRef, job: ProviderJob, *, actor: str, reason: str,
              source: str = "review", evidence: dict | None = None) -> dict:
    """Map `job` to the attempt in review and go on from it (lifecycle.reopen_adopted), audited in
    this transaction. `resolve --action adopt`, the stuck-submits and the parked-webhooks services
    all come here. ReviewRefused when the task left review or the job belongs to another attempt."""
    cur = in_review(conn, ref)
    provider = cur.attempt["provider"]
    lock_job(conn, provider, job.id)  # serialized with a webhook that would park it meanwhile
    other = conn.execute(MAPPED_ELSEWHERE, (provider, job.id, ref.attempt_id)).fetchone()
    if other is not None:
        raise ReviewRefused(f"job {job.id} is attempt {other['attempt_id']}'s", code="JOB_ALREADY_MAPPED",
                            details={"provider_job_id": job.id, "attempt_id": str(other["attempt_id"])})
    orphan = conn.execute(ORPHAN_OF_OTHER, (provider, job.id, ref.attempt_id)).fetchone()
    if orphan is not None:
        raise ReviewRefused(f"job {job.id} is recorded as an orphan ({orphan['reason']}) of another attempt",
                            code="JOB_OF_ANOTHER_ATTEMPT", details={"provider_job_id": job.id, "reason": orphan["reason"]})
    old = _state(cur)
    applied = reopen_adopted(conn, cur, job, source=source, now=platform.clock.now(), media=platform.config.media)
    new = {**_after(conn, ref), "job_status": job.status}
    audit.append(conn, operator=actor, action="review.adopt", target=f"task:{ref.task_id}", tenant_id=ref.tenant_id,
                 old=old, new={**new, **({"evidence": evidence} if evidence else {})}, reason=reason)
    return {"action": "adopt", "task_id": str(ref.task_id), "provider_job_id": job.id, "job_status": job.status,
            "outcome": applied.outcome, **new}


def requeue_absent(conn: psycopg.Connection, platform, ref: AttemptRef, *, proof: str, actor: str, reason: str,
                   evidence: dict | None = None, jobs: dict[str, str] | None = None, by_key: bool = False) -> dict:
    """No job exists (proven, or confirmed by the operator): the attempt ends ABSENT_CONFIRMED and the
    task is queued for a new attempt, as the workflow does when its lookup proves absence; a task
    the tenant asked to cancel meanwhile is cancelled before submit instead. What an operator's
    confirmation may have got wrong (`jobs`, the key when `by_key`) is kept as orphans. Audited here."""
    cur = in_review(conn, ref)
    orphans = keep_orphans(conn, cur.attempt, jobs=jobs or {}, by_key=by_key, actor=actor, action="requeue",
                           evidence=evidence)
    now = platform.clock.now()
    old = _state(cur)
    if cur.task["cancel_requested_at"] is not None:
        finish(conn, cur, "CANCELLED", stage="BEFORE_SUBMIT", now=now, attempt_state="ABSENT_CONFIRMED")
    else:
        requeue(conn, cur, attempt_state="ABSENT_CONFIRMED", reason="SUBMIT_ABSENT_CONFIRMED", now=now, eligible_at=now,
                error_code=None, error_message=None)
    new = {**_after(conn, ref), "proof": proof, **({"orphans": orphans} if orphans else {})}
    audit.append(conn, operator=actor, action="review.requeue", target=f"task:{ref.task_id}", tenant_id=ref.tenant_id,
                 old=old, new={**new, **({"evidence": evidence} if evidence else {})}, reason=reason)
    publish(REVIEW_REQUEUED, proof=proof)
    return {"action": "requeue", "task_id": str(ref.task_id), **new}


def fail_task(conn: psycopg.Connection, platform, ref: AttemptRef, *, actor: str, reason: str, jobs: dict[str, str],
              by_key: bool = False, evidence: dict | None = None) -> dict:
    """End the task FAILED (stage ABANDONED) through lifecycle.finish; `jobs` (id -> what was done
    at the provider), or the attempt's key when `by_key`, are recorded as its ABANDONED orphans
    (keep_orphans). Audited here, with what the provider said (`evidence`)."""
    cur = in_review(conn, ref)
    now = platform.clock.now()
    a = cur.attempt
    old = _state(cur)
    if a["provider_job_id"] is None and len(jobs) == 1:
        # A lookup found the job after all: it is this attempt's, whatever the operator decided.
        set_attempt(conn, ref, now, provider_job_id=next(iter(jobs)))
    finish(conn, cur, "FAILED", stage="ABANDONED", now=now, attempt_state="FAILED", error_code=FAILED_CODE,
           error_message=reason)
    orphans = keep_orphans(conn, a, jobs=jobs, by_key=by_key, actor=actor, action="fail", evidence=evidence)
    new = {**_after(conn, ref), "jobs": jobs, "orphans": orphans}
    audit.append(conn, operator=actor, action="review.fail", target=f"task:{ref.task_id}", tenant_id=ref.tenant_id,
                 old=old, new={**new, **({"evidence": evidence} if evidence else {})}, reason=reason)
    publish(REVIEW_FAILED)
    return {"action": "fail", "task_id": str(ref.task_id), **new}


# --- the operator's commands ---------------------------------------------------------------------------

def resolve(platform, *, operator: str, task_id: UUID, action: str, reason: str, provider_job_id: str | None = None,
            confirm_absent: bool = False, tenant_id: UUID | None = None) -> dict:
    """`aivedio admin review resolve` (and the admin API's route): check the input, ask the provider (outside any
    transaction), then make the resolution in one transaction with its audit row."""
    if action not in ACTIONS:
        raise InvalidRequest("unknown action", {"action": f"one of {', '.join(ACTIONS)}"})
    if not (reason or "").strip():
        raise InvalidRequest("a reason is required", {"reason": "say why, for the audit log"})
    if action == "adopt" and not provider_job_id:
        raise InvalidRequest("adopt needs the job", {"provider_job_id": "the provider's job id to adopt"})
    ref, attempt = platform.db.transaction(lambda conn: _prepare(conn, operator, task_id, tenant_id))
    if action == "adopt":
        return _adopt(platform, operator, ref, attempt, provider_job_id, reason)
    if action == "requeue":
        return _requeue(platform, operator, ref, attempt, reason, confirm_absent)
    return _fail(platform, operator, ref, attempt, reason)


def _prepare(conn: psycopg.Connection, operator: str, task_id: UUID, tenant_id: UUID | None) -> tuple[AttemptRef, dict]:
    tenant = _tenant_of(conn, task_id, tenant_id)
    task = conn.execute(TASK, (tenant, task_id)).fetchone()
    if task["state"] != "MANUAL_REVIEW" or task["current_attempt_id"] is None:
        raise ReviewRefused(f"task {task_id} is not in review (it is {task['state']})", code="TASK_NOT_IN_REVIEW",
                            details={"task_state": task["state"]})
    ref = AttemptRef(tenant, task_id, task["current_attempt_id"], task["current_fencing_token"])
    cur = load(conn, ref, lock=False)
    assert cur is not None
    return ref, cur.attempt


def _adopt(platform, operator: str, ref: AttemptRef, attempt: dict, job_id: str, reason: str) -> dict:
    if attempt["provider_job_id"] is not None and attempt["provider_job_id"] != job_id:
        raise ReviewRefused(f"the attempt's job is {attempt['provider_job_id']}, not {job_id}", code="JOB_MISMATCH",
                            details={"attempt_job_id": attempt["provider_job_id"], "provider_job_id": job_id})
    try:
        prov = adapter(platform, attempt["provider"])
    except UnknownProvider as e:
        raise ReviewRefused(f"{e.message}: its job cannot be fetched; fail the task", code="PROVIDER_UNKNOWN",
                            details={"provider": attempt["provider"]}) from None
    try:
        job = prov.get(attempt["provider_account"], job_id)
    except ProviderError as e:
        raise ReviewRefused(f"the provider could not be asked for job {job_id}: {e.message}", code="PROVIDER_UNAVAILABLE",
                            details={"provider": attempt["provider"]}) from None
    if job is None:
        raise ReviewRefused(f"the provider knows no job {job_id} on account {attempt['provider_account']}",
                            code="JOB_NOT_FOUND", details={"provider_job_id": job_id})
    evidence: dict[str, Any] = {"status": job.status}
    try:  # the key lookup, where it still answers, must agree: a job of another key is not this attempt's
        lookup = prov.find_by_key(attempt["provider_account"], idempotency_key=attempt["provider_request_key"])
        listed = [j.id for j in lookup.items]
    except ProviderError as e:
        listed, evidence["lookup_error"] = None, e.message
    if listed:
        evidence["listed_for_key"] = listed
        if job_id not in listed:
            raise ReviewRefused(f"job {job_id} is not listed for the attempt's key", code="JOB_MISMATCH",
                                details={"provider_job_id": job_id, "listed_for_key": listed})

    def tx(conn) -> dict:
        return adopt_job(conn, platform, ref, job, actor=operator, reason=reason, evidence=evidence)

    out = platform.db.transaction(tx)
    logger.info("review resolved: job adopted", extra={**ref.log(), "operator": operator, "job_id": job_id})
    return out


def _requeue(platform, operator: str, ref: AttemptRef, attempt: dict, reason: str, confirm_absent: bool) -> dict:
    found = look(platform, attempt)
    if found.job is not None:
        raise ReviewRefused(f"the provider has job {found.job.id} for this attempt: adopt it, or fail the task",
                            code="JOB_EXISTS", details={"provider_job_id": found.job.id, "status": found.job.status})
    known = attempt["provider_job_id"]
    if known is not None and not confirm_absent:
        # The provider accepted this job: an empty answer (404, or nothing for the key) does not prove it gone.
        raise ReviewRefused(f"the provider accepted job {known} for this attempt: requeue only with --confirm-absent and "
                            "a reason (the job is kept as an orphan), or fail the task", code="JOB_ID_KNOWN",
                            details={"provider_job_id": known, **found.evidence})
    proof = found.proof if known is None else None
    if proof is None:
        if not confirm_absent:
            raise ReviewRefused("absence is not proven (the provider could not be asked, or its empty answer is outside "
                                "its idempotency window): confirm it with --confirm-absent and a reason",
                                code="ABSENCE_NOT_PROVEN", details=found.evidence)
        proof = "OPERATOR_CONFIRMED"

    def tx(conn) -> dict:
        return requeue_absent(conn, platform, ref, proof=proof, actor=operator, reason=reason, evidence=found.evidence,
                              jobs={known: "confirmed_absent"} if known is not None else {},
                              by_key=found.error is not None)

    out = platform.db.transaction(tx)
    logger.info("review resolved: requeued", extra={**ref.log(), "operator": operator, "proof": proof})
    return out


def _fail(platform, operator: str, ref: AttemptRef, attempt: dict, reason: str) -> dict:
    # Best effort, before the transaction: find the job if any and stop it, so nobody runs it for nothing.
    found = look(platform, attempt)
    ids = {found.job.id} if found.job is not None else set()
    if attempt["provider_job_id"] is not None:
        ids.add(attempt["provider_job_id"])
    jobs: dict[str, str] = {}
    for job_id in sorted(ids):
        if found.job is not None and found.job.id == job_id and found.job.terminal:
            jobs[job_id] = f"finished:{found.job.status}"
        elif found.provider_unknown:
            jobs[job_id] = "provider_unknown"
        elif not platform.config.limits.orphan_cancel:
            jobs[job_id] = "left_running"
        else:
            try:
                res = adapter(platform, attempt["provider"]).cancel(attempt["provider_account"], job_id)
                jobs[job_id] = f"cancel:{res.status}" if res is not None else "not_found"
            except (ProviderError, UnknownProvider) as e:
                jobs[job_id] = f"cancel_failed:{e.message[:200]}"

    def tx(conn) -> dict:
        # The provider could not be asked and no job id is known: the job may exist, so its key is kept.
        return fail_task(conn, platform, ref, actor=operator, reason=reason, jobs=jobs, by_key=found.error is not None,
                         evidence=found.evidence)

    out = platform.db.transaction(tx)
    logger.info("review resolved: failed", extra={**ref.log(), "operator": operator, "jobs": jobs})
    return out
