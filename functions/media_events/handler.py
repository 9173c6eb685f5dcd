"""Media completion in AWS: consumes "Batch Job State Change" events of the media job queues,
SUCCEEDED or FAILED (an EventBridge rule sends them to this function's SQS queue, with its DLQ;
infra_cdk/media.py), at least once, with partial batch failures.

For each finished job: the RESULT its worker wrote to <outputs>result.json (the outputs prefix is
in the SPEC, which the event carries in the container's AIVEDIO_JOB_SPEC), else a transient
"error" RESULT (MEDIA_TIMEOUT when Batch stopped it for its timeout, else MEDIA_TRANSCODE_FAILED),
given to aivedio.media.pipeline.complete, which is fenced on (task_id, output_version,
fencing_token) and idempotent: a redelivered event is a DUPLICATE, an old attempt's a STALE, and
neither changes anything. An event of a job that is not a media job of this platform is
acknowledged and ignored. A lost event is caught by the media-jobs reconciler (DescribeJobs).
Locally there is no Batch: the local dispatcher completes from each worker subprocess's stdout."""
from __future__ import annotations

import json

from aws_lambda_powertools.utilities.batch import BatchProcessor, EventType, process_partial_response
from aws_lambda_powertools.utilities.data_classes.sqs_event import SQSRecord

from aivedio.context import get_platform
from aivedio.media import batch
from aivedio.observability import logger

processor = BatchProcessor(event_type=EventType.SQS)


def record_handler(record: SQSRecord) -> None:
    event = json.loads(record.body)
    detail = event.get("detail") or {}
    outcome = batch.complete_job(get_platform(), detail)
    logger.info("media job state change", extra={"batch_job_id": detail.get("jobId"), "job_name": detail.get("jobName"),
                                                 "status": detail.get("status"), "outcome": outcome})


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    return process_partial_response(event=event, record_handler=record_handler, processor=processor, context=context)
