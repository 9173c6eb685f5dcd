"""Room service `orphan-jobs` (ch. 18.16.3, 18.16.6): provider jobs the platform no longer runs for are
stopped and costed, never forgotten. orphan_provider_job holds them: a late submit of a replaced
attempt (STALE_SUBMIT), a report for a replaced attempt's job (STALE_ATTEMPT), a second job the
provider made for one key (SECOND_JOB_FOR_KEY), the job of a task an operator failed out of review
(ABANDONED), and jobs that webhooks named before any attempt knew them (UNMAPPED).

Each run takes the open orphans that are due (asked at most every `retry_seconds`) and asks the
provider for the job (adapter.get):
- still queued or running, and attributed to an attempt: cancelled (Limits.orphan_cancel), unless
  its attempt is the task's current, live one again (then it is in use: resolved IN_USE);
- finished: its cost (the job's usage) is recorded as a provider_cost_event of its attempt
  (spend.costs.record_provider_cost, source API) so invoice reconciliation sees it, and the orphan
  is resolved (COST_RECORDED; COST_PARKED when the provider billed it without saying how much;
  NO_COST). A second job for a key waits for its attempt to end, so that the attempt's own cost is
  recorded first;
- unknown to the provider: resolved NOT_FOUND (reconciliation decides from the invoice), only when
  every account asked answered so: while one of them fails, it is asked again later.
An orphan kept by its key (a task failed out of review while its provider could not be asked, and
no job id was known; migration 0120) is looked up by that key: a job found is recorded as an
ABANDONED orphan of the attempt under its own id (and handled like the others from the next take),
and the key's row resolved JOB_FOUND; an empty answer resolves it NOT_FOUND when it proves absence
(steps.absence_proven), KEY_EXPIRED when the provider's idempotency window is past (it can no
longer tell), and otherwise it is asked again later.
An orphan whose provider left the config (provider_unknown), or that fails unexpectedly (errors,
logged with its ids), is left open for a person and asked again at its next due time; the run goes on.
UNMAPPED orphans belong to the parked-webhooks service while it may still map them: this one only
reads them past `age_seconds`, never cancels them (they may be a task's in review), and resolves a
finished one UNATTRIBUTED with the provider's last word in its payload, for invoice reconciliation.
An orphan is marked resolved, never deleted."""
from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from psycopg.types.json import Jsonb

from aivedio.attempts.lifecycle import lock_job
from aivedio.attempts.review import ABANDON_JOB
from aivedio.attempts.steps import absence_proven
from aivedio.observability import logger
from aivedio.providers.adapter import Lookup, ProviderError, ProviderJob
from aivedio.providers.registry import UnknownProvider, adapter
from aivedio.reconcile.room import Defaults, Report, in_batches, tuning
from aivedio.spend.costs import record_provider_cost
from aivedio.tasks import ATTEMPT_LIVE
from aivedio.terminal_events import provider_charged

NAME = "orphan-jobs"
# Every 5 minutes; each orphan asked at most every 30 minutes; UNMAPPED ones only after a day.
DEFAULTS = Defaults(interval_seconds=300.0, batch_size=50, max_batches=10, age_seconds=86400.0, retry_seconds=1800.0)
ATTRIBUTED = ("STALE_SUBMIT", "STALE_ATTEMPT", "SECOND_JOB_FOR_KEY", "ABANDONED")

TAKE_DUE = """
update orphan_provider_job o set checked_at = %(now)s, checks = o.checks + 1
 where (o.provider, o.provider_job_id) in (
       select q.provider, q.provider_job_id from orphan_provider_job q
        where q.resolved_at is null and (q.checked_at is null or q.checked_at < %(due)s)
          and (q.reason = any(%(attributed)s) or (q.reason = 'UNMAPPED' and q.created_at <= %(unmapped_before)s))
        order by q.checked_at nulls first, q.created_at, q.provider_job_id
        limit %(limit)s
          for update of q skip locked)
returning o.*
"""
ATTEMPT = """select a.tenant_id, a.task_id, a.attempt_id, a.state, a.provider_account, a.provider_job_id,
                    a.submit_started_at, a.created_at,
                    (t.current_attempt_id = a.attempt_id and t.current_fencing_token = a.fencing_token) as current
               from task_attempt a join generation_task t on t.tenant_id = a.tenant_id and t.task_id = a.task_id
              where a.attempt_id = %s"""
MAPPED_CURRENT = """select 1 from task_attempt a join generation_task t on t.tenant_id = a.tenant_id and t.task_id = a.task_id
                                                      and t.current_attempt_id = a.attempt_id
                                                      and t.current_fencing_token = a.fencing_token
                     where a.provider = %s and a.provider_job_id = %s and a.state = any(%s)"""
NOTE = """update orphan_provider_job set last_status = %(status)s, payload = payload || %(payload)s
           where provider = %(provider)s and provider_job_id = %(job)s"""
# The one job a lookup by key found for an attempt that did not know its id: it is the attempt's.
SET_JOB_ID = """update task_attempt set provider_job_id = %(job)s, updated_at = %(now)s
                where tenant_id = %(tenant)s and attempt_id = %(attempt)s and provider_job_id is null"""
