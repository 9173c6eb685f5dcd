"""The attempt lifecycle's Lambda handlers, invoked with their sample events (events/*.json)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from aivedio.context import set_platform
from aivedio_tools.local.lambda_context import FakeLambdaContext
from aivedio_tools.local.workflow_runner import WorkflowRunner

EVENTS = Path(__file__).resolve().parents[2] / "events"


@pytest.fixture
def installed(platform):
    set_platform(platform)
    yield platform
    set_platform(None)


def sample(name: str) -> dict:
    return json.loads((EVENTS / f"{name}.json").read_text())


def test_attempt_step_on_an_unknown_attempt_answers_done(installed):
    from functions.attempt_step.handler import lambda_handler

    assert lambda_handler(sample("attempt_step"), FakeLambdaContext("aivedio-attempt_step")) == {"next": "done", "outcome": "missing"}


def test_attempt_step_refuses_an_unknown_action(installed):
    from functions.attempt_step.handler import lambda_handler

    with pytest.raises(ValueError, match="unknown attempt step"):
        lambda_handler({**sample("attempt_step"), "action": "resubmit"}, FakeLambdaContext("aivedio-attempt_step"))


def test_dispatch_starts_one_execution_per_attempt_however_often_delivered(installed):
    from functions.dispatch.handler import lambda_handler

    calls = []
    runner = WorkflowRunner(installed.clock, {"local:attempt_step": lambda p: calls.append(p["action"]) or {"next": "done"}})
    installed.extras["workflow_runner"] = runner
    try:
        event = sample("dispatch")
        for _ in range(3):  # at-least-once delivery; nothing runs yet, so the execution is still open
            assert lambda_handler(event, FakeLambdaContext("aivedio-dispatch")) == {"batchItemFailures": []}
        assert runner.running() == 1
        runner.start()
        assert runner.run_until_idle(5)
        assert calls == ["begin", "finalize"]
    finally:
        runner.stop()
        installed.extras.pop("workflow_runner", None)


def test_dispatch_fails_the_batch_when_no_workflow_can_start(installed):
    """Every record failed: Powertools raises, so SQS delivers the batch again (and then to the DLQ)."""
    from aws_lambda_powertools.utilities.batch.exceptions import BatchProcessingError

    from functions.dispatch.handler import lambda_handler

    with pytest.raises(BatchProcessingError, match="no workflow runner"):
        lambda_handler(sample("dispatch"), FakeLambdaContext("aivedio-dispatch"))


def test_attempt_recovery_with_nothing_expired(installed):
    from functions.attempt_recovery.handler import lambda_handler

    out = lambda_handler(sample("attempt_recovery"), FakeLambdaContext("aivedio-attempt_recovery"))
    assert (out["service"], out["repaired"], out["complete"]) == ("attempt-recovery", 0, True)


def test_dispatch_in_aws_starts_one_step_functions_execution_without_a_database(monkeypatch):
    """With the state machine's ARN set, dispatch needs no platform: no database, no runner."""
    import boto3
    from moto import mock_aws

    import functions.dispatch.handler as dispatch
    from aivedio.attempts.workflow import definition_json
    from aivedio.config import Settings

    with mock_aws():
        sfn = boto3.client("stepfunctions", region_name="us-east-1")
        arn = sfn.create_state_machine(name="aivedio-dev-attempt", definition=definition_json(),
                                       roleArn="arn:aws:iam::123456789012:role/sfn")["stateMachineArn"]
        monkeypatch.setattr(dispatch, "_settings", Settings(attempt_state_machine_arn=arn))
        monkeypatch.setattr(dispatch, "_extras", {"sfn_client": sfn})
        set_platform(None)
        monkeypatch.setattr("aivedio.context.build_platform", lambda *a, **k: pytest.fail("dispatch built a platform"))
        for _ in range(2):
            assert dispatch.lambda_handler(sample("dispatch"), FakeLambdaContext("aivedio-dispatch")) == {"batchItemFailures": []}
        [ex] = sfn.list_executions(stateMachineArn=arn)["executions"]
        assert ex["name"] == json.loads(sample("dispatch")["Records"][0]["body"])["payload"]["attempt_id"]
