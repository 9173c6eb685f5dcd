"""The media pipeline (issue 17; ch. 18.5.4, 18.13, 18.17.5, 20.7.8): every provider success becomes a
checked, playable video in the platform's own storage before the task is SUCCEEDED.

1. The provider reports success (aivedio.attempts.lifecycle.apply_job with the pipeline enabled,
   `[media] enabled`): the attempt side moves the task to PROVIDER_SUCCEEDED and finishes the attempt
   as the provider's (its slots released, its cost and BILLABLE state on it, as for any success),
   then hands the provider's report to queue_job(), which writes the task's media_job (output
   version 1, PENDING), in the same transaction. No terminal event yet.
2. A dispatcher (the local media loop, aivedio_tools.local.media_dispatch; in AWS media.batch.dispatch) calls
   claim_next(): PENDING jobs whose worker slots fit are reserved through the claim's own machinery
   (resource_reservation rows of the task's attempt on the pool worker:<media class>, a conditional
   increment of its shard), the task moves PROVIDER_SUCCEEDED -> MEDIA_PROCESSING by CAS, the job
   gets a new fencing token and goes RUNNING with its SPEC. Each media class has its own pool, and
   each class is scanned on its own, so a flood of 4K work cannot take the proxy slots nor hide the
   proxy work behind it.
3. The worker (containers/gpu-render/worker.py, operation "ingest") fetches, probes, transcodes and
   stores, and reports a RESULT; complete() applies it, fenced on (task_id, output_version,
   fencing_token) and idempotent: the first valid result wins, a duplicate changes nothing (DUPLICATE),
   a result of an older claim changes nothing (STALE). OK: the task_output rows (the platform's own
   object keys, one per asset type, under the job's output version), media_cost_event rows (transcode
   seconds, stored bytes), the worker slots released, the task SUCCEEDED and its TaskSucceeded event.
   A transient error with tries left: the job is PENDING again with backoff and the SAME output
   version (RETRY; the task stays MEDIA_PROCESSING). Bad media, or tries spent: the task ends
   MEDIA_INGEST_FAILED (terminal) with the worker's code, its slots released, and its
   TaskMediaIngestFailed event, which settlement prices with the charge policy's rule for an
   undelivered result (FAILED/MEDIA_DELIVERY_FAILED: nothing under SUCCESS_ONLY, the provider's cost
   then being the platform's).
4. The tenant sees the outputs by the platform's URLs only (aivedio.media.urls).
5. A lost worker is found by the media-jobs service of the maintenance room
   (aivedio.reconcile.media_jobs), which retries it through complete() with the same output version.

Lock order, everywhere: the task row, then its media_job row, then the pool shards (the claim's
order). Every function here runs in the caller's transaction."""
from __future__ import annotations

import ipaddress
import mimetypes
import shutil
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit
from uuid import UUID

import psycopg
from psycopg.types.json import Jsonb
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from aivedio import tasks
from aivedio.errors import DomainError
from aivedio.media import storage_cost
from aivedio.metrics_catalog import TASKS_FINISHED
from aivedio.observability import logger, publish
from aivedio.scheduling.resources import (
    ensure_pools,
    media_pool_key,
    media_pool_units,
    preferred_shard,
    release_attempt,
    release_keys,
    reserve_key,
    rooms,
)
from aivedio.spend.costs import QUANTUM, MediaCost, record_media_costs
from aivedio.terminal_events import close_reopened_attempt, write_terminal_event

OPERATION = "ingest"
FIRST_VERSION = 1
ASSET_TYPES = ("proxy", "thumbnail", "delivery")
STAGE_FAILED = "MEDIA_DELIVERY_FAILED"  # the charge policies' stage for a result the platform could not deliver
# What complete() answers.
APPLIED, DUPLICATE, STALE, RETRY, FAILED = "APPLIED", "DUPLICATE", "STALE", "RETRY", "FAILED"
# Codes the platform itself gives a try (the worker's own are in the RESULT); all map to the tenant's
# MEDIA_PROCESSING_FAILED (aivedio.tenant_errors).
WORKER_LOST = "MEDIA_WORKER_LOST"  # the worker went away without a result (killed, lost event, lease past)
RESULT_INVALID = "MEDIA_RESULT_INVALID"  # the worker's RESULT broke its contract
NO_SOURCE = "MEDIA_FETCH_FAILED"  # the provider reported success with no output URL