RESOLVE = """update orphan_provider_job set resolved_at = %(now)s, resolution = %(resolution)s, last_status = %(status)s,
                                           payload = payload || %(payload)s
              where provider = %(provider)s and provider_job_id = %(job)s and resolved_at is null"""

# The provider's terminal status -> the (state, stage) whose cost type it is (spend.costs).
_OUTCOME = {"succeeded": ("SUCCEEDED", "PROVIDER_SUCCEEDED"), "failed": ("FAILED", "PROVIDER_FAILED"),
            "cancelled": ("CANCELLED", "PROVIDER_RUNNING")}


def _get(platform, orphan: dict) -> tuple[ProviderJob | None, str | None]:
    """The job, from its account, or (for an UNMAPPED one, whose account nobody recorded) from each of
    the provider's accounts in turn. (None, None) only when every account answered that it has no
    such job; raises ProviderError when one could not be asked and none had it (an outage proves
    nothing), UnknownProvider when the provider left the config."""
    prov = adapter(platform, orphan["provider"])
    config = platform.config.provider(orphan["provider"])
    if config is None:
        raise UnknownProvider(f"no provider {orphan['provider']!r} in the config")
    accounts = [orphan["provider_account"]] if orphan["provider_account"] else [a.account_id for a in config.accounts]
    error: ProviderError | None = None
    for account in accounts:
        try:
            job = prov.get(account, orphan["provider_job_id"])
        except ProviderError as e:
            error = e
            continue
        if job is not None:
            return job, account
    if error is not None:
        raise error
    return None, None


def handle(platform, orphan: dict, now: datetime) -> str:
    """One orphan: ask the provider and act. Returns the outcome for the report."""
    key = {"provider": orphan["provider"], "job": orphan["provider_job_id"]}
    if orphan["provider_request_key"] is not None:
        return _by_key(platform, orphan, key, now)
    try:
        job, account = _get(platform, orphan)
    except ProviderError as e:
        logger.warning("orphan job: the provider could not be asked", extra={**key, "error": e.message})
        return "provider_error"
    if job is None:
        _resolve(platform, key, now, "NOT_FOUND", "not_found", {})
        return "not_found"
    with platform.db.connection() as conn:
        attempt = conn.execute(ATTEMPT, (orphan["attempt_id"],)).fetchone() if orphan["attempt_id"] else None
        in_use = conn.execute(MAPPED_CURRENT, (orphan["provider"], job.id, list(ATTEMPT_LIVE))).fetchone() is not None
    unmapped = orphan["reason"] == "UNMAPPED" or attempt is None
    if in_use and not unmapped and orphan["reason"] != "SECOND_JOB_FOR_KEY":
        _resolve(platform, key, now, "IN_USE", job.status, {"job": job.doc})
        return "in_use"
    if not job.terminal:
        if unmapped or not platform.config.limits.orphan_cancel:
            _note(platform, key, job)
            return "running"
        try:  # nobody will collect it: stop it (a running job may still be charged a fee)
            adapter(platform, orphan["provider"]).cancel(account, job.id)
            job = adapter(platform, orphan["provider"]).get(account, job.id) or job
        except ProviderError as e:
            logger.warning("orphan job: cancel failed; asked again later", extra={**key, "error": e.message})
            return "cancel_failed"
        if not job.terminal:
            _note(platform, key, job)
            return "cancel_requested"
        logger.info("orphan job cancelled", extra={**key, "reason": orphan["reason"], "status": job.status})
    if unmapped:
        _resolve(platform, key, now, "UNATTRIBUTED", job.status, {"job": job.doc})
        return "unattributed"
    if orphan["reason"] == "SECOND_JOB_FOR_KEY" and attempt["state"] in ATTEMPT_LIVE:
        _note(platform, key, job)  # its attempt's own cost first
        return "waiting_for_attempt"
    return _record_cost(platform, orphan, attempt, account, job, key, now)


