"""Media jobs on AWS Batch (issue 17): what functions/media_submit, functions/media_events and the
media-jobs reconciler share. The pipeline (aivedio.media.pipeline) decides; this module only speaks
Batch and S3.

- Submit: one Batch job per claimed media job, on the job queue and job definition of its media
  resource class, named `media-<task_id>-v<output_version>-<fencing_token>` (job_name), with the
  SPEC in the container's AIVEDIO_JOB_SPEC (the gpu-render worker reads it; its ENTRYPOINT is the
  worker, so the command is left as it is). A cpu-proxy job asks for vCPUs and memory in proportion
  to its worker-slot units (a 4K transcode 6 units, a 720p proxy 1), and every job's attempt timeout
  is the SPEC's own timeout plus a margin, within the class's timeout: Batch's timeout only stops a
  worker that hangs past its own.
- Complete: a "Batch Job State Change" event's `detail` and an entry of DescribeJobs' `jobs` have
  the same shape, so result_of_job() serves the event consumer and the reconciler alike: the
  RESULT the worker wrote to <outputs>result.json, else a transient "error" RESULT of the job's
  claim: MEDIA_TIMEOUT when Batch stopped it for its timeout; MEDIA_WORKER_LOST for a FAILED job
  that left none (killed, out of memory, its host gone for good, the image not pulled), as the
  local dispatcher reports a worker subprocess that exited without a RESULT; MEDIA_RESULT_INVALID
  for a SUCCEEDED one (it broke the worker's contract). A result.json whose (task_id,
  output_version, fencing_token) is not the job's (an older claim's, written to the same output
  version's prefix) is not this job's result.

AIVEDIO_MEDIA_BATCH (set by infra_cdk/media.py on the functions that submit or describe media
jobs) maps each media resource class to its Batch resources and sizes:
    {"cpu-proxy": {"queue": "<job queue ARN>", "definition": "<job definition ARN>",
                   "timeout_seconds": 3600, "vcpus_per_unit": 2, "memory_mib_per_unit": 3072}, ...}
(the two per-unit sizes only for classes sized by units)."""
from __future__ import annotations

import json
import os
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

from aivedio.media import pipeline
from aivedio.media.pipeline import MEDIA_CLASSES
from aivedio.observability import logger

BATCH_ENV = "AIVEDIO_MEDIA_BATCH"
JOB_SPEC_ENV = "AIVEDIO_JOB_SPEC"  # what containers/gpu-render/worker.py reads
RESULT_FILE = "result.json"
JOB_NAME_PREFIX = "media-"
JOB_NAME = re.compile(r"^media-(?P<task_id>[0-9a-fA-F-]{36})-v(?P<output_version>\d+)-(?P<fencing_token>\d+)$")
TIMEOUT_MARGIN_SECONDS = 300  # over the SPEC's timeout: container start, the result's upload
BATCH_MIN_TIMEOUT_SECONDS = 60  # Batch refuses a shorter attemptDurationSeconds
TERMINAL_STATUSES = ("SUCCEEDED", "FAILED")
DESCRIBE_MAX = 100  # job ids per DescribeJobs call
TIMEOUT_CODE = "MEDIA_TIMEOUT"
LOST_CODE = "MEDIA_WORKER_LOST"  # = aivedio.media.pipeline.WORKER_LOST
INVALID_CODE = "MEDIA_RESULT_INVALID"  # = aivedio.media.pipeline.RESULT_INVALID


class BatchNotConfigured(RuntimeError):
    """No AIVEDIO_MEDIA_BATCH (or no entry for a class): this process cannot submit media jobs."""


@dataclass(frozen=True)
class BatchTarget:
    """One media resource class's Batch resources."""

    queue: str
    definition: str
    timeout_seconds: int
    vcpus_per_unit: float | None = None  # a class sized by its worker-slot units (cpu-proxy)
    memory_mib_per_unit: int | None = None