@dataclass(frozen=True)
class MediaClass:
    name: str
    pool_key: str  # the resource_pool_shard key its worker slots are reserved on
    units: dict[str, int]  # resolution -> worker-slot units per job
    cost_kind: str  # media_cost_event.kind of its transcode time


# ch. 18.5.4: a 720p proxy 1 CPU unit, 1080p 2, a 4K transcode 6; a GPU render 1 GPU unit, a
# high-memory render 2.
MEDIA_CLASSES: dict[str, MediaClass] = {
    "cpu-proxy": MediaClass("cpu-proxy", media_pool_key("cpu-proxy"), {"480p": 1, "720p": 1, "1080p": 2, "4k": 6}, "TRANSCODE"),
    "gpu-render": MediaClass("gpu-render", media_pool_key("gpu-render"), {"480p": 1, "720p": 1, "1080p": 1, "4k": 1}, "GPU_RENDER"),
    "gpu-highmem": MediaClass("gpu-highmem", media_pool_key("gpu-highmem"), {"480p": 2, "720p": 2, "1080p": 2, "4k": 2},
                              "GPU_RENDER"),
}


class MediaResultInvalid(DomainError):
    """A RESULT that names no media job: it cannot even be fenced."""

    code = "MEDIA_RESULT_INVALID"


def is_final(task: dict) -> bool:
    """A final render gets the delivery encode too. An interactive task is a preview the user waits
    on: a proxy and a thumbnail serve it."""
    return not task["interactive"]


def media_class_of(task: dict) -> str:
    """Which media resource class a task's media job needs: a 4K output is a high-memory GPU job,
    a final 1080p render's delivery encode a GPU render, everything else a CPU proxy job."""
    if task["resolution"] == "4k":
        return "gpu-highmem"
    if task["resolution"] == "1080p" and is_final(task):
        return "gpu-render"
    return "cpu-proxy"


def slot_units(media_class: str, resolution: str) -> int:
    return MEDIA_CLASSES[media_class].units[resolution]


def retention_class(task: dict) -> str:
    return "final" if is_final(task) else "proxy"


# --- where outputs live -------------------------------------------------------------------------------

def key_prefix(tenant_id: Any, task_id: Any, output_version: int) -> str:
    """The platform's object keys of one output version: outputs/<tenant>/<task>/v<version>/."""
    return f"outputs/{tenant_id}/{task_id}/v{int(output_version)}/"


# platform.extras: the local runtime's media dispatcher (aivedio_tools.local.media_dispatch.run_local),
# which functions/media_submit calls where no AWS Batch is configured.
LOCAL_DISPATCHER = "local_media_dispatcher"


def media_root(platform) -> Path:
    """The local media directory ([media] local_dir, else <AIVEDIO_HOME>/media): keys are relative to it."""
    return Path(platform.config.media.local_dir or Path(platform.settings.home) / "media").resolve()


def remove_outputs(outputs: str, platform) -> None:
    """Remove a local output directory (a failed task's partial outputs); never outside the media root."""
    if outputs.startswith("s3://"):
        return
    path = Path(outputs).resolve()
    root = media_root(platform)
    if path != root and root in path.parents and path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def outputs_location(platform, job_row: dict) -> str:
    """The SPEC's `outputs`: the media bucket's prefix in AWS (s3://bucket/outputs/...), else the
    local directory of the same key prefix (with a trailing slash)."""
    prefix = key_prefix(job_row["tenant_id"], job_row["task_id"], job_row["output_version"])
    if platform.settings.media_bucket:
        return f"s3://{platform.settings.media_bucket}/{prefix}"
    return str(media_root(platform) / prefix) + "/"


def _normalized_key(platform, job: dict, raw: Any) -> str | None:
    """A RESULT output's key as the platform's object key (relative to the bucket or the media
    root), or None when it is not inside the job's own prefix."""
    if not isinstance(raw, str) or not raw:
        return None
    prefix = key_prefix(job["tenant_id"], job["task_id"], job["output_version"])
    key = raw
    if raw.startswith("s3://"):
        parts = urlsplit(raw)
        key = parts.path.lstrip("/")
    elif raw.startswith("/"):
        try:
            key = Path(raw).resolve().relative_to(media_root(platform)).as_posix()
        except ValueError:
            return None
    elif not raw.startswith("outputs/"):
        key = prefix + raw  # a file name under the job's outputs
    norm = PurePosixPath(key)
    if ".." in norm.parts or not str(norm).startswith(prefix) or str(norm) == prefix.rstrip("/"):
        return None
    return str(norm)


