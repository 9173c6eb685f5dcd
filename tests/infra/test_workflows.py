"""The attempt state machine is the project's one workflow definition (aivedio.attempts.workflow),
its Tasks invoke attempt_step and nothing else, and only the functions that start executions
(dispatch, the lease scanner) may start them, on that state machine only."""
from __future__ import annotations

import pytest

pytest.importorskip("aws_cdk", reason="the cdk extra is not installed: pip install -e '.[cdk]'")
pytest.importorskip("cdk_nag", reason="the cdk extra is not installed: pip install -e '.[cdk]'")

import json

from aivedio import events_routing
from aivedio.attempts.workflow import RESOURCE, STEP_FUNCTION_PLACEHOLDER, definition, substitute
from infra_cdk.functions import PROFILES, STATE_MACHINE_ENV
from infra_cdk.stages import STAGES
from tests.infra.helpers import capabilities, lambdas, queue_name, role_logical_id, statements_of_role

FAKE_STEP_ARN = "arn:aws:lambda:eu-west-1:123456789012:function:aivedio-test-attempt-step"
STARTERS = {"dispatch", "attempt_recovery"}
# What CDK grants a state machine for log delivery and X-Ray: no resource-level permissions exist.
LOG_DELIVERY_AND_XRAY = {
    "logs:CreateLogDelivery", "logs:GetLogDelivery", "logs:UpdateLogDelivery", "logs:DeleteLogDelivery",
    "logs:ListLogDeliveries", "logs:PutResourcePolicy", "logs:DescribeResourcePolicies", "logs:DescribeLogGroups",
    "xray:PutTraceSegments", "xray:PutTelemetryRecords", "xray:GetSamplingRules", "xray:GetSamplingTargets",
}


def _list(v):
    return v if isinstance(v, list) else [v]


def _state_machine(synth, stage) -> tuple[str, dict]:
    machines = synth.resources(stage, "App", "AWS::StepFunctions::StateMachine")
    assert len(machines) == 1, sorted(machines)
    return next(iter(machines.items()))


def _attempt_step(synth, stage) -> dict:
    return lambdas(synth.template_json(stage, "App"))["attempt_step"]


def test_the_definition_is_the_projects_workflow_definition(synth, stage):
    _, sm = _state_machine(synth, stage)
    props = sm["Properties"]
    deployed = json.loads(props["DefinitionString"])  # a plain string: no token was spliced into it
    assert deployed == definition()
    # CloudFormation substitutes the attempt_step function's ARN, and nothing else.
    step = _attempt_step(synth, stage)
    assert props["DefinitionSubstitutions"] == {STEP_FUNCTION_PLACEHOLDER: {"Fn::GetAtt": [step["logical_id"], "Arn"]}}
    # After substitution (what Step Functions runs) it is the project's definition with that ARN.
    running = substitute(props["DefinitionString"], {STEP_FUNCTION_PLACEHOLDER: FAKE_STEP_ARN})
    assert running == substitute(definition(), {STEP_FUNCTION_PLACEHOLDER: FAKE_STEP_ARN})
    assert "${" not in json.dumps(running)
    tasks = {n: s for n, s in running["States"].items() if s["Type"] == "Task"}
    assert tasks and all(s["Resource"] == FAKE_STEP_ARN for s in tasks.values())
    assert {s["Type"] for s in deployed["States"].values()} >= {"Task", "Choice", "Wait", "Pass", "Succeed", "Fail"}
    assert all(s["Resource"] == RESOURCE for s in deployed["States"].values() if s["Type"] == "Task")


