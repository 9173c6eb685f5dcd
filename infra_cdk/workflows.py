"""Step Functions: the attempt state machine.

Issue 7 asks for the attempt lifecycle's state machine built from the project's single workflow
definition (one definition that the local workflow runner executes and that Step Functions runs in
AWS). That definition does not exist yet: it arrives with the attempt-lifecycle issue. Until
then this construct creates nothing, and the stacks synthesize without a state machine.

When the definition exists, `Workflows(..., definition=<path to the ASL JSON>)`:
- loads the JSON unchanged (`DefinitionBody.from_file` / `from_string`), so the test "the state
  machine's definition equals the project's workflow definition" compares the template's
  DefinitionString with that file;
- maps each Task's Lambda resource placeholder (e.g. `${SubmitAttemptFunctionArn}`) to a function
  of infra_cdk/functions.py through `definition_substitutions`, and grants the state machine's
  role lambda:InvokeFunction on exactly those functions;
- turns on logging (ALL, a log group with the stage's retention, include execution data off)
  and X-Ray tracing; the type is STANDARD (waits of minutes, exactly-once transitions);
- gives the function that starts executions (the consumer of TaskDispatchRequested)
  states:StartExecution on this state machine only.
The VPC already has the Step Functions endpoint for that starter function."""
from __future__ import annotations

from pathlib import Path

from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from infra_cdk.functions import Functions
from infra_cdk.stages import StageConfig


class Workflows(Construct):
    def __init__(self, scope: Construct, cid: str, *, stage: StageConfig, functions: Functions,
                 definition: Path | None = None, substitutions: dict[str, str] | None = None) -> None:
        super().__init__(scope, cid)
        self.state_machine: sfn.StateMachine | None = None
        if definition is None:
            return  # no workflow definition in the project yet (see the module docstring)
        log_group = logs.LogGroup(self, "Logs", retention=stage.log_retention, removal_policy=stage.removal_policy)
        subs = substitutions or {}
        self.state_machine = sfn.StateMachine(
            self, "AttemptLifecycle", state_machine_name=f"{stage.prefix}-attempt",
            definition_body=sfn.DefinitionBody.from_file(str(definition)),
            definition_substitutions={k: functions[v].function.function_arn for k, v in subs.items()},
            state_machine_type=sfn.StateMachineType.STANDARD,
            logs=sfn.LogOptions(destination=log_group, level=sfn.LogLevel.ALL, include_execution_data=False),
            tracing_enabled=True,
        )
        for name in set(subs.values()):
            functions[name].function.grant_invoke(self.state_machine)

    def grant_start(self, grantee: iam.IGrantable) -> None:
        if self.state_machine is not None:
            self.state_machine.grant_start_execution(grantee)