# --- the SPEC -----------------------------------------------------------------------------------------

def _allow_private(platform, job_row: dict) -> bool:
    """True only for a built-in provider simulator (no base_url) serving on the loopback: the one
    source a worker may fetch from a private address."""
    cfg = platform.config.provider(job_row.get("provider") or "")
    if cfg is None or cfg.base_url is not None:
        return False
    host = urlsplit(job_row["source_url"]).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_spec(platform, job_row: dict, *, outputs: str) -> dict:
    """The SPEC of one claim of a media job. `job_row` is a media_job row with the task's order
    (duration_seconds, resolution, with_audio, interactive, project_id) and the attempt's provider,
    as claim_next reads it."""
    m = platform.config.media
    rc = retention_class(job_row)
    return {
        "operation": OPERATION, "task_id": str(job_row["task_id"]), "tenant_id": str(job_row["tenant_id"]),
        "project": job_row.get("project_id"), "attempt_id": str(job_row["attempt_id"]),
        "output_version": int(job_row["output_version"]), "fencing_token": int(job_row["fencing_token"]),
        "source_url": job_row["source_url"],
        "order": {"duration_seconds": int(job_row["duration_seconds"]), "resolution": job_row["resolution"],
                  "with_audio": bool(job_row["with_audio"]), "final": is_final(job_row)},
        "outputs": outputs,
        "limits": m.limits.model_dump(mode="json"),
        "allow_private_addresses": _allow_private(platform, job_row),
        "retention_class": rc,
        "tags": {"tenant_id": str(job_row["tenant_id"]), "project": job_row.get("project_id"),
                 "task_id": str(job_row["task_id"]), "retention_class": rc},
    }


# --- 1. the provider's success ------------------------------------------------------------------------

LATEST_JOB = "select * from media_job where task_id = %s order by output_version desc limit 1 for update"
INSERT_FIRST_JOB = """
insert into media_job (task_id, tenant_id, output_version, attempt_id, fencing_token, resource_class, slot_units,
                       state, tries, max_tries, next_eligible_at, source_url, provider_report, created_at, updated_at)
values (%(task)s, %(tenant)s, %(version)s, %(attempt)s, nextval('fencing_token_seq'), %(class)s, %(units)s,
        'PENDING', 0, %(max_tries)s, %(now)s, %(source)s, %(report)s, %(now)s, %(now)s)
on conflict (task_id, output_version) do nothing
returning *"""


def latest_job(conn: psycopg.Connection, task_id) -> dict | None:
    """The task's newest media job, locked (the caller holds the task's row lock)."""
    return conn.execute(LATEST_JOB, (task_id,)).fetchone()


def queue_job(conn: psycopg.Connection, task: dict, attempt: dict, *, report: dict, source_url: str, now: datetime,
              media, released: int = 0) -> str:
    """The media step takes over a provider's success (aivedio.attempts.lifecycle hands it here, under
    the task's row lock, once the task is PROVIDER_SUCCEEDED and the attempt finished): the task's
    first media job, PENDING, with the provider's report kept on it for the terminal event it will
    write. A success without an output URL delivers nothing: the task ends MEDIA_INGEST_FAILED at
    once. Returns the task's state after it."""
    media_class = media_class_of(task)
    row = conn.execute(INSERT_FIRST_JOB, {
        "task": task["task_id"], "tenant": task["tenant_id"], "version": FIRST_VERSION, "attempt": attempt["attempt_id"],
        "class": media_class, "units": slot_units(media_class, task["resolution"]), "max_tries": media.max_tries,
        "now": now, "source": source_url, "report": Jsonb(report)}).fetchone()
    logger.info("provider succeeded; media job queued", extra={
        "tenant_id": str(task["tenant_id"]), "task_id": str(task["task_id"]), "attempt_id": str(attempt["attempt_id"]),
        "media_class": media_class, "output_version": FIRST_VERSION, "reservations_released": released})
    if not source_url:  # nothing to fetch: the provider's success delivers nothing
        task = conn.execute("select * from generation_task where task_id = %s", (task["task_id"],)).fetchone()
        _fail(conn, task, row, code=NO_SOURCE, message="the provider reported success without an output URL", now=now)
        return "MEDIA_INGEST_FAILED"
    return "PROVIDER_SUCCEEDED"