def test_standard_type_all_logging_and_xray(synth, stage):
    _, sm = _state_machine(synth, stage)
    props = sm["Properties"]
    prefix = STAGES[stage].prefix
    assert props["StateMachineType"] == "STANDARD"
    assert props["StateMachineName"] == f"{prefix}-attempt"
    assert props["TracingConfiguration"] == {"Enabled": True}
    logging = props["LoggingConfiguration"]
    assert logging["Level"] == "ALL" and logging["IncludeExecutionData"] is False
    [dest] = logging["Destinations"]
    group_id = dest["CloudWatchLogsLogGroup"]["LogGroupArn"]["Fn::GetAtt"][0]
    group = synth.template_json(stage, "App")["Resources"][group_id]
    assert group["Type"] == "AWS::Logs::LogGroup"
    assert group["Properties"]["LogGroupName"] == f"/aws/vendedlogs/states/{prefix}-attempt"
    # The stage's retention, as the functions' log groups have it.
    fn_group = _attempt_step(synth, stage)["Properties"]["LoggingConfig"]["LogGroup"]["Ref"]
    want = synth.template_json(stage, "App")["Resources"][fn_group]["Properties"]["RetentionInDays"]
    assert group["Properties"]["RetentionInDays"] == want == {"dev": 14, "prod": 365}[stage]


def test_the_state_machine_role_can_only_invoke_attempt_step(synth, stage):
    template = synth.template_json(stage, "App")
    _, sm = _state_machine(synth, stage)
    role_id = sm["Properties"]["RoleArn"]["Fn::GetAtt"][0]
    role = template["Resources"][role_id]["Properties"]
    [trust] = role["AssumeRolePolicyDocument"]["Statement"]
    assert trust["Action"] == "sts:AssumeRole" and trust["Principal"] == {"Service": "states.amazonaws.com"}
    assert trust["Condition"]["StringEquals"] == {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}  # confused deputy
    assert not role.get("ManagedPolicyArns")
    step_arn = {"Fn::GetAtt": [_attempt_step(synth, stage)["logical_id"], "Arn"]}
    invokes = []
    for st in statements_of_role(template, role_id):
        assert st["Effect"] == "Allow"
        actions = set(_list(st["Action"]))
        if any(a.startswith("lambda:") for a in actions):
            assert actions == {"lambda:InvokeFunction"}, st
            invokes += _list(st["Resource"])
        else:
            assert actions <= LOG_DELIVERY_AND_XRAY, f"unexpected actions {sorted(actions - LOG_DELIVERY_AND_XRAY)}"
            assert st["Resource"] == "*"
    assert invokes == [step_arn], "lambda:InvokeFunction on the unqualified attempt_step ARN, no :* and nothing else"


def test_only_dispatch_and_the_lease_scanner_start_executions_of_that_state_machine(synth, stage):
    template = synth.template_json(stage, "App")
    sm_id, _ = _state_machine(synth, stage)
    fns = lambdas(template)
    assert {n for n, p in PROFILES.items() if p.starts_workflow} == STARTERS
    for name, fn in fns.items():
        states = [st for st in statements_of_role(template, role_logical_id(fn))
                  if any(a.startswith("states:") for a in _list(st["Action"]))]
        env = fn["Properties"]["Environment"]["Variables"]
        if name in STARTERS:
            assert len(states) == 1, states
            assert _list(states[0]["Action"]) == ["states:StartExecution"]
            assert _list(states[0]["Resource"]) == [{"Ref": sm_id}], "StartExecution on the attempt state machine only"
            assert env[STATE_MACHINE_ENV] == {"Ref": sm_id}
        else:
            assert not states, f"{name} may call Step Functions: {states}"
            assert STATE_MACHINE_ENV not in env, name
    # Nothing else in the stack (other roles, resource policies) grants states:* either.
    for lid, r in template["Resources"].items():
        if r["Type"] in ("AWS::IAM::Policy", "AWS::IAM::ManagedPolicy"):
            for st in r["Properties"]["PolicyDocument"]["Statement"]:
                for a in _list(st["Action"]):
                    assert a in ("states:StartExecution",) or not a.startswith("states:"), (lid, st)


def test_starters_reach_step_functions_through_the_vpc_endpoint(synth, stage):
    template = synth.template_json(stage, "App")
    fns = lambdas(template)
    for name in STARTERS:
        assert not PROFILES[name].internet, f"{name} needs no NAT: Step Functions has a VPC endpoint"
        assert "Vpcisolated" in json.dumps(fns[name]["Properties"]["VpcConfig"]["SubnetIds"]), name
    endpoints = synth.resources(stage, "Data", "AWS::EC2::VPCEndpoint")
    assert any(json.dumps(r["Properties"]["ServiceName"]).rstrip('"]}').endswith(".states") for r in endpoints.values())