def targets(environ: dict[str, str] | None = None) -> dict[str, BatchTarget]:
    """AIVEDIO_MEDIA_BATCH, parsed; {} when it is not set (locally)."""
    raw = (os.environ if environ is None else environ).get(BATCH_ENV)
    if not raw:
        return {}
    try:
        doc = json.loads(raw)
        return {name: BatchTarget(queue=t["queue"], definition=t["definition"], timeout_seconds=int(t["timeout_seconds"]),
                                  vcpus_per_unit=t.get("vcpus_per_unit"), memory_mib_per_unit=t.get("memory_mib_per_unit"))
                for name, t in doc.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise BatchNotConfigured(f"{BATCH_ENV}: expected a JSON object of media class to queue/definition: {e}") from None


def job_name(task_id: Any, output_version: int, fencing_token: int) -> str:
    """One name per attempt of a media job: a second submit of the same attempt is recognisable,
    and the events and the reconciler find the attempt from the name alone."""
    return f"{JOB_NAME_PREFIX}{task_id}-v{int(output_version)}-{int(fencing_token)}"


@dataclass(frozen=True)
class JobKey:
    task_id: str
    output_version: int
    fencing_token: int


def parse_job_name(name: str | None) -> JobKey | None:
    m = JOB_NAME.match(name or "")
    if m is None:
        return None
    return JobKey(m["task_id"].lower(), int(m["output_version"]), int(m["fencing_token"]))


# --- submit -----------------------------------------------------------------------------------

def _units(job: dict, spec: dict) -> int:
    if isinstance(job.get("units"), int) and job["units"] > 0:
        return job["units"]

    media_class = MEDIA_CLASSES.get(job.get("resource_class") or "")
    resolution = (spec.get("order") or {}).get("resolution")
    return media_class.units.get(resolution, 1) if media_class is not None else 1


def submit_request(job: dict, target: BatchTarget) -> dict[str, Any]:
    """The SubmitJob arguments for one claimed media job (a row of pipeline.claim_next, with its spec)."""
    spec = job["spec"]
    key = JobKey(str(spec.get("task_id", job.get("task_id"))), int(spec.get("output_version", job.get("output_version"))),
                 int(spec.get("fencing_token", job.get("fencing_token"))))
    overrides: dict[str, Any] = {"environment": [{"name": JOB_SPEC_ENV, "value": json.dumps(spec, separators=(",", ":"))}]}
    if target.vcpus_per_unit and target.memory_mib_per_unit:
        units = _units(job, spec)
        overrides["resourceRequirements"] = [
            {"type": "VCPU", "value": _number(units * target.vcpus_per_unit)},
            {"type": "MEMORY", "value": str(int(units * target.memory_mib_per_unit))}]
    own = float((spec.get("limits") or {}).get("timeout_seconds") or 0)
    timeout = int(min(target.timeout_seconds, max(BATCH_MIN_TIMEOUT_SECONDS, own + TIMEOUT_MARGIN_SECONDS)))
    return {"jobName": job_name(key.task_id, key.output_version, key.fencing_token), "jobQueue": target.queue,
            "jobDefinition": target.definition, "containerOverrides": overrides,
            "timeout": {"attemptDurationSeconds": timeout}}


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def submit(client, job: dict, batch_targets: dict[str, BatchTarget]) -> str:
    """SubmitJob for one claimed media job; its Batch job id (the media job's worker_ref)."""
    target = batch_targets.get(job.get("resource_class") or "")
    if target is None:
        raise BatchNotConfigured(f"{BATCH_ENV} has no Batch job queue for media class {job.get('resource_class')!r}")
    return client.submit_job(**submit_request(job, target))["jobId"]


# --- complete ---------------------------------------------------------------------------------

def spec_of_job(job: dict) -> dict | None:
    """The SPEC a Batch job runs, from its container's environment (the event's detail and
    DescribeJobs both carry it), or None."""
    for pair in ((job.get("container") or {}).get("environment") or []):
        if pair.get("name") == JOB_SPEC_ENV:
            try:
                spec = json.loads(pair.get("value") or "")
            except ValueError:
                return None
            return spec if isinstance(spec, dict) else None
    return None


def timed_out(job: dict) -> bool:
    reasons = [job.get("statusReason") or ""] + [a.get("statusReason") or "" for a in job.get("attempts") or []]
    # Batch's words for its own timeout: "Job attempt duration exceeded timeout".
    return any("exceeded timeout" in r.lower() or "timed out" in r.lower() for r in reasons)


def exit_code(job: dict) -> int | None:
    code = (job.get("container") or {}).get("exitCode")
    if code is None:
        for a in reversed(job.get("attempts") or []):
            code = (a.get("container") or {}).get("exitCode")
            if code is not None:
                break
    return code


def result_location(outputs: str) -> tuple[str, str]:
    """(bucket, key) of <outputs>result.json, for an s3:// outputs prefix."""
    parts = urllib.parse.urlsplit(outputs)
    if parts.scheme != "s3" or not parts.netloc:
        raise ValueError(f"outputs is not an s3:// prefix: {outputs!r}")
    prefix = parts.path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return parts.netloc, prefix + RESULT_FILE


def read_result(s3, outputs: str) -> dict | None:
    """The worker's result.json under `outputs`, or None where there is none (or it is not JSON)."""
    bucket, key = result_location(outputs)
    try:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as e:
        # The reader may list the outputs prefix (infra_cdk: media_list_prefixes), so a missing key is
        # NoSuchKey, not AccessDenied; anything else (a denied read, S3 down) is raised and retried.
        if getattr(e, "response", {}).get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
            return None
        raise
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def failure_result(key: JobKey, job: dict, *, code: str | None = None, why: str | None = None) -> dict:
    """The transient "error" RESULT of a Batch job that left no result of its own."""
    message = why or f"Batch job {job.get('jobId')} {job.get('status')}: {job.get('statusReason') or 'no reason given'}"
    ec = exit_code(job)
    if ec is not None:
        message += f" (exit code {ec})"
    return {"task_id": key.task_id, "output_version": key.output_version, "fencing_token": key.fencing_token,
            "status": "error", "code": TIMEOUT_CODE if timed_out(job) else (code or LOST_CODE), "message": message[:1000],
            "probe": None, "outputs": [], "transcode_seconds": 0.0, "bytes_stored": 0}


def _same_job(result: dict, key: JobKey) -> bool:
    try:
        return (str(result.get("task_id")).lower() == key.task_id and int(result.get("output_version")) == key.output_version
                and int(result.get("fencing_token")) == key.fencing_token)
    except (TypeError, ValueError):
        return False


def result_of_job(job: dict, s3) -> dict | None:
    """The RESULT for pipeline.complete() of a finished Batch media job (an event's detail or a
    DescribeJobs entry); None for a job that is not a media job of this platform or not finished."""
    key = parse_job_name(job.get("jobName"))
    if key is None or job.get("status") not in TERMINAL_STATUSES:
        return None
    spec = spec_of_job(job)
    outputs = (spec or {}).get("outputs")
    if not isinstance(outputs, str) or not outputs.startswith("s3://"):
        return failure_result(key, job, code=INVALID_CODE,
                              why=f"Batch job {job.get('jobId')} {job.get('status')}: its SPEC names no s3:// outputs")
    result = read_result(s3, outputs)
    if result is not None and _same_job(result, key):
        return result
    if job.get("status") == "SUCCEEDED":
        return failure_result(key, job, code=INVALID_CODE,
                              why=f"Batch job {job.get('jobId')} SUCCEEDED but left no result.json of its own under {outputs}")
    return failure_result(key, job)


def describe(client, job_ids) -> dict[str, dict]:
    """DescribeJobs in batches of 100: job id -> job. A job Batch no longer knows (it keeps
    finished jobs for about a week) is absent from the answer."""
    ids = list(dict.fromkeys(str(j) for j in job_ids if j))
    out: dict[str, dict] = {}
    for i in range(0, len(ids), DESCRIBE_MAX):
        for job in client.describe_jobs(jobs=ids[i:i + DESCRIBE_MAX]).get("jobs", []):
            out[job["jobId"]] = job
    return out


def clients(extras: dict) -> tuple[Any, Any]:
    """(batch, s3) clients, kept in platform.extras (tests put moto's there first)."""
    for key, service in (("batch_client", "batch"), ("s3_client", "s3")):
        if extras.get(key) is None:
            import boto3  # lazy: boto3 takes most of a second to import, and only the AWS path needs it

            extras[key] = boto3.client(service)  # once per process: a cold start pays for it, not each call
    return extras["batch_client"], extras["s3_client"]


# --- the two sides, as the functions run them ------------------------------------------------

def dispatch(platform, *, limit: int, seconds_left=lambda: 60.0, reserve_seconds: float = 10.0) -> dict[str, int]:
    """Claim media jobs whose worker slots fit (pipeline.claim_next: RUNNING, task MEDIA_PROCESSING,
    fencing token bumped, in one transaction) and submit each to Batch, then record its Batch job id
    (pipeline.mark_started, fenced). Claims until a claim comes back short or time runs out.

    A submit that fails leaves its job RUNNING without a worker: the media-jobs reconciler retries it
    (same output version) once its lease is past. A job whose fencing token moved on between the
    claim and mark_started (the reconciler took it back) is reported `stale`: its Batch job's result
    will be STALE for complete() and change nothing. A claim is never submitted twice: claim_next
    hands each (job, fencing token) to one caller only."""
    batch_targets = targets()
    if not batch_targets:
        raise BatchNotConfigured(f"{BATCH_ENV} is not set: no Batch job queues to submit media jobs to")
    client, _ = clients(platform.extras)
    counts = {"claimed": 0, "submitted": 0, "failed": 0, "stale": 0}
    while seconds_left() > reserve_seconds:
        now = platform.clock.now()
        jobs = platform.db.transaction(lambda conn: pipeline.claim_next(platform, conn, now=now, limit=limit))
        counts["claimed"] += len(jobs)
        for job in jobs:
            spec = job["spec"]
            key = JobKey(str(spec["task_id"]), int(spec["output_version"]), int(spec["fencing_token"]))
            log = {"task_id": key.task_id, "output_version": key.output_version, "fencing_token": key.fencing_token,
                   "media_class": job.get("resource_class")}
            try:
                job_id = submit(client, job, batch_targets)
            except Exception:
                counts["failed"] += 1
                logger.exception("media job submit failed; the media-jobs reconciler retries it", extra=log)
                continue
            try:
                started = platform.db.transaction(lambda conn: pipeline.mark_started(
                    conn, task_id=key.task_id, output_version=key.output_version, fencing_token=key.fencing_token,
                    worker_ref=job_id, now=platform.clock.now()))
            except Exception:  # the job runs and its event completes it (complete() is fenced, not by worker_ref)
                counts["failed"] += 1
                logger.exception("media job submitted, but its Batch job id was not recorded",
                                 extra={**log, "batch_job_id": job_id})
                continue
            counts["submitted" if started else "stale"] += 1
            logger.info("media job submitted" if started else "media job submitted, but its claim moved on",
                        extra={**log, "batch_job_id": job_id})
        if len(jobs) < limit:
            break
    return counts


def complete_job(platform, job: dict) -> str | None:
    """Complete the media job of one finished Batch job (an event's detail, or DescribeJobs'):
    pipeline.complete's outcome, or None when the job is not one of ours or not finished."""
    _, s3 = clients(platform.extras)
    result = result_of_job(job, s3)
    if result is None:
        return None

    def apply(doc: dict) -> str:
        return platform.db.transaction(lambda conn: pipeline.complete(conn, doc, now=platform.clock.now(), platform=platform))

    try:
        return apply(result)
    except pipeline.MediaResultInvalid as e:  # a result.json of this job that is not a RESULT: the worker's fault
        key = parse_job_name(job.get("jobName"))
        return apply(failure_result(key, job, code=INVALID_CODE, why=f"result.json of Batch job {job.get('jobId')}: {e}"))