# --- 2. the claim -------------------------------------------------------------------------------------

# A class's eligible PENDING jobs in weighted fair order (the media slots are a binding pool like a
# provider account, issue 14): a tenant's jobs, in its own order, rank at (its RUNNING units in the
# class + the units of its jobs up to this one) / its weight, so the slots go to the backlogged
# tenants in proportion to their weights, and a tenant with little running goes first; oldest first
# among equals. Oldest first across tenants gave the slots to whoever's provider work finished first.
PENDING_OF_CLASS = """
with running as (
  select tenant_id, sum(slot_units) as units from media_job
   where state = 'RUNNING' and resource_class = %(class)s
   group by tenant_id),
pending as (
  select task_id, tenant_id, output_version, next_eligible_at, created_at,
         sum(slot_units) over (partition by tenant_id order by next_eligible_at, created_at, task_id) as units_upto
    from media_job
   where state = 'PENDING' and resource_class = %(class)s and next_eligible_at <= %(now)s)
select p.task_id, p.tenant_id, p.output_version
  from pending p
  left join running r on r.tenant_id = p.tenant_id
  left join tenant_scheduling_policy sp on sp.tenant_id = p.tenant_id
 order by (coalesce(r.units, 0) + p.units_upto)::numeric / greatest(coalesce(sp.weight, 1), 1),
          p.next_eligible_at, p.created_at, p.task_id
 limit %(limit)s
"""
JOB_WITH_ORDER = """
select m.*, t.duration_seconds, t.resolution, t.with_audio, t.interactive, t.project_id, a.provider
  from media_job m
  join generation_task t on t.tenant_id = m.tenant_id and t.task_id = m.task_id
  join task_attempt a on a.attempt_id = m.attempt_id
 where m.task_id = %(task)s and m.output_version = %(version)s
   for update of m
"""


def ensure_media_pools(platform, conn: psycopg.Connection) -> None:
    """The media pools, once per process (aivedio.bootstrap creates them with every pool at a
    start; this covers a caller that never ran it). An operator's resize stands: an existing pool
    is left as it is."""
    if platform.extras.get("media_pools_ensured"):
        return
    keys = {media_pool_key(c): u for c, u in media_pool_units(platform.config).items()}
    have = {r["resource_key"] for r in conn.execute(
        "select distinct resource_key from resource_pool_shard where resource_key = any(%s)", (list(keys),)).fetchall()}
    missing = [(k, u, 1) for k, u in sorted(keys.items()) if k not in have]
    if missing:
        ensure_pools(conn, missing)
    platform.extras["media_pools_ensured"] = True


def lease_for(platform) -> timedelta:
    """How long a RUNNING job goes unasked: the worker's own timeout (real seconds) plus the margin."""
    m = platform.config.media
    return timedelta(seconds=m.limits.timeout_seconds) + platform.clock.delta(m.lease_margin_seconds)


def claim_next(platform, conn: psycopg.Connection, *, now: datetime, limit: int) -> list[dict]:
    """Claim up to `limit` PENDING media jobs whose worker slots fit, in the caller's transaction:
    each RUNNING with a new fencing token, its slots reserved, its task MEDIA_PROCESSING. Returns the
    claimed media_job rows, each with its `spec` and `units` (its worker-slot units). Classes are
    scanned one by one (a full pool is skipped without a look at its jobs), jobs in weighted fair
    order between tenants (PENDING_OF_CLASS); a job whose task another transaction holds is left
    for the next run (SKIP LOCKED)."""
    ensure_media_pools(platform, conn)
    lease_until = now + lease_for(platform)
    free = {k: r.room for k, r in rooms(conn, [c.pool_key for c in MEDIA_CLASSES.values()]).items()}
    claimed: list[dict] = []
    for media_class in MEDIA_CLASSES.values():
        if len(claimed) >= limit:
            break
        if free.get(media_class.pool_key, 0) <= 0:
            continue
        candidates = conn.execute(PENDING_OF_CLASS, {"class": media_class.name, "now": now, "limit": limit}).fetchall()
        for cand in candidates:
            if len(claimed) >= limit:
                break
            with conn.transaction():  # a savepoint: a job that does not fit leaves nothing behind
                got = _claim_one(platform, conn, cand, media_class, now=now, lease_until=lease_until)
            if got is not None:
                claimed.append(got)
    return claimed


