"""Room service `media-jobs` (issue 17; ch. 18.16.6): media jobs whose worker went away without a word.

A RUNNING media job has a lease (the worker's own timeout plus [media] lease_margin_seconds); a
worker that reports in time never meets this service. Past the lease (and `age_seconds` more), the
job's worker is asked about:

- no worker recorded (the dispatcher died between the claim and the start, or the submit failed):
  retried;
- a local worker (`pid:<n>`): a pid that is gone, or that is no longer this job's worker (its command
  line does not name the job's task and fencing token), is lost: retried. One still running past its
  lease has hung: it is killed (SIGKILL, only after that check), and retried;
- an AWS Batch job: DescribeJobs (aivedio.media.batch). Finished: its RESULT (result.json, or the
  error RESULT of a job that left none) is applied, as the lost state-change event would have.
  Still queued or running: its lease is extended (Batch's own timeout bounds it). Unknown to Batch:
  retried. Without Batch configured in this process, left for a person (`unknown_worker`).

"Retried" is pipeline.complete() with a transient error RESULT of the job's own claim
(MEDIA_WORKER_LOST): the same fenced path as a worker's own failure, so the job goes back to PENDING
with the SAME output version while tries remain (a result of the lost worker arriving later is
STALE once the job is claimed again, and a duplicate of the same claim is refused), and the task
ends MEDIA_INGEST_FAILED once they are spent. A retry after a kill mid-transcode therefore ends
with one output version and no duplicate task_output rows.

Rows are taken in lease order, each under its task's row lock (SKIP LOCKED: a completing worker's
own transaction is never waited for), one transaction per job."""
from __future__ import annotations

import os
import signal
from datetime import datetime
from pathlib import Path

from aivedio.media import batch, pipeline
from aivedio.observability import logger
from aivedio.reconcile.room import Defaults, Report, in_batches, tuning

NAME = "media-jobs"
# Every minute; a job is looked at once its lease is a minute past.
DEFAULTS = Defaults(interval_seconds=60.0, batch_size=100, max_batches=10, age_seconds=60.0)

OVERDUE = """
select task_id, tenant_id, output_version, fencing_token, worker_ref, lease_until from media_job
 where state = 'RUNNING' and lease_until <= %(cutoff)s
   and (lease_until, task_id, output_version) > (%(after_lease)s, %(after_task)s, %(after_version)s)
 order by lease_until, task_id, output_version
 limit %(limit)s
"""
LOCKED_JOB = """
select m.* from generation_task t join media_job m on m.task_id = t.task_id
 where t.tenant_id = %(tenant)s and t.task_id = %(task)s and m.output_version = %(version)s
   for update of t skip locked
"""
EXTEND = "update media_job set lease_until = %s, updated_at = %s where task_id = %s and output_version = %s and fencing_token = %s"
_MIN_UUID = "00000000-0000-0000-0000-000000000000"


def local_worker(ref: str, job: dict) -> str:
    """What became of a local worker: "gone" or "alive" (still this job's worker)."""
    try:
        pid = int(ref.split(":", 1)[1])
    except (IndexError, ValueError):
        return "gone"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return "gone"
    mine = str(job["task_id"]) in cmdline and f'"fencing_token":{int(job["fencing_token"])}' in cmdline.replace(" ", "")
    return "alive" if mine else "gone"


def _kill(ref: str) -> None:
    try:
        os.kill(int(ref.split(":", 1)[1]), signal.SIGKILL)
    except (OSError, ValueError):
        pass


def _batch_verdicts(platform, jobs: list[dict]) -> dict[str, dict | None]:
    """Batch job id -> the DescribeJobs entry (None: unknown to Batch), for the Batch refs of `jobs`;
    {} without Batch in this process."""
    ids = [j["worker_ref"] for j in jobs if j["worker_ref"] and not j["worker_ref"].startswith("pid:")]
    if not ids or not batch.targets():
        return {}
    client, _ = batch.clients(platform.extras)
    found = batch.describe(client, ids)
    return {i: found.get(i) for i in ids}


def repair_one(platform, row: dict, described: dict[str, dict | None], now: datetime, report: Report) -> bool:
    """One overdue job, in its own transaction. True when it was repaired (retried, failed or completed)."""
    ref = row["worker_ref"] or ""
    lost_why: str | None = None
    batch_job = None
    if not ref:
        lost_why = "no worker was started for the claim"
    elif ref.startswith("pid:"):
        if local_worker(ref, row) == "alive":
            _kill(ref)
            report.count("killed_hung")
            lost_why = f"the local worker {ref} ran past its lease and was killed"
        else:
            lost_why = f"the local worker {ref} is gone"
    elif ref in described:
        batch_job = described[ref]
        if batch_job is None:
            lost_why = f"Batch no longer knows job {ref}"
    else:
        report.count("unknown_worker")
        return False

    def tx(conn) -> str | None:
        job = conn.execute(LOCKED_JOB, {"tenant": row["tenant_id"], "task": row["task_id"], "version": row["output_version"]}).fetchone()
        if job is None or job["state"] != "RUNNING" or job["fencing_token"] != row["fencing_token"]:
            return None  # its task is locked (a result being applied), or it moved on since the scan
        if batch_job is not None and lost_why is None:
            _, s3 = batch.clients(platform.extras)
            result = batch.result_of_job(batch_job, s3)
            if result is None:  # still queued or running at Batch: it is bounded by Batch's own timeout
                conn.execute(EXTEND, (now + pipeline.lease_for(platform), now, job["task_id"], job["output_version"],
                                      job["fencing_token"]))
                return "extended"
            return pipeline.complete(conn, result, now=now, platform=platform)
        return pipeline.complete(conn, pipeline.error_result(job, pipeline.WORKER_LOST, lost_why or "worker lost"),
                                 now=now, platform=platform)

    outcome = platform.db.transaction(tx)
    if outcome is None:
        report.count("skipped")
        return False
    report.count(outcome.lower())
    if outcome == pipeline.FAILED:
        pipeline.remove_outputs(pipeline.outputs_location(platform, row), platform)
    log = logger.info if outcome == "extended" else logger.warning
    log("media job past its lease", extra={"tenant_id": str(row["tenant_id"]), "task_id": str(row["task_id"]),
                                          "output_version": row["output_version"], "worker_ref": ref or None,
                                          "why": lost_why or "its Batch job finished", "outcome": outcome})
    return outcome != "extended"


def run_once(platform) -> Report:
    t = tuning(platform, NAME)
    now = platform.clock.now()
    cutoff = now - t.age
    report = Report(NAME)
    cursor = {"after_lease": datetime.min.replace(tzinfo=now.tzinfo), "after_task": _MIN_UUID, "after_version": 0}

    def batch(limit: int) -> tuple[int, int]:
        with platform.db.connection() as conn:
            rows = conn.execute(OVERDUE, {"cutoff": cutoff, "limit": limit, **cursor}).fetchall()
        if rows:
            last = rows[-1]
            cursor.update(after_lease=last["lease_until"], after_task=last["task_id"], after_version=last["output_version"])
        described = _batch_verdicts(platform, rows)
        repaired = sum(repair_one(platform, r, described, now, report) for r in rows)
        return len(rows), repaired

    in_batches(report, t, batch)
    for k in ("retry", "failed", "applied"):
        report.details.setdefault(k, 0)
    return report