def _by_key(platform, orphan: dict, key: dict, now: datetime) -> str:
    """An orphan kept by its attempt's key: look the key up; a job found becomes the attempt's orphan
    under its own id."""
    prov = adapter(platform, orphan["provider"])
    try:
        lookup = prov.find_by_key(orphan["provider_account"], idempotency_key=orphan["provider_request_key"])
    except ProviderError as e:
        logger.warning("orphan key: the provider could not be asked", extra={**key, "error": e.message})
        return "provider_error"
    with platform.db.connection() as conn:
        attempt = conn.execute(ATTEMPT, (orphan["attempt_id"],)).fetchone()
    if lookup.items:
        ids = [j.id for j in lookup.items]

        def tx(conn) -> None:
            for job in lookup.items:
                lock_job(conn, orphan["provider"], job.id)  # serialized with a webhook parking it meanwhile
                conn.execute(ABANDON_JOB, {"provider": orphan["provider"], "job": job.id,
                                           "account": orphan["provider_account"], "attempt": orphan["attempt_id"],
                                           "payload": Jsonb({**orphan["payload"], "found_by_key": key["job"]})})
            if len(ids) == 1:
                conn.execute(SET_JOB_ID, {"job": ids[0], "tenant": attempt["tenant_id"], "attempt": orphan["attempt_id"],
                                          "now": now})
            conn.execute(RESOLVE, {**key, "now": now, "resolution": "JOB_FOUND", "status": lookup.items[0].status,
                                   "payload": Jsonb({"job_ids": ids})})

        platform.db.transaction(tx)
        logger.info("orphan key: job found", extra={**key, "job_ids": ids, "attempt_id": str(orphan["attempt_id"])})
        return "job_found"
    evidence = _empty(platform, attempt, lookup, prov.timeout_seconds)
    if evidence["absence_proven"]:
        _resolve(platform, key, now, "NOT_FOUND", "not_found", {"lookup": evidence})
        return "not_found"
    if evidence["key_expired"]:  # the provider no longer knows the key: asking again cannot tell more
        _resolve(platform, key, now, "KEY_EXPIRED", "not_found", {"lookup": evidence})
        return "key_expired"
    return "still_unknown"


def _empty(platform, attempt: dict, lookup: Lookup, timeout_seconds: float) -> dict:
    """What an empty answer for the attempt's key says: proof of absence, or a key past the window."""
    sent_at = attempt["submit_started_at"] or attempt["created_at"]
    age = (platform.clock.now() - sent_at).total_seconds() * platform.clock.time_scale
    window = lookup.idempotency_window_seconds
    return {"absence_proven": absence_proven(platform, attempt, lookup, timeout_seconds),
            "key_expired": window is not None and age >= window, "idempotency_window_seconds": window,
            "key_age_seconds": round(age, 1)}


def _record_cost(platform, orphan: dict, attempt: dict, account: str, job: ProviderJob, key: dict, now: datetime) -> str:
    state, stage = _OUTCOME[job.status]
    usage = job.usage
    costly = usage is not None and usage.cost_amount > Decimal(0)

    def tx(conn) -> str:
        recorded = None
        if usage is not None or provider_charged(job):
            recorded = record_provider_cost(
                conn, payload={"orphan": orphan["reason"], "job": job.doc}, state=state, stage=stage,
                tenant_id=attempt["tenant_id"], task_id=attempt["task_id"], attempt_id=attempt["attempt_id"],
                provider=orphan["provider"], provider_account=account, provider_job_id=job.id, charge_id=job.charge_id,
                provider_charged=provider_charged(job), usage=usage, occurred_at=job.finished_at or now)
        resolution = ("COST_RECORDED" if costly else
                      "COST_PARKED" if recorded is not None and recorded.status == "PARKED" else "NO_COST")
        conn.execute(RESOLVE, {**key, "now": now, "resolution": resolution, "status": job.status,
                               "payload": Jsonb({"job": job.doc, "cost": recorded.status if recorded else None})})
        return resolution

    resolution = platform.db.transaction(tx)
    logger.info("orphan job resolved", extra={**key, "reason": orphan["reason"], "resolution": resolution,
                                              "attempt_id": str(attempt["attempt_id"])})
    return resolution.lower()


def _note(platform, key: dict, job: ProviderJob) -> None:
    with platform.db.connection() as conn:
        conn.execute(NOTE, {**key, "status": job.status, "payload": Jsonb({"job": job.doc})})


def _resolve(platform, key: dict, now: datetime, resolution: str, status: str, payload: dict) -> None:
    with platform.db.connection() as conn:
        conn.execute(RESOLVE, {**key, "now": now, "resolution": resolution, "status": status, "payload": Jsonb(payload)})


def run_once(platform) -> Report:
    t = tuning(platform, NAME)
    report = Report(NAME)
    now = platform.clock.now()  # one instant per run: what this run asked is not due again in it

    def batch(limit: int) -> tuple[int, int]:
        rows = platform.db.transaction(lambda conn: conn.execute(TAKE_DUE, {
            "now": now, "due": now - t.retry, "unmapped_before": now - t.age, "attributed": list(ATTRIBUTED),
            "limit": limit}).fetchall())
        repaired = 0
        for row in rows:  # the provider is asked outside any transaction
            ids = {"provider": row["provider"], "job": row["provider_job_id"], "attempt_id": str(row["attempt_id"])}
            try:
                outcome = handle(platform, row, now)
            except UnknownProvider as e:  # left for a person: nobody can ask a provider the config no longer has
                logger.warning("orphan job: its provider is not in the config", extra={**ids, "error": e.message})
                outcome = "provider_unknown"
            except Exception:  # noqa: BLE001 - one bad orphan does not stop the run; asked again when due
                logger.exception("orphan job not handled", extra=ids)
                outcome = "errors"
            report.count(outcome)
            repaired += outcome in ("cost_recorded", "cost_parked", "no_cost", "not_found", "unattributed", "in_use",
                                    "job_found", "key_expired")
        return len(rows), repaired

    return in_batches(report, t, batch)