def _claim_one(platform, conn: psycopg.Connection, cand: dict, media_class: MediaClass, *, now: datetime,
               lease_until: datetime) -> dict | None:
    task = conn.execute("select * from generation_task where tenant_id = %s and task_id = %s for update skip locked",
                        (cand["tenant_id"], cand["task_id"])).fetchone()
    if task is None:
        return None
    job = conn.execute(JOB_WITH_ORDER, {"task": cand["task_id"], "version": cand["output_version"]}).fetchone()
    if job is None or job["state"] != "PENDING" or job["next_eligible_at"] > now:
        return None
    if task["state"] not in ("PROVIDER_SUCCEEDED", "MEDIA_PROCESSING"):
        if tasks.is_terminal(task["state"]):  # ended another way (an operator): the job has nothing left to do
            conn.execute("""update media_job set state = 'FAILED', error_code = 'TASK_TERMINAL', finished_at = %s, updated_at = %s
                             where task_id = %s and output_version = %s""", (now, now, job["task_id"], job["output_version"]))
        return None  # CANCEL_REQUESTED: the reopened workflow gives the task back to the media step first
    units = int(job["slot_units"])
    token = conn.execute("select nextval('fencing_token_seq') as t").fetchone()["t"]
    shard = reserve_key(conn, task_id=job["task_id"], tenant_id=job["tenant_id"], attempt_id=job["attempt_id"],
                        key=media_class.pool_key, units=units, fencing_token=token, lease_until=lease_until, now=now,
                        prefer=preferred_shard(job["task_id"]))
    if shard is None:
        return None
    if task["state"] == "PROVIDER_SUCCEEDED":
        moved = tasks.cas_transition(conn, tenant_id=task["tenant_id"], task_id=task["task_id"], from_state="PROVIDER_SUCCEEDED",
                                     version=task["version"], to_state="MEDIA_PROCESSING", now=now)
        if moved is None:
            raise RuntimeError(f"task {task['task_id']} moved under its row lock")
    spec = build_spec(platform, {**job, "fencing_token": token}, outputs=outputs_location(platform, job))
    row = conn.execute(
        """update media_job set state = 'RUNNING', fencing_token = %(token)s, tries = tries + 1, lease_until = %(lease)s,
                                spec = %(spec)s, worker_ref = null, started_at = %(now)s, updated_at = %(now)s
            where task_id = %(task)s and output_version = %(version)s
        returning *""",
        {"token": token, "lease": lease_until, "spec": Jsonb(spec), "now": now, "task": job["task_id"],
         "version": job["output_version"]}).fetchone()
    logger.info("media job claimed", extra={"tenant_id": str(job["tenant_id"]), "task_id": str(job["task_id"]),
                                            "output_version": job["output_version"], "fencing_token": token,
                                            "media_class": media_class.name, "units": units, "try": row["tries"]})
    return {**row, "units": units, "spec": spec}


def mark_started(conn: psycopg.Connection, *, task_id, output_version: int, fencing_token: int, worker_ref: str,
                 now: datetime) -> bool:
    """Record the worker of a claim (a Batch job id, or locally "pid:<pid>"), fenced: False when the
    claim has moved on (the reconciler took the job back, or its result is in)."""
    return conn.execute(
        """update media_job set worker_ref = %s, updated_at = %s
            where task_id = %s and output_version = %s and fencing_token = %s and state = 'RUNNING'""",
        (worker_ref, now, task_id, output_version, fencing_token)).rowcount == 1


# --- 3. completion ------------------------------------------------------------------------------------

class _Output(BaseModel):
    model_config = ConfigDict(extra="ignore")

    asset_type: str
    key: str
    bytes: int = Field(default=0, ge=0)
    content_type: str | None = None
    width: int | None = None
    height: int | None = None
    codec: str | None = None
    duration_seconds: float | None = None


