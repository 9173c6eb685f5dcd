"""Room service `parked-webhooks`: webhooks that came for a job no attempt knew (aivedio.attempts.callbacks
parks them, whole and verified, in parked_webhook, and answers 202) are applied once the job is
mapped, and are matched to the attempts in review that could own them.

Each run:
1. lookups: for each parked webhook whose job is still unmapped, young enough (`age_seconds`) and due
   (asked at most every `retry_seconds`), the attempts in review with an unknown job on that provider
   (SUBMIT_UNKNOWN_UNRESOLVED, sent before the webhook came; the latest CANDIDATES sent) are looked up
   by their idempotency key; a lookup that finds a job adopts it, by the code path of `aivedio admin
   review resolve --action adopt` (aivedio.reconcile.stuck_submits.check);
2. mapped: every parked webhook whose job now has an attempt (the submit's answer arrived, the
   workflow's lookup, stuck-submits, an operator or step 1 adopted it) is applied with apply_job, in
   the order received, once: a webhook-id already received the ordinary way is a DUPLICATE; a job
   whose attempt was replaced is STALE (apply_job records the orphan).
A parked webhook is never dropped. One that cannot be handled (its lookups or its application fail
unexpectedly) is logged with its ids and counted as `errors`, and the run goes on: it is tried again
at its next due time (an application, once a run). One still unmapped past `age_seconds` is no longer looked up for,
stays PARKED (applied if its job is ever mapped) and its job stays an UNMAPPED orphan, for invoice
reconciliation."""
from __future__ import annotations

from datetime import datetime

from aivedio.attempts.callbacks import RECEIVED, RECORD_RECEIPT
from aivedio.attempts.lifecycle import AttemptRef, apply_job
from aivedio.observability import logger
from aivedio.providers.adapter import parse_job
from aivedio.reconcile import stuck_submits
from aivedio.reconcile.room import Defaults, Report, in_batches, tuning

NAME = "parked-webhooks"
ACTOR = f"maintenance:{NAME}"
# Every 30 s; lookups for one parked webhook at most every 5 minutes, for a week.
DEFAULTS = Defaults(interval_seconds=30.0, batch_size=100, max_batches=10, age_seconds=7 * 86400.0, retry_seconds=300.0)
CANDIDATES = 20  # attempts in review looked up for one unmapped job per try

TAKE_MAPPED = """
select p.provider, p.webhook_id, p.body, p.provider_job_id, a.tenant_id, a.task_id, a.attempt_id, a.fencing_token
  from parked_webhook p
  join task_attempt a on a.provider = p.provider and a.provider_job_id = p.provider_job_id
 where p.state = 'PARKED' and (p.last_error is null or p.last_tried_at < %(now)s)  -- a failed one: once a run
 order by p.received_at, p.webhook_id
 limit %(limit)s
   for update of p skip locked
"""
MARK_DONE = """update parked_webhook set state = %(state)s, done_at = %(now)s, last_tried_at = %(now)s, tries = tries + 1,
                                          task_state = %(task_state)s, last_error = null
                where provider = %(provider)s and webhook_id = %(webhook_id)s"""
MARK_ERROR = """update parked_webhook set last_tried_at = %(now)s, tries = tries + 1, last_error = %(error)s
                 where provider = %(provider)s and webhook_id = %(webhook_id)s"""
TAKE_UNMAPPED = """
update parked_webhook p set last_tried_at = %(now)s, tries = p.tries + 1
 where (p.provider, p.webhook_id) in (
       select q.provider, q.webhook_id from parked_webhook q
        where q.state = 'PARKED' and q.received_at > %(oldest)s
          and (q.last_tried_at is null or q.last_tried_at < %(due)s)
          and not exists (select 1 from task_attempt a where a.provider = q.provider and a.provider_job_id = q.provider_job_id)
        order by q.last_tried_at nulls first, q.received_at, q.webhook_id
        limit %(limit)s
          for update of q skip locked)
returning p.provider, p.provider_job_id, p.received_at
"""
# Attempts in review that may own a job the provider reported before any attempt knew it.
REVIEW_CANDIDATES = """
select a.* from task_attempt a
  join generation_task t on t.tenant_id = a.tenant_id and t.task_id = a.task_id and t.current_attempt_id = a.attempt_id
                        and t.current_fencing_token = a.fencing_token and t.state = 'MANUAL_REVIEW'
 where a.state = 'MANUAL_REVIEW' and a.final_reason = 'SUBMIT_UNKNOWN_UNRESOLVED' and a.provider = %(provider)s
   and a.provider_job_id is null and a.submit_started_at <= %(received)s
 order by a.submit_started_at desc, a.attempt_id
 limit %(limit)s
"""
MAPPED_NOW = "select 1 from task_attempt where provider = %s and provider_job_id = %s"


