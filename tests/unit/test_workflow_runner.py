"""The local workflow runner's States-language semantics, on small documents."""
from __future__ import annotations

import pytest

from aivedio.attempts.executions import local_definition
from aivedio.attempts.workflow import definition
from aivedio.config import Clock
from aivedio_tools.local.workflow_runner import ExecutionAlreadyExists, WorkflowRunner, parameters, read_path, write_path

FAST = Clock(time_scale=10_000)


def test_paths_and_parameters():
    doc = {"a": {"b": 1}, "s": "x"}
    assert read_path(doc, "$.a.b") == 1 and read_path(doc, "$") is doc
    assert write_path(doc, "$.a.c", 2) == {"a": {"b": 1, "c": 2}, "s": "x"} and doc["a"] == {"b": 1}
    assert write_path(doc, None, 5) is doc
    assert parameters({"k": "v", "n.$": "$.a.b", "deep": {"s.$": "$.s"}}, doc) == {"k": "v", "n": 1, "deep": {"s": "x"}}


def run(defn, resources, name="e1", inp=None):
    r = WorkflowRunner(FAST, resources, workers=2).start()
    try:
        ex = r.start_execution(name, defn, inp or {})
        assert r.run_until_idle(10)
        return r, ex
    finally:
        r.stop()


def test_retry_then_catch_then_fail():
    calls = []

    def flaky(payload):
        calls.append(payload)
        raise RuntimeError("boom")

    defn = {"StartAt": "T", "States": {
        "T": {"Type": "Task", "Resource": "r", "ResultPath": "$.out", "Next": "Ok",
              "Retry": [{"ErrorEquals": ["States.TaskFailed"], "IntervalSeconds": 1, "MaxAttempts": 2, "BackoffRate": 2}],
              "Catch": [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": "Bad"}]},
        "Ok": {"Type": "Succeed"},
        "Bad": {"Type": "Fail", "Error": "E", "Cause": "caught"}}}
    _, ex = run(defn, {"r": flaky})
    assert len(calls) == 3  # the first try and two retries
    assert ex.status == "FAILED" and ex.error.startswith("E:") and ex.doc["error"]["Error"] == "States.TaskFailed"


def test_choice_wait_and_loop_until_done():
    answers = iter([{"next": "wait", "wait_seconds": 30}, {"next": "wait", "wait_seconds": 30}, {"next": "done"}])
    defn = {"StartAt": "T", "States": {
        "T": {"Type": "Task", "Resource": "r", "ResultPath": "$.step", "Next": "C"},
        "C": {"Type": "Choice", "Choices": [{"Variable": "$.step.next", "StringEquals": "wait", "Next": "W"}], "Default": "End"},
        "W": {"Type": "Wait", "SecondsPath": "$.step.wait_seconds", "Next": "T"},
        "End": {"Type": "Succeed"}}}
    r, ex = run(defn, {"r": lambda payload: next(answers)})
    assert ex.status == "SUCCEEDED" and ex.output["step"] == {"next": "done"}
    with pytest.raises(ExecutionAlreadyExists):  # a closed execution's name is not reused
        r.start_execution("e1", defn, {})


def test_the_attempt_definition_runs_locally_from_begin_to_finished():
    script = {"begin": {"next": "submit"}, "submit": {"next": "wait", "then": "check", "wait_seconds": 10},
              "check": {"next": "done", "outcome": "succeeded"}, "finalize": {"next": "done", "outcome": "succeeded"}}
    seen = []

    def step(payload):
        seen.append(payload["action"])
        assert set(payload) == {"action", "attempt", "step"}
        return script[payload["action"]]

    _, ex = run(local_definition(), {"local:attempt_step": step}, inp={"attempt": {"attempt_id": "a"}, "step": {"next": "begin"}})
    assert seen == ["begin", "submit", "check", "finalize"]
    assert ex.status == "SUCCEEDED"
    assert "${" not in str(local_definition()) and "${AttemptStepFunctionArn}" in str(definition())