class MediaResult(BaseModel):
    """The worker's RESULT (see the issue's brief); unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    task_id: UUID
    output_version: int = Field(ge=1)
    fencing_token: int
    status: str
    code: str | None = None
    message: str | None = None
    probe: dict | None = None
    outputs: list[dict] = Field(default_factory=list)
    transcode_seconds: float = Field(default=0.0, ge=0)
    bytes_stored: int = Field(default=0, ge=0)


def parse_result(result: dict) -> MediaResult:
    try:
        return MediaResult.model_validate(result)
    except ValidationError as e:
        raise MediaResultInvalid(f"not a media RESULT: {str(e).splitlines()[0]}") from None


def error_result(job: dict, code: str, message: str) -> dict:
    """The RESULT of a try that produced none (a lost or unstartable worker): a transient error of
    the job's current claim."""
    return {"task_id": str(job["task_id"]), "output_version": int(job["output_version"]),
            "fencing_token": int(job["fencing_token"]), "status": "error", "code": code, "message": message[:1000],
            "probe": None, "outputs": [], "transcode_seconds": 0.0, "bytes_stored": 0}


def complete(conn: psycopg.Connection, result: dict, *, now: datetime, platform) -> str:
    """Apply a worker's RESULT in the caller's transaction. APPLIED (the task SUCCEEDED), RETRY (a
    transient error with tries left: PENDING again, same output version), FAILED (the task
    MEDIA_INGEST_FAILED), DUPLICATE (this claim's result is in already), STALE (not the job's
    current claim, or no such job): the last two change nothing."""
    res = parse_result(result)
    log = {"task_id": str(res.task_id), "output_version": res.output_version, "fencing_token": res.fencing_token}
    task = conn.execute("select * from generation_task where task_id = %s for update", (res.task_id,)).fetchone()
    if task is None:
        return STALE
    job = conn.execute("select * from media_job where task_id = %s and output_version = %s for update",
                       (res.task_id, res.output_version)).fetchone()
    if job is None or job["fencing_token"] != res.fencing_token:
        logger.warning("media result of a replaced claim refused", extra={
            **log, "current_fencing_token": job["fencing_token"] if job else None})
        return STALE
    if job["state"] in ("SUCCEEDED", "FAILED"):
        return DUPLICATE
    if job["state"] != "RUNNING":
        return STALE  # PENDING: taken back (the reconciler) before this result came; the next claim runs it again
    log["tenant_id"] = str(job["tenant_id"])
    _record_transcode_cost(platform, conn, job, res, now)
    if task["state"] not in ("MEDIA_PROCESSING", "CANCEL_REQUESTED"):  # ended another way meanwhile
        release_attempt(conn, job["attempt_id"], now)
        _set_job(conn, job, now, state="FAILED", error_code="TASK_TERMINAL", result=result, finished_at=now, lease_until=None)
        return STALE
    status, code = res.status, res.code
    outputs: list[tuple[_Output, str]] = []
    if status == "ok":
        outputs, problem = _checked_outputs(platform, job, res)
        if problem is not None:
            status, code = "error", RESULT_INVALID
            logger.error("media result broke its contract", extra={**log, "problem": problem})
    if status == "ok":
        _store_outputs(conn, job, outputs)
        _record_storage_cost(platform, conn, task, job, res, outputs, now)
        _set_job(conn, job, now, state="SUCCEEDED", result=result, error_code=None, finished_at=now, lease_until=None)
        _end(conn, task, job, "SUCCEEDED", stage="PROVIDER_SUCCEEDED", error_code=None, message=None, now=now)
        logger.info("media job succeeded", extra={**log, "assets": [o.asset_type for o, _ in outputs],
                                                  "transcode_seconds": res.transcode_seconds, "bytes_stored": res.bytes_stored})
        return APPLIED
    code = code or ("MEDIA_TRANSCODE_FAILED" if status == "error" else "MEDIA_NOT_VIDEO")
    if status == "error" and job["tries"] < job["max_tries"]:
        delay = _backoff(platform, job["tries"])
        release_keys(conn, job["attempt_id"], [MEDIA_CLASSES[job["resource_class"]].pool_key], now)
        _set_job(conn, job, now, state="PENDING", result=result, error_code=code, lease_until=None, worker_ref=None,
                 next_eligible_at=now + delay)
        logger.warning("media job failed; retried", extra={**log, "code": code, "try": job["tries"], "max_tries": job["max_tries"],
                                                          "retry_in_seconds": delay.total_seconds()})
        return RETRY
    _set_job(conn, job, now, state="FAILED", result=result, error_code=code, finished_at=now, lease_until=None)
    _end(conn, task, job, "MEDIA_INGEST_FAILED", stage=STAGE_FAILED, error_code=code, message=res.message, now=now)
    logger.warning("media ingest failed", extra={**log, "code": code, "status": status, "try": job["tries"]})
    return FAILED