def _apply_mapped(platform, report: Report, now: datetime):
    def batch(limit: int) -> tuple[int, int]:
        def tx(conn) -> tuple[int, int]:
            rows = conn.execute(TAKE_MAPPED, {"now": now, "limit": limit}).fetchall()
            applied = 0
            for r in rows:
                key = {"provider": r["provider"], "webhook_id": r["webhook_id"], "now": now}
                try:
                    with conn.transaction():  # one bad document does not hold back the others
                        state, task_state = _apply_one(conn, platform, r, now)
                        conn.execute(MARK_DONE, {**key, "state": state, "task_state": task_state})
                except Exception as e:  # noqa: BLE001 - kept on the row, retried next run
                    conn.execute(MARK_ERROR, {**key, "error": f"{type(e).__name__}: {e}"[:1000]})
                    logger.warning("parked webhook not applied", extra={
                        "provider": r["provider"], "webhook_id": r["webhook_id"], "job_id": r["provider_job_id"],
                        "tenant_id": str(r["tenant_id"]), "task_id": str(r["task_id"]),
                        "attempt_id": str(r["attempt_id"]), "error": str(e)})
                    report.count("errors")
                    continue
                report.count(state.lower())
                applied += state == "APPLIED"
            return len(rows), applied

        return platform.db.transaction(tx)

    return batch


def _apply_one(conn, platform, r: dict, now: datetime) -> tuple[str, str | None]:
    if conn.execute(RECEIVED, (r["provider"], r["webhook_id"])).fetchone():
        return "DUPLICATE", None  # a copy of it came once the job was mapped, and was applied then
    ref = AttemptRef(r["tenant_id"], r["task_id"], r["attempt_id"], r["fencing_token"])
    applied = apply_job(conn, ref, parse_job(r["body"].get("data")), source="callback:parked", now=now,
                        media=platform.config.media)
    if applied.outcome == "STALE":
        return "STALE", applied.task_state
    conn.execute(RECORD_RECEIPT, (r["provider"], r["webhook_id"], now))
    return "APPLIED", applied.task_state


def _look_up_unmapped(platform, report: Report, t, now: datetime):
    def batch(limit: int) -> tuple[int, int]:
        rows = platform.db.transaction(lambda conn: conn.execute(TAKE_UNMAPPED, {
            "now": now, "due": now - t.retry, "oldest": now - t.age, "limit": limit}).fetchall())
        adopted = 0
        jobs = {(r["provider"], r["provider_job_id"]): r["received_at"] for r in rows}  # a job's webhooks: one search
        for (provider, job_id), received in jobs.items():
            try:
                adopted += _look_up_one(platform, report, provider, job_id, received)
            except Exception:  # noqa: BLE001 - one bad row does not stop the run; tried again when due
                logger.exception("parked webhook: lookups failed", extra={"provider": provider, "job_id": job_id})
                report.count("errors")
        return len(rows), adopted

    return batch


def _look_up_one(platform, report: Report, provider: str, job_id: str, received: datetime) -> int:
    with platform.db.connection() as conn:
        candidates = conn.execute(REVIEW_CANDIDATES, {"provider": provider, "received": received,
                                                      "limit": CANDIDATES}).fetchall()
    adopted = 0
    for attempt in candidates:  # the provider is asked outside any transaction
        with platform.db.connection() as conn:
            if conn.execute(MAPPED_NOW, (provider, job_id)).fetchone():
                break  # mapped meanwhile (by the previous candidate, or elsewhere)
        try:
            outcome = stuck_submits.check(platform, attempt, actor=ACTOR)
        except Exception:  # noqa: BLE001 - the next candidate is still looked up
            logger.exception("parked webhook: lookup of an attempt in review failed", extra={
                "provider": provider, "job_id": job_id, "tenant_id": str(attempt["tenant_id"]),
                "task_id": str(attempt["task_id"]), "attempt_id": str(attempt["attempt_id"])})
            outcome = "errors"
        report.count("errors" if outcome == "errors" else f"lookup_{outcome}")
        adopted += outcome == "adopted"
    return adopted


def run_once(platform) -> Report:
    t = tuning(platform, NAME)
    now = platform.clock.now()  # one instant per run: what this run tried is not due again in it
    report = Report(NAME)
    lookups_complete = in_batches(report, t, _look_up_unmapped(platform, report, t, now)).complete
    in_batches(report, t, _apply_mapped(platform, report, now))  # after the lookups: what they mapped is applied now
    report.complete = report.complete and lookups_complete
    with platform.db.connection() as conn:
        report.details["parked"] = conn.execute("select count(*) as n from parked_webhook where state = 'PARKED'").fetchone()["n"]
        report.details["parked_past_age"] = conn.execute(
            "select count(*) as n from parked_webhook where state = 'PARKED' and received_at <= %s",
            (now - t.age,)).fetchone()["n"]
    return report
