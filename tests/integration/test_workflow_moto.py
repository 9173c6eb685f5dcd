"""The attempt workflow's branches, run from the project's one definition (aivedio.attempts.workflow)
by two executors: moto's Step Functions interpreter (an ASL implementation independent of ours,
with `execute_state_machine`) and the local workflow runner (aivedio_tools.local.workflow_runner). Both
call the same scripted step: canned answers per action, standing in for functions/attempt_step, so
each branch (polling, SUBMIT_UNKNOWN adopted or sent to review, cancel, a transient step error
retried, a step that keeps failing) is driven exactly. For each branch the test asserts moto's
execution status, output and history, then that the local runner made the same Task calls (action,
attempt and incoming step, in order) and ended the same way.

moto runs Lambda Tasks without Docker by echoing the payload; the test patches
`LambdaSimpleBackend.invoke` (moto internals: moto is pinned in pyproject.toml) so each invocation
calls the script, and an exception becomes what Lambda returns for an unhandled error
(X-Amz-Function-Error: Unhandled, errorType/errorMessage). Retry intervals would make moto sleep
5 + 10 + 20 s: the retrier's sleep is patched to record the intervals instead. Waits take real
time in moto, so the scripted waits are 0 s (one branch waits 1 s, the least the real steps ask)."""
from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

moto = pytest.importorskip("moto", reason="moto is in the dev extra: pip install -e '.[dev]'")

import boto3  # noqa: E402
from moto import mock_aws  # noqa: E402
from moto.awslambda_simple.models import LambdaSimpleBackend  # noqa: E402
from moto.stepfunctions.parser.asl.component.common.retry import retrier_decl  # noqa: E402

from aivedio.attempts.executions import LOCAL_STEP_RESOURCE, local_definition  # noqa: E402
from aivedio.attempts.workflow import (STEP_FUNCTION_PLACEHOLDER, definition, definition_json,  # noqa: E402
                                       execution_input, substitute)
from aivedio.config import Clock  # noqa: E402
from aivedio_tools.local.workflow_runner import WorkflowRunner  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
REGION, ACCOUNT = "us-east-1", "123456789012"
STEP_ARN = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:aivedio-test-attempt-step"
MOTO_CONFIG = {"stepfunctions": {"execute_state_machine": True}, "lambda": {"use_docker": False}}
EXECUTION_TIMEOUT = 60.0  # real seconds; each branch takes well under 2


class StepError(RuntimeError):
    """What a step raises unexpectedly (a bug, a database outage)."""


# --- the scripted step ---------------------------------------------------------------------------

