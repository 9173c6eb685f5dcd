"""Step Functions: the attempt state machine, from the project's single workflow definition.

`aivedio.attempts.workflow.definition_json()` is the one document the local workflow runner also
executes. It goes in unchanged (`DefinitionBody.from_string`), so the template's DefinitionString
is that document, and each Task's `${AttemptStepFunctionArn}` is filled in by CloudFormation
through `DefinitionSubstitutions` with the attempt_step function's ARN.

- Type STANDARD: waits of minutes to hours, exactly-once state transitions, a week's timeout.
- Logging: level ALL (every state transition, which cdk-nag's SF1 asks for) to a log group under
  /aws/vendedlogs/states/ (Step Functions' recommended prefix: no per-group resource policy to
  outgrow), with execution data off: inputs and outputs stay in the execution history, visible to
  who may read the state machine, not in a log group readable more widely. X-Ray tracing is on.
- Role: lambda:InvokeFunction on exactly the substituted functions' unqualified ARNs (the Task
  resources name no version or alias), plus what CDK adds for log delivery and X-Ray, which
  support no resource-level permissions.
- Starting executions: functions whose profile says `starts_workflow` (dispatch, the lease
  scanner) get states:StartExecution on this state machine only and its ARN in
  AIVEDIO_ATTEMPT_STATE_MACHINE_ARN (Functions.connect_workflow). They reach Step Functions through
  the VPC endpoint, from isolated subnets.

No reference cycle: the state machine, the functions and their roles live in one stack (the app
stack). The state machine refers to attempt_step's ARN; dispatch's role and environment refer to
the state machine's ARN; nothing refers back."""
from __future__ import annotations

from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from infra_cdk.functions import Functions
from infra_cdk.nag import suppress
from infra_cdk.stages import StageConfig


class Workflows(Construct):
    """`definition`: the ASL JSON text with ${Placeholder}s; `substitutions`: placeholder -> the
    name of the function (as under functions/) whose ARN replaces it."""

    def __init__(self, scope: Construct, cid: str, *, stage: StageConfig, functions: Functions,
                 definition: str | None = None, substitutions: dict[str, str] | None = None) -> None:
        super().__init__(scope, cid)
        self.state_machine: sfn.StateMachine | None = None
        if definition is None:
            return
        subs = substitutions or {}
        for placeholder in subs:
            if "${" + placeholder + "}" not in definition:
                raise ValueError(f"substitution {placeholder!r} does not occur in the workflow definition")
        name = f"{stage.prefix}-attempt"
        self.log_group = logs.LogGroup(self, "Logs", log_group_name=f"/aws/vendedlogs/states/{name}",
                                       retention=stage.log_retention, removal_policy=stage.removal_policy)
        self.state_machine = sfn.StateMachine(
            self, "AttemptLifecycle", state_machine_name=name,
            definition_body=sfn.DefinitionBody.from_string(definition),
            definition_substitutions={k: functions[v].function.function_arn for k, v in subs.items()},
            state_machine_type=sfn.StateMachineType.STANDARD,
            logs=sfn.LogOptions(destination=self.log_group, level=sfn.LogLevel.ALL, include_execution_data=False),
            tracing_enabled=True,
        )
        invoked = sorted(set(subs.values()))
        if invoked:
            # Not grant_invoke: that also allows every version and alias (ARN:*), which no Task names.
            self.state_machine.add_to_role_policy(iam.PolicyStatement(
                actions=["lambda:InvokeFunction"], resources=[functions[n].function.function_arn for n in invoked]))
        suppress(self.state_machine.role, (
            "AwsSolutions-IAM5", "Step Functions log delivery (logs:*LogDelivery*, Describe/PutResourcePolicy, "
                                 "DescribeLogGroups) and X-Ray (PutTraceSegments, PutTelemetryRecords, "
                                 "GetSampling*) support no resource-level permissions; the only other statement "
                                 "invokes the attempt_step function by its ARN.",
            ["Resource::*"]), children=True)

    def grant_start(self, grantee: iam.IGrantable) -> None:
        """states:StartExecution on this state machine, nothing else."""
        if self.state_machine is not None:
            self.state_machine.grant_start_execution(grantee)