def _backoff(platform, tries: int) -> timedelta:
    m = platform.config.media
    return platform.clock.delta(min(m.retry_max_seconds, m.retry_base_seconds * 2 ** max(0, tries - 1)))


def _checked_outputs(platform, job: dict, res: MediaResult) -> tuple[list[tuple[_Output, str]], str | None]:
    """The outputs of an ok RESULT with their normalized keys, or why they break the contract: at
    least a proxy and a thumbnail, known asset types once each, keys inside the job's prefix."""
    out: list[tuple[_Output, str]] = []
    seen: set[str] = set()
    for raw in res.outputs:
        try:
            o = _Output.model_validate(raw)
        except ValidationError as e:
            return [], f"output not understood: {str(e).splitlines()[0]}"
        if o.asset_type not in ASSET_TYPES or o.asset_type in seen:
            return [], f"asset type {o.asset_type!r} unknown or repeated"
        key = _normalized_key(platform, job, o.key)
        if key is None:
            return [], f"key {o.key!r} outside the job's outputs"
        seen.add(o.asset_type)
        out.append((o, key))
    if not {"proxy", "thumbnail"} <= seen:
        return [], f"outputs {sorted(seen)} lack a proxy or a thumbnail"
    return out, None


def _store_outputs(conn: psycopg.Connection, job: dict, outputs: list[tuple[_Output, str]]) -> None:
    """One task_output row per asset type of the job's output version: the platform's own key and no
    URL (URLs are made at read time). A row already there (a duplicate) is kept as it is."""
    with conn.cursor() as cur:
        cur.executemany(
            """insert into task_output (task_id, tenant_id, output_version, asset_type, object_key, url, content_type, size_bytes,
                                        duration_ms, metadata)
               values (%(task)s, %(tenant)s, %(version)s, %(asset)s, %(key)s, null, %(ct)s, %(bytes)s, %(ms)s, %(meta)s)
               on conflict (task_id, output_version, asset_type) do nothing""",
            [{"task": job["task_id"], "tenant": job["tenant_id"], "version": job["output_version"], "asset": o.asset_type,
              "key": key, "ct": o.content_type or content_type_of(key), "bytes": o.bytes,
              "ms": round(o.duration_seconds * 1000) if o.duration_seconds is not None else None,
              "meta": Jsonb({"width": o.width, "height": o.height, "codec": o.codec})} for o, key in outputs])


def content_type_of(key: str) -> str:
    return mimetypes.guess_type(key)[0] or "application/octet-stream"


def _decimal(value: str) -> Decimal:
    try:
        return Decimal(value)
    except InvalidOperation:
        return Decimal(0)


def _cost_line(job: dict, *, source: str, kind: str, amount: Decimal, currency: str, now: datetime, tags: dict) -> MediaCost:
    return MediaCost(source_key=f"media:{job['task_id']}:v{job['output_version']}:{source}", kind=kind,
                     amount=amount.quantize(QUANTUM), currency=currency, occurred_at=now, tenant_id=job["tenant_id"],
                     task_id=job["task_id"], project_id=(job.get("spec") or {}).get("project"),
                     tags={"media_class": job["resource_class"], **tags})


def _record_transcode_cost(platform, conn: psycopg.Connection, job: dict, res: MediaResult, now: datetime) -> None:
    """Every try's worker time is the platform's cost, whatever came of it: one TRANSCODE (or
    GPU_RENDER) line per claim, units x seconds at the configured rate."""
    if res.transcode_seconds <= 0:
        return
    m = platform.config.media
    units = int(job["slot_units"])
    amount = Decimal(str(res.transcode_seconds)) * units * _decimal(m.transcode_cost_per_unit_second)
    record_media_costs(conn, [_cost_line(job, source=f"{job['fencing_token']}:transcode",
                                         kind=MEDIA_CLASSES[job["resource_class"]].cost_kind, amount=amount,
                                         currency=m.cost_currency, now=now,
                                         tags={"transcode_seconds": res.transcode_seconds, "units": units})])