class Script:
    """Canned step answers per action, consumed in order; an exception instance is raised instead
    of answered. Records every call (the Task's payload: action, attempt, step)."""

    def __init__(self, answers: dict[str, list[Any]]):
        self._answers = {k: list(v) for k, v in answers.items()}
        self.calls: list[dict[str, Any]] = []
        self.results: list[Any] = []  # what each call answered, or the exception it raised
        self._lock = threading.Lock()

    def __call__(self, payload: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self.calls.append(copy.deepcopy(payload))
            queue = self._answers.get(payload["action"]) or []
            if not queue:
                raise LookupError(f"no scripted answer left for {payload['action']!r}")
            answer = queue.pop(0)
            self.results.append(copy.deepcopy(answer) if not isinstance(answer, BaseException) else answer)
        if isinstance(answer, BaseException):
            raise answer
        return copy.deepcopy(answer)

    def actions(self) -> list[str]:
        return [c["action"] for c in self.calls]

    def unused(self) -> dict[str, list[Any]]:
        return {k: v for k, v in self._answers.items() if v}


def go(step: str, **kw: Any) -> dict[str, Any]:
    return {"next": step, **kw}


def wait(then: str, seconds: int, **kw: Any) -> dict[str, Any]:
    return {"next": "wait", "then": then, "wait_seconds": seconds, **kw}


def done(outcome: str, **kw: Any) -> dict[str, Any]:
    return {"next": "done", "outcome": outcome, **kw}


@dataclass(frozen=True)
class Branch:
    answers: dict[str, list[Any]]
    actions: list[str]  # the Task actions, in order (a retried Task appears once per invocation)
    states: list[str]  # the states entered, in order (moto's history; a retry enters no state)
    status: str  # SUCCEEDED | FAILED
    retry_sleeps: list[float] = field(default_factory=list)  # moto's retrier intervals, in seconds


def _failures(n: int) -> list[StepError]:
    return [StepError(f"step failed ({i + 1})") for i in range(n)]


BRANCHES: dict[str, Branch] = {
    "polls_until_done": Branch(
        answers={"begin": [go("submit")], "submit": [wait("check", 1, polls=0)],
                 "check": [wait("check", 0, polls=1), done("succeeded")],
                 "finalize": [done("succeeded", task_state="SUCCEEDED")]},
        actions=["begin", "submit", "check", "check", "finalize"],
        states=["Begin", "ChooseNext", "Submit", "ChooseNext", "WaitThen", "ChooseAfterWait", "Check", "ChooseNext",
                "WaitThen", "ChooseAfterWait", "Check", "ChooseNext", "Finalize", "Finished"],
        status="SUCCEEDED"),
    "submit_unknown_adopted": Branch(
        answers={"begin": [go("submit")], "submit": [wait("resolve", 0)],
                 "resolve": [wait("check", 0, polls=0)], "check": [done("succeeded")],
                 "finalize": [done("succeeded", task_state="SUCCEEDED")]},
        actions=["begin", "submit", "resolve", "check", "finalize"],
        states=["Begin", "ChooseNext", "Submit", "ChooseNext", "WaitThen", "ChooseAfterWait", "ResolveUnknown",
                "ChooseNext", "WaitThen", "ChooseAfterWait", "Check", "ChooseNext", "Finalize", "Finished"],
        status="SUCCEEDED"),
    "submit_unknown_to_manual_review": Branch(
        answers={"begin": [go("submit")], "submit": [go("resolve")],
                 "resolve": [wait("resolve", 0, errors=1), wait("resolve", 0, errors=2),
                             {"next": "manual_review", "outcome": "submit_unknown_unresolved"}],
                 "finalize": [done("submit_unknown_unresolved", task_state="MANUAL_REVIEW")]},
        actions=["begin", "submit", "resolve", "resolve", "resolve", "finalize"],
        states=["Begin", "ChooseNext", "Submit", "ChooseNext", "ResolveUnknown", "ChooseNext", "WaitThen",
                "ChooseAfterWait", "ResolveUnknown", "ChooseNext", "WaitThen", "ChooseAfterWait", "ResolveUnknown",
                "ChooseNext", "ManualReview", "Finalize", "Finished"],
        status="SUCCEEDED"),
    "cancel_after_dispatch": Branch(
        answers={"begin": [go("submit")], "submit": [wait("check", 0, polls=0)],
                 "check": [go("cancel"), done("cancelled")],
                 "cancel": [wait("cancel", 0, errors=1), wait("check", 0, polls=1)],
                 "finalize": [done("cancelled", task_state="CANCELLED")]},
        actions=["begin", "submit", "check", "cancel", "cancel", "check", "finalize"],
        states=["Begin", "ChooseNext", "Submit", "ChooseNext", "WaitThen", "ChooseAfterWait", "Check", "ChooseNext",
                "Cancel", "ChooseNext", "WaitThen", "ChooseAfterWait", "Cancel", "ChooseNext", "WaitThen",
                "ChooseAfterWait", "Check", "ChooseNext", "Finalize", "Finished"],
        status="SUCCEEDED"),
    "transient_step_error_retried": Branch(
        answers={"begin": [go("submit")], "submit": [*_failures(1), wait("check", 0, polls=0)],
                 "check": [done("succeeded")], "finalize": [done("succeeded", task_state="SUCCEEDED")]},
        actions=["begin", "submit", "submit", "check", "finalize"],
        states=["Begin", "ChooseNext", "Submit", "ChooseNext", "WaitThen", "ChooseAfterWait", "Check", "ChooseNext",
                "Finalize", "Finished"],
        status="SUCCEEDED", retry_sleeps=[5.0]),
    "step_keeps_failing_abandoned": Branch(
        answers={"begin": [go("submit")], "submit": _failures(4)},
        actions=["begin", "submit", "submit", "submit", "submit"],
        states=["Begin", "ChooseNext", "Submit", "Abandoned"],
        status="FAILED", retry_sleeps=[5.0, 10.0, 20.0]),
}


def _task_failed_retrier() -> dict[str, Any]:
    [rule] = [r for r in definition()["States"]["Submit"]["Retry"] if r["ErrorEquals"] == ["States.TaskFailed"]]
    return rule


def test_the_scripted_retry_intervals_are_the_definitions():
    rule = _task_failed_retrier()
    intervals = [rule["IntervalSeconds"] * rule["BackoffRate"] ** n for n in range(rule["MaxAttempts"])]
    assert BRANCHES["step_keeps_failing_abandoned"].retry_sleeps == intervals
    assert BRANCHES["transient_step_error_retried"].retry_sleeps == intervals[:1]


def test_moto_is_pinned_to_the_installed_version():
    """This module patches moto's internals (LambdaSimpleBackend.invoke, the retrier's sleep)."""
    pins = re.findall(r'"moto\[[^\]]*\]==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pins == [moto.__version__]


# --- the executors -------------------------------------------------------------------------------

class Scripts:
    """Routes each Task invocation to its branch's script by attempt id (both executors run
    several executions in threads)."""

    def __init__(self):
        self.by_attempt: dict[str, Script] = {}
        self.function_names: set[str] = set()

    def __call__(self, payload: dict[str, Any]) -> dict[str, Any]:
        return self.by_attempt[payload["attempt"]["attempt_id"]](payload)


@pytest.fixture(scope="module")
def scripts() -> Scripts:
    return Scripts()


@pytest.fixture(scope="module")
def moto_sfn(scripts):
    """moto's Step Functions with the state machine created from the project's definition, the
    attempt_step ARN substituted as CloudFormation's DefinitionSubstitutions would."""
    sleeps: list[float] = []

    def invoke(self, function_name, qualifier, body, headers, response_headers):
        scripts.function_names.add(function_name)
        payload = json.loads(body)
        try:
            result = scripts(payload)
        except Exception as e:  # what Lambda answers for an unhandled exception of a Python handler
            response_headers["x-amz-function-error"] = "Unhandled"
            return json.dumps({"errorType": type(e).__name__, "errorMessage": str(e), "stackTrace": []}).encode()
        return json.dumps(result).encode()

    with mock_aws(config=MOTO_CONFIG), \
            mock.patch.object(LambdaSimpleBackend, "invoke", invoke), \
            mock.patch.object(retrier_decl, "time", SimpleNamespace(sleep=sleeps.append)):
        client = boto3.client("stepfunctions", region_name=REGION)
        doc = substitute(definition_json(), {STEP_FUNCTION_PLACEHOLDER: STEP_ARN})
        arn = client.create_state_machine(name="aivedio-test-attempt", definition=json.dumps(doc), type="STANDARD",
                                          roleArn=f"arn:aws:iam::{ACCOUNT}:role/aivedio-test-attempt")["stateMachineArn"]
        yield SimpleNamespace(client=client, arn=arn, sleeps=sleeps)


@pytest.fixture(scope="module")
def local_runner(scripts):
    runner = WorkflowRunner(Clock(time_scale=1000), {LOCAL_STEP_RESOURCE: scripts}, workers=2).start()
    yield runner
    runner.stop()


def _attempt() -> dict[str, Any]:
    return {"tenant_id": str(uuid.uuid4()), "task_id": str(uuid.uuid4()), "attempt_id": str(uuid.uuid4()),
            "fencing_token": 1}


def _run_in_moto(moto_sfn, attempt: dict[str, Any]) -> tuple[dict, list[dict]]:
    c = moto_sfn.client
    arn = c.start_execution(stateMachineArn=moto_sfn.arn, name=attempt["attempt_id"],
                            input=json.dumps(execution_input(attempt)))["executionArn"]
    deadline = time.monotonic() + EXECUTION_TIMEOUT
    while (described := c.describe_execution(executionArn=arn))["status"] == "RUNNING":
        assert time.monotonic() < deadline, "moto's execution did not finish"
        time.sleep(0.05)
    events = c.get_execution_history(executionArn=arn, maxResults=1000)["events"]
    return described, events


def _entered(events: list[dict]) -> list[str]:
    return [e["stateEnteredEventDetails"]["name"] for e in events if "stateEnteredEventDetails" in e]


def _chained(script: Script, attempt: dict, start_step: dict) -> None:
    """Every Task got the attempt and, as its step, what the previous Task answered (ResultPath
    $.step; a Wait or Choice leaves it alone; a retry resends the same step)."""
    expected = start_step
    for call, result in zip(script.calls, script.results, strict=True):
        assert call["attempt"] == attempt
        assert call["step"] == expected, (call, expected)
        if not isinstance(result, BaseException):
            expected = result


@pytest.mark.parametrize("name", list(BRANCHES))
def test_branch_runs_alike_in_moto_and_in_the_local_runner(name, scripts, moto_sfn, local_runner):
    branch = BRANCHES[name]

    # moto: Step Functions' semantics.
    attempt = _attempt()
    scripts.by_attempt[attempt["attempt_id"]] = in_moto = Script(branch.answers)
    moto_sfn.sleeps.clear()
    described, events = _run_in_moto(moto_sfn, attempt)
    assert described["status"] == branch.status, (described, [e["type"] for e in events])
    assert in_moto.actions() == branch.actions
    assert not in_moto.unused(), f"scripted answers never asked for: {in_moto.unused()}"
    assert _entered(events) == branch.states
    assert scripts.function_names == {STEP_ARN}
    _chained(in_moto, attempt, execution_input(attempt)["step"])
    scheduled = [json.loads(e["lambdaFunctionScheduledEventDetails"]["input"]) for e in events
                 if e["type"] == "LambdaFunctionScheduled"]
    assert scheduled == in_moto.calls
    assert [e["lambdaFunctionScheduledEventDetails"]["resource"] for e in events
            if e["type"] == "LambdaFunctionScheduled"] == [STEP_ARN] * len(branch.actions)
    assert moto_sfn.sleeps == branch.retry_sleeps
    if branch.status == "SUCCEEDED":
        final_answer = branch.answers["finalize"][-1]
        assert json.loads(described["output"]) == {"attempt": attempt, "step": final_answer}
    else:
        fail = next(e for e in events if e["type"] == "ExecutionFailed")["executionFailedEventDetails"]
        abandoned = definition()["States"]["Abandoned"]
        assert (fail["error"], fail["cause"]) == (abandoned["Error"], abandoned["Cause"])
        entered = next(e for e in events if e.get("stateEnteredEventDetails", {}).get("name") == "Abandoned")
        caught = json.loads(entered["stateEnteredEventDetails"]["input"])["error"]  # Catch ResultPath $.error
        assert caught["Error"] == "StepError"  # Step Functions names a Lambda error after its errorType
        assert json.loads(caught["Cause"])["errorMessage"] == "step failed (4)"

    # The local runner: the same definition (another placeholder value), the same script.
    local_attempt = _attempt()
    scripts.by_attempt[local_attempt["attempt_id"]] = locally = Script(branch.answers)
    ex = local_runner.start_execution(local_attempt["attempt_id"], local_definition(), execution_input(local_attempt))
    assert local_runner.run_until_idle(EXECUTION_TIMEOUT), "the local execution did not finish"
    assert ex.status == described["status"]
    assert locally.actions() == in_moto.actions()
    _chained(locally, local_attempt, execution_input(local_attempt)["step"])

    def relabel(calls: list[dict]) -> list[dict]:
        return [{**c, "attempt": "<attempt>"} for c in calls]

    assert relabel(locally.calls) == relabel(in_moto.calls), "the Tasks got different payloads"
    if ex.status == "SUCCEEDED":
        assert ex.output == {"attempt": local_attempt, "step": branch.answers["finalize"][-1]}
    else:
        assert ex.error.startswith(f"{definition()['States']['Abandoned']['Error']}:")
        # Known difference: the local runner records a handler's exception as States.TaskFailed,
        # where Step Functions (and moto) use the error type ("StepError"); no Retry or Catch of
        # the definition tells them apart (States.TaskFailed matches both).
        assert ex.doc["error"]["Error"] in ("States.TaskFailed", "StepError")


def test_the_local_definition_is_the_same_document_with_the_local_resource():
    assert local_definition() == substitute(definition(), {STEP_FUNCTION_PLACEHOLDER: LOCAL_STEP_RESOURCE})
    assert json.loads(definition_json()) == definition()
