"""The attempt workflow, defined once, as Amazon States Language (JSONPath).

infra_cdk builds the Step Functions state machine from `definition()` with the attempt_step
function's ARN substituted for ${AttemptStepFunctionArn}; the local workflow runner
(aivedio_tools.local.workflow_runner) executes the very same document, calling the same handler. Each
Task state invokes one step of aivedio.attempts.steps, which answers with `next`; the choice
states route on it. Waits take their length from the step's answer (SecondsPath), so polling
stages, jitter and backoff are decided in one place, the Python step.

    Begin -> ChooseNext -> Submit | Check | ResolveUnknown | Cancel | WaitThen | Finalize
    Submit/Check/ResolveUnknown/Cancel -> ChooseNext       (choice on the outcome)
    WaitThen -> ChooseAfterWait -> Check | ResolveUnknown | Cancel | Begin
    Finalize -> Finished (Succeed);  ManualReview -> Finalize;  an unexpected error -> Abandoned (Fail)

An execution that fails or is lost leaves its attempt's lease to expire; the lease scanner
(aivedio.attempts.recovery) starts a new execution, whose Begin reads PostgreSQL and resumes."""
from __future__ import annotations

import copy
import json
from typing import Any

STEP_FUNCTION_PLACEHOLDER = "AttemptStepFunctionArn"
RESOURCE = "${" + STEP_FUNCTION_PLACEHOLDER + "}"

# Lambda's own transient failures are retried in place; anything else abandons the execution, and
# the lease scanner restarts the attempt from what PostgreSQL records.
_RETRY = [
    {"ErrorEquals": ["Lambda.ServiceException", "Lambda.AWSLambdaException", "Lambda.SdkClientException",
                     "Lambda.TooManyRequestsException", "Lambda.Unknown"],
     "IntervalSeconds": 2, "MaxAttempts": 6, "BackoffRate": 2.0},
    {"ErrorEquals": ["States.TaskFailed"], "IntervalSeconds": 5, "MaxAttempts": 3, "BackoffRate": 2.0},
]
_CATCH = [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": "Abandoned"}]


def _task(action: str, next_state: str, comment: str) -> dict[str, Any]:
    return {
        "Type": "Task",
        "Comment": comment,
        "Resource": RESOURCE,
        "Parameters": {"action": action, "attempt.$": "$.attempt", "step.$": "$.step"},
        "ResultPath": "$.step",
        "TimeoutSeconds": 120,
        "Retry": copy.deepcopy(_RETRY),
        "Catch": copy.deepcopy(_CATCH),
        "Next": next_state,
    }


def _choice(variable: str, routes: dict[str, str], default: str, comment: str) -> dict[str, Any]:
    return {
        "Type": "Choice",
        "Comment": comment,
        "Choices": [{"Variable": variable, "StringEquals": value, "Next": state} for value, state in routes.items()],
        "Default": default,
    }


_DEFINITION: dict[str, Any] = {
    "Comment": "AiVedio attempt: submit, choice on outcome, wait for completion, SUBMIT_UNKNOWN resolution, finalize",
    "StartAt": "Begin",
    "States": {
        "Begin": _task("begin", "ChooseNext", "read PostgreSQL: where does this attempt stand?"),
        "ChooseNext": _choice("$.step.next", {
            "submit": "Submit", "check": "Check", "resolve": "ResolveUnknown", "cancel": "Cancel",
            "wait": "WaitThen", "manual_review": "ManualReview", "done": "Finalize",
        }, "Finalize", "choice on the outcome of the last step"),
        "Submit": _task("submit", "ChooseNext", "submit with the attempt's stable idempotency key"),
        "Check": _task("check", "ChooseNext", "poll the provider; the same transition function as callbacks"),
        "ResolveUnknown": _task("resolve", "ChooseNext", "SUBMIT_UNKNOWN: look the job up by its idempotency key"),
        "Cancel": _task("cancel", "ChooseNext", "CANCEL_REQUESTED: ask the provider, then read the job"),
        "WaitThen": {"Type": "Wait", "Comment": "staged polling and backoff, as the step decided",
                     "SecondsPath": "$.step.wait_seconds", "Next": "ChooseAfterWait"},
        "ChooseAfterWait": _choice("$.step.then", {"check": "Check", "resolve": "ResolveUnknown", "cancel": "Cancel"},
                                   "Begin", "the step that asked for the wait"),
        "ManualReview": {"Type": "Pass", "Comment": "recorded and alerted by the step; reservations are kept",
                         "Next": "Finalize"},
        "Finalize": _task("finalize", "Finished", "report the end state; repair a leaked reservation"),
        "Finished": {"Type": "Succeed"},
        "Abandoned": {"Type": "Fail", "Error": "AttemptStepFailed",
                      "Cause": "a step failed unexpectedly; the lease scanner restarts the attempt"},
    },
    "TimeoutSeconds": 7 * 24 * 3600,
}


def definition() -> dict[str, Any]:
    """The state machine, with ${AttemptStepFunctionArn} still to be substituted."""
    return copy.deepcopy(_DEFINITION)


def definition_json() -> str:
    return json.dumps(_DEFINITION, sort_keys=True, separators=(",", ":"))


def substitute(doc: dict[str, Any] | str, substitutions: dict[str, str]) -> dict[str, Any]:
    """What Step Functions does with definition substitutions: replace each ${Name}."""
    text = doc if isinstance(doc, str) else json.dumps(doc)
    for name, value in substitutions.items():
        text = text.replace("${" + name + "}", value)
    return json.loads(text)


def execution_input(attempt: dict[str, Any]) -> dict[str, Any]:
    """The input an execution starts with: the attempt and an empty step (the Task parameters
    read $.step, which must exist)."""
    return {"attempt": attempt, "step": {"next": "begin"}}