def _record_storage_cost(platform, conn: psycopg.Connection, task: dict, job: dict, res: MediaResult,
                         outputs: list[tuple[_Output, str]], now: datetime) -> None:
    """The stored outputs' whole storage life (aivedio.media.storage_cost), booked once per output
    version when they are stored, in AWS as locally: the Cost and Usage Report bills the media bucket
    as a whole (cost allocation reads the bucket's tags, never an object's), and is checked monthly
    against the same model."""
    m = platform.config.media
    stored = res.bytes_stored or sum(o.bytes for o, _ in outputs)
    if stored <= 0:
        return
    rc = retention_class(task)
    amount = storage_cost.lifetime_cost(stored, rc, storage_cost.StoragePrices.of(m), m.storage_horizon_months)
    record_media_costs(conn, [_cost_line(job, source="storage", kind="STORAGE", amount=amount, currency=m.cost_currency,
                                         now=now, tags={"bytes": stored, "retention_class": rc})])


def _set_job(conn: psycopg.Connection, job: dict, now: datetime, **fields: Any) -> None:
    if "result" in fields:
        fields["result"] = Jsonb(fields["result"])
    sets = ", ".join(f"{k} = %({k})s" for k in fields)
    conn.execute(f"update media_job set {sets}, updated_at = %(now)s where task_id = %(task)s and output_version = %(version)s",
                 {**fields, "now": now, "task": job["task_id"], "version": job["output_version"]})


def _end(conn: psycopg.Connection, task: dict, job: dict, to_state: str, *, stage: str, error_code: str | None,
         message: str | None, now: datetime) -> None:
    """The task's terminal step out of the media stage: the CAS, the attempt's (and so the job's)
    reservations released, the terminal event with the provider's side as the attempt reported it."""
    extra: dict[str, Any] = {"finished_at": now}
    if error_code is not None:
        extra.update(error_code=error_code[:100], error_message=(message or "")[:1000] or None)
    if task["state"] == "CANCEL_REQUESTED":  # the cancel keeps the provider's result: through PROVIDER_SUCCEEDED
        task = _cas(conn, task, "PROVIDER_SUCCEEDED", now)
    _cas(conn, task, to_state, now, **extra)
    close_reopened_attempt(conn, job["attempt_id"], now)
    released = release_attempt(conn, job["attempt_id"], now)
    write_terminal_event(conn, task, job["attempt_id"], to_state, stage=stage, report=job["provider_report"] or {},
                         error_code=error_code, now=now)
    publish(TASKS_FINISHED, state=to_state, stage=stage)
    logger.info("task finished", extra={"tenant_id": str(task["tenant_id"]), "task_id": str(task["task_id"]),
                                        "attempt_id": str(job["attempt_id"]), "state": to_state, "stage": stage,
                                        "output_version": job["output_version"], "reservations_released": len(released)})


def _cas(conn: psycopg.Connection, task: dict, to_state: str, now: datetime, **fields: Any) -> dict:
    row = tasks.cas_transition(conn, tenant_id=task["tenant_id"], task_id=task["task_id"], from_state=task["state"],
                               version=task["version"], to_state=to_state, now=now, **fields)
    if row is None:
        raise RuntimeError(f"task {task['task_id']} moved under its row lock")
    return row


def _fail(conn: psycopg.Connection, task: dict, job: dict, *, code: str, message: str, now: datetime) -> None:
    """End a media job that cannot run at all (FAILED, the task MEDIA_INGEST_FAILED)."""
    _set_job(conn, job, now, state="FAILED", error_code=code, finished_at=now, lease_until=None)
    _end(conn, task, job, "MEDIA_INGEST_FAILED", stage=STAGE_FAILED, error_code=code, message=message, now=now)


# --- reads --------------------------------------------------------------------------------------------

def job_of(conn: psycopg.Connection, task_id: UUID) -> dict | None:
    """The task's latest media job, or None."""
    return conn.execute("select * from media_job where task_id = %s order by output_version desc limit 1",
                        (task_id,)).fetchone()