def test_attempt_step_reaches_the_providers_and_the_database(synth, stage):
    template = synth.template_json(stage, "App")
    step = _attempt_step(synth, stage)
    profile = PROFILES["attempt_step"]
    assert profile.internet and profile.database
    # Providers: subnets with a NAT route; its security group allows all outbound.
    assert "Vpcegress" in json.dumps(step["Properties"]["VpcConfig"]["SubnetIds"])
    sg_id = step["Properties"]["VpcConfig"]["SecurityGroupIds"][0]["Fn::GetAtt"][0]
    egress = template["Resources"][sg_id]["Properties"]["SecurityGroupEgress"]
    assert {"CidrIp": "0.0.0.0/0", "Description": "Allow all outbound traffic by default", "IpProtocol": "-1"} in egress
    # The database: rds-db:connect, the proxy URL with IAM auth, and an ingress rule on the proxy.
    assert "db" in capabilities(template, step)
    env = step["Properties"]["Environment"]["Variables"]
    assert "AIVEDIO_DATABASE_URL" in env and env["AIVEDIO_DATABASE_IAM_AUTH"] == "1"
    ingress = [r["Properties"] for r in synth.resources(stage, "App", "AWS::EC2::SecurityGroupIngress").values()
               if r["Properties"].get("SourceSecurityGroupId", {}).get("Fn::GetAtt", [None])[0] == sg_id]
    assert any("ProxySg" in json.dumps(i["GroupId"]) for i in ingress), ingress
    # It starts nothing and consumes nothing: Step Functions invokes it.
    assert not [c for c in capabilities(template, step) if c.startswith(("start-workflow", "consume:", "send:"))]


def test_dispatch_consumes_task_dispatch_requested_with_a_dlq(synth, stage):
    """The generic DLQ test (test_messaging.py) covers every consumer; this pins dispatch's."""
    assert "TaskDispatchRequested" in events_routing.consumers()["dispatch"]
    template = synth.template_json(stage, "App")
    queues = {r["Properties"]["QueueName"]: (lid, r) for lid, r in synth.resources(stage, "App", "AWS::SQS::Queue").items()}
    _, queue = queues[queue_name(stage, "dispatch")]
    dlq_id, _ = queues[f"{queue_name(stage, 'dispatch')}-dlq"]
    assert queue["Properties"]["RedrivePolicy"]["deadLetterTargetArn"] == {"Fn::GetAtt": [dlq_id, "Arn"]}
    fn_id = lambdas(template)["dispatch"]["logical_id"]
    [mapping] = [m for m in synth.resources(stage, "App", "AWS::Lambda::EventSourceMapping").values()
                 if m["Properties"]["FunctionName"] == {"Ref": fn_id}]
    assert mapping["Properties"]["FunctionResponseTypes"] == ["ReportBatchItemFailures"]


def test_an_alarm_watches_failed_and_timed_out_executions(synth, stage):
    sm_id, _ = _state_machine(synth, stage)
    alarms = {r["Properties"]["AlarmName"]: r["Properties"]
              for r in synth.resources(stage, "App", "AWS::CloudWatch::Alarm").values()}
    alarm = alarms[f"{STAGES[stage].prefix}-attempt-workflow-failures"]
    watched = {m["MetricStat"]["Metric"]["MetricName"]: m["MetricStat"]["Metric"]["Dimensions"]
               for m in alarm["Metrics"] if "MetricStat" in m}
    assert set(watched) == {"ExecutionsFailed", "ExecutionsTimedOut"}
    assert all(d == [{"Name": "StateMachineArn", "Value": {"Ref": sm_id}}] for d in watched.values())
    assert alarm["Threshold"] == 0 and alarm["AlarmActions"]
