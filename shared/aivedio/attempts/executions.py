"""Starting attempt workflows: a Step Functions execution in AWS (the state machine's ARN is in
AIVEDIO_ATTEMPT_STATE_MACHINE_ARN), the local workflow runner otherwise. The execution name is
the attempt id, so a TaskDispatchRequested delivered twice starts one execution; a restart by the
lease scanner adds the recovery count to the name."""
from __future__ import annotations

import json

from aivedio.attempts.lifecycle import AttemptRef
from aivedio.attempts.workflow import STEP_FUNCTION_PLACEHOLDER, definition, execution_input, substitute
from aivedio.config import Settings
from aivedio.faults import failpoints
from aivedio.observability import logger

LOCAL_STEP_RESOURCE = "local:attempt_step"


class ExecutionAlreadyExists(Exception):
    """A workflow runner already has an execution of this name (the local runner raises it)."""


def execution_name(ref: AttemptRef, recoveries: int = 0) -> str:
    return str(ref.attempt_id) if recoveries == 0 else f"{ref.attempt_id}-r{recoveries}"


def local_definition() -> dict:
    return substitute(definition(), {STEP_FUNCTION_PLACEHOLDER: LOCAL_STEP_RESOURCE})


def start(platform, ref: AttemptRef, *, recoveries: int = 0) -> str:
    """Start the attempt's workflow; a second start of the same execution changes nothing."""
    return start_with(platform.settings, platform.extras, ref, recoveries=recoveries)


def start_with(settings: Settings, extras: dict, ref: AttemptRef, *, recoveries: int = 0) -> str:
    """start() from settings and the process's extras alone: in AWS, starting an execution needs
    no database, so the dispatch function has none."""
    if recoveries == 0:  # the dispatch consumer's start (the lease scanner's restarts count recoveries)
        failpoints.hit("after-claim-before-dispatch")
    name = execution_name(ref, recoveries)
    doc = execution_input(ref.as_dict())
    arn = settings.attempt_state_machine_arn
    if arn:
        import boto3  # lazy: boto3 takes most of a second to import; the local workflow runner needs none

        client = extras.get("sfn_client") or boto3.client("stepfunctions")
        try:
            client.start_execution(stateMachineArn=arn, name=name, input=json.dumps(doc))
        except client.exceptions.ExecutionAlreadyExists:
            logger.info("attempt workflow already started", extra={**ref.log(), "execution": name})
        return name
    runner = extras.get("workflow_runner")
    if runner is None:
        raise RuntimeError("no workflow runner in this process and no AIVEDIO_ATTEMPT_STATE_MACHINE_ARN")
    try:
        runner.start_execution(name, local_definition(), doc)
    except ExecutionAlreadyExists:
        logger.info("attempt workflow already ran", extra={**ref.log(), "execution": name})
    return name
