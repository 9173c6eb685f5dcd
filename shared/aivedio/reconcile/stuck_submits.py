"""Room service `stuck-submits` (ch. 18.15, 18.16.6 UnknownSubmissionReconciler): a submit that stayed
unknown past the safe window is not given up on. The attempt workflow hands such an attempt to
MANUAL_REVIEW (SUBMIT_UNKNOWN_UNRESOLVED) with its reservations kept; this service keeps looking
it up by its idempotency key, at a lower rate (once per `retry_seconds` per attempt, recorded in
task_attempt.review_checked_at), and:
- adopts the job when the lookup finds it, by the code path of `aivedio admin review resolve
  --action adopt` (aivedio.attempts.review.adopt_job): the attempt is live again and the lease
  scanner starts its workflow;
- requeues the task only when absence is provable by the workflow's own rule (an empty answer
  inside the provider's idempotency window: steps.absence_proven), never on its own otherwise;
- leaves it for a person in every other case (the provider still failing, its empty answer
  outside its window, or the provider no longer in the config: provider_unknown), to be asked again
  later.
One attempt that cannot be handled (an unexpected error) is logged with its ids and counted as
`errors`, and the run goes on: it is asked again at its next due time.
Each run also publishes the number of tasks in review (ManualReviewOpen).

Stuck DISPATCHING is the lease scanner's (attempt-recovery): a DISPATCHING attempt has a lease from
its claim, so one whose execution was lost is restarted when the lease expires, and its submit step
sends (never sent) or marks it SUBMIT_UNKNOWN (maybe sent). Other reasons for review
(PROVIDER_LOST_JOB, RECOVERY_EXHAUSTED) wait for a person: looking them up again would not tell
more than the workflow already heard."""
from __future__ import annotations

from aivedio.attempts import review
from aivedio.attempts.lifecycle import AttemptRef
from aivedio.metrics_catalog import MANUAL_REVIEW_OPEN
from aivedio.observability import logger, publish
from aivedio.reconcile.room import Defaults, Report, in_batches, tuning

NAME = "stuck-submits"
ACTOR = f"maintenance:{NAME}"
# Every minute, attempts due for a lookup in batches of 50; each attempt asked at most every 15 minutes
# (the workflow asked every unknown_backoff_max_seconds, 60 s by default, before it gave up).
DEFAULTS = Defaults(interval_seconds=60.0, batch_size=50, max_batches=10, retry_seconds=900.0)

# Due attempts, marked as asked now in the same statement, so a second run at once takes others.
TAKE_DUE = """
update task_attempt a set review_checked_at = %(now)s, review_checks = a.review_checks + 1
 where a.attempt_id in (
       select a2.attempt_id from task_attempt a2
         join generation_task t on t.tenant_id = a2.tenant_id and t.task_id = a2.task_id
                               and t.current_attempt_id = a2.attempt_id and t.current_fencing_token = a2.fencing_token
        where a2.state = 'MANUAL_REVIEW' and a2.final_reason = 'SUBMIT_UNKNOWN_UNRESOLVED' and a2.provider_job_id is null
          and t.state = 'MANUAL_REVIEW'
          and (a2.review_checked_at is null or a2.review_checked_at < %(due)s)
        order by a2.review_checked_at nulls first, a2.attempt_id
        limit %(limit)s
          for update of a2 skip locked)
returning a.*
"""


def check(platform, attempt: dict, *, actor: str = ACTOR) -> str:
    """Look one attempt in review up and act on what the provider says. Returns the outcome:
    adopted | requeued | lookup_failed | provider_unknown | still_unknown | refused | moved (it left
    review meanwhile)."""
    ref = AttemptRef(attempt["tenant_id"], attempt["task_id"], attempt["attempt_id"], attempt["fencing_token"])
    found = review.look(platform, attempt)
    if found.provider_unknown:  # nobody can ask it: a person fails the task (`admin review resolve --action fail`)
        logger.warning("attempt in review: its provider is not in the config",
                       extra={**ref.log(), "provider": attempt["provider"]})
        return "provider_unknown"
    try:
        if found.job is not None:
            platform.db.transaction(lambda conn: review.adopt_job(
                conn, platform, ref, found.job, actor=actor, reason="the lookup by key found the job", evidence=found.evidence))
            return "adopted"
        if found.proof is not None:
            platform.db.transaction(lambda conn: review.requeue_absent(
                conn, platform, ref, proof=found.proof, actor=actor, reason="the lookup by key proved absence",
                evidence=found.evidence))
            return "requeued"
    except review.ReviewRefused as e:
        logger.warning("attempt in review not resolved", extra={**ref.log(), "code": e.code, "detail": e.message})
        return "moved" if e.code == "TASK_NOT_IN_REVIEW" else "refused"
    return "lookup_failed" if found.error is not None else "still_unknown"


def run_once(platform) -> Report:
    t = tuning(platform, NAME)
    report = Report(NAME)
    now = platform.clock.now()  # one instant per run: what this run asked is not due again in it

    def batch(limit: int) -> tuple[int, int]:
        rows = platform.db.transaction(lambda conn: conn.execute(
            TAKE_DUE, {"now": now, "due": now - t.retry, "limit": limit}).fetchall())
        repaired = 0
        for row in rows:  # the provider is asked outside any transaction
            try:
                outcome = check(platform, row)
            except Exception:  # noqa: BLE001 - one bad attempt does not stop the run; asked again when due
                logger.exception("stuck submit not checked", extra={
                    "tenant_id": str(row["tenant_id"]), "task_id": str(row["task_id"]), "attempt_id": str(row["attempt_id"])})
                outcome = "errors"
            report.count(outcome)
            repaired += outcome in ("adopted", "requeued")
        return len(rows), repaired

    in_batches(report, t, batch)
    with platform.db.connection() as conn:
        open_reviews = review.count_open(conn)
    report.details["open_reviews"] = open_reviews
    publish(MANUAL_REVIEW_OPEN, open_reviews)
    return report
