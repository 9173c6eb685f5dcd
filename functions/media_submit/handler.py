"""Media dispatch, on a schedule (aivedio.events_routing, "media-dispatch"): claims the PENDING media
jobs whose worker slots fit (aivedio.media.pipeline.claim_next) and starts a worker for each.

- In AWS (AIVEDIO_MEDIA_BATCH set by infra_cdk/media.py): each claim becomes a Batch SubmitJob on
  the job queue and job definition of its media resource class, named
  `media-<task_id>-v<output_version>-<fencing_token>`, with the SPEC in AIVEDIO_JOB_SPEC; then
  pipeline.mark_started records the Batch job id (aivedio.media.batch.dispatch). A run claims until
  a claim comes back short or its time is nearly spent; EventBridge starts the next one a minute
  later (Batch itself takes longer than that to start an instance from zero).
- Locally: the dispatcher the local runtime puts in the platform's extras (pipeline.LOCAL_DISPATCHER:
  aivedio_tools.local.media_dispatch, worker subprocesses bounded by the same slots), the way
  functions/dispatch finds the local workflow runner there instead of Step Functions.

A claim is handed to one run only (claim_next's CAS and fencing), so nothing is submitted twice; a
submit that fails, or a run that dies between claim and submit, leaves a RUNNING job with no worker,
which the media-jobs reconciler retries with the same output version once its lease is past."""
from __future__ import annotations

from aivedio.context import get_platform
from aivedio.media import batch, pipeline
from aivedio.observability import logger

RESERVE_SECONDS = 10.0  # left of the timeout when a run stops claiming


def _seconds_left(context):
    if context is None or not hasattr(context, "get_remaining_time_in_millis"):
        return lambda: 60.0
    return lambda: context.get_remaining_time_in_millis() / 1000.0


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    platform = get_platform()
    if not batch.targets():
        return _local(platform)
    counts = batch.dispatch(platform, limit=platform.config.media.dispatch_batch, seconds_left=_seconds_left(context),
                            reserve_seconds=RESERVE_SECONDS)
    if counts["claimed"]:
        logger.info("media dispatch", extra=counts)
    return counts


def _local(platform) -> dict:
    run_local = platform.extras.get(pipeline.LOCAL_DISPATCHER)
    if run_local is None:
        return {"skipped": "no AIVEDIO_MEDIA_BATCH, and no local media dispatcher in this process"}
    return run_local(platform)
