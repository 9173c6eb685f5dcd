"""One step of the attempt workflow: Step Functions invokes it for each Task state of the
definition in aivedio.attempts.workflow; locally the workflow runner calls this same handler.
Event: {"action": "begin|submit|check|resolve|cancel|finalize", "attempt": {...}, "step": {...}}.
The answer is the step's result, which the state machine routes on. A step that wrote events wakes
the outbox relay (in AWS this function has no Redis, so there the relay's poll interval applies)."""
from __future__ import annotations

from aivedio.attempts.steps import run_action
from aivedio.context import get_platform
from aivedio.observability import logger
from aivedio.outbox import waking_relay


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    attempt = event["attempt"]
    logger.append_keys(tenant_id=attempt.get("tenant_id"), task_id=attempt.get("task_id"), attempt_id=attempt.get("attempt_id"))
    with waking_relay():  # a terminal event (capacity released), a requeue: relayed now where the relay can be woken
        return run_action(get_platform(), event["action"], attempt, event.get("step"))
