"""Reading the synthesized templates: functions, their roles, what each role may do."""
from __future__ import annotations

import json
from typing import Any

from aivedio import events_routing
from infra_cdk.functions import PROFILES, FunctionProfile
from infra_cdk.stages import STAGES


def function_name(stage: str, name: str) -> str:
    return f"{STAGES[stage].prefix}-{name.replace('_', '-')}"


def queue_name(stage: str, consumer: str) -> str:
    return f"{STAGES[stage].prefix}-{consumer}"


def lambdas(template: dict) -> dict[str, dict]:
    """Function name (as under functions/) -> the function's resource, for the platform's functions."""
    out = {}
    for lid, r in template["Resources"].items():
        if r["Type"] != "AWS::Lambda::Function":
            continue
        handler = r["Properties"].get("Handler", "")
        if handler.startswith("functions."):
            out[handler.split(".")[1]] = {"logical_id": lid, **r}
    return out


def role_logical_id(fn: dict) -> str:
    return fn["Properties"]["Role"]["Fn::GetAtt"][0]


def statements_of_role(template: dict, role_id: str) -> list[dict]:
    res = template["Resources"]
    role = res[role_id]
    stmts = []
    for p in role["Properties"].get("Policies", []):
        stmts += p["PolicyDocument"]["Statement"]
    for r in res.values():
        if r["Type"] == "AWS::IAM::Policy" and {"Ref": role_id} in r["Properties"].get("Roles", []):
            stmts += r["Properties"]["PolicyDocument"]["Statement"]
    return stmts


def _listify(v: Any) -> list:
    return v if isinstance(v, list) else [v]


def _queue_names(template: dict) -> dict[str, str]:
    return {lid: r["Properties"]["QueueName"] for lid, r in template["Resources"].items() if r["Type"] == "AWS::SQS::Queue"}


def _ref_id(resource: Any) -> str | None:
    if isinstance(resource, dict):
        if "Fn::GetAtt" in resource:
            return resource["Fn::GetAtt"][0]
        if "Ref" in resource:
            return resource["Ref"]
    return None


def capabilities(template: dict, fn: dict) -> set[str]:
    """What a function's role allows, as labels; anything unforeseen becomes other:<action>."""
    queues = _queue_names(template)
    caps: set[str] = set()
    for st in statements_of_role(template, role_logical_id(fn)):
        assert st["Effect"] == "Allow", st
        resources = _listify(st["Resource"])
        for action in _listify(st["Action"]):
            service = action.split(":")[0]
            if action in ("logs:CreateLogStream", "logs:PutLogEvents"):
                own = fn["Properties"]["LoggingConfig"]["LogGroup"]["Ref"]
                assert all(_ref_id(r) == own for r in resources), f"{action} beyond its own log group: {resources}"
                caps.add("logs")
            elif action.startswith("ec2:") and action.endswith(("NetworkInterface", "NetworkInterfaces", "PrivateIpAddresses")):
                caps.add("vpc-eni")
            elif action in ("xray:PutTraceSegments", "xray:PutTelemetryRecords"):
                caps.add("xray")
            elif action == "rds-db:connect":
                caps.add("db")
            elif action == "states:StartExecution":
                for r in resources:
                    machine = template["Resources"][_ref_id(r)]
                    assert machine["Type"] == "AWS::StepFunctions::StateMachine", r
                    caps.add(f"start-workflow:{machine['Properties']['StateMachineName']}")
            elif action in ("secretsmanager:GetSecretValue", "secretsmanager:DescribeSecret"):
                for r in resources:
                    text = json.dumps(r)
                    kind = "redis-secret" if "RedisUserSecret" in text else "provider-secret" \
                        if "ProviderCredentialsSecret" in text else None
                    assert kind is not None, f"{action} on an unforeseen secret: {r}"
                    caps.add(kind)
            elif service == "ssm":
                assert action in ("ssm:DescribeParameters", "ssm:GetParameters", "ssm:GetParameter",
                                  "ssm:GetParameterHistory"), action
                for r in resources:
                    assert "/platform-config" in json.dumps(r) or "PlatformConfigParameter" in json.dumps(r), r
                caps.add("config-parameter")
            elif service == "sqs":
                kind = "send" if action in ("sqs:SendMessage", "sqs:GetQueueAttributes", "sqs:GetQueueUrl") and \
                    "sqs:ReceiveMessage" not in _listify(st["Action"]) else "consume"
                for r in resources:
                    caps.add(f"{kind}:{queues[_ref_id(r)]}")
            elif action == "batch:SubmitJob":
                for r in resources:
                    target = template["Resources"][_ref_id(r)]
                    props = target["Properties"]
                    assert target["Type"] in ("AWS::Batch::JobQueue", "AWS::Batch::JobDefinition"), r
                    kind = "queue" if target["Type"] == "AWS::Batch::JobQueue" else "definition"
                    caps.add(f"batch-submit-{kind}:{props.get('JobQueueName') or props.get('JobDefinitionName')}")
            elif action == "batch:DescribeJobs":
                assert resources == ["*"], resources  # no resource-level permissions exist for it
                caps.add("batch-describe")
            elif action == "s3:ListBucket":
                assert all("BucketsMedia" in json.dumps(r) for r in resources), resources
                for prefix in st["Condition"]["StringLike"]["s3:prefix"]:
                    caps.add(f"s3-list:{prefix.rstrip('*')}")
            elif action in ("s3:GetObject", "s3:PutObject", "s3:PutObjectTagging"):
                kind = "s3-read" if action == "s3:GetObject" else "s3-write"
                for r in resources:
                    text = json.dumps(r)
                    if "BucketsInvoiceArchive" in text:  # the whole archive: content-addressed keys
                        caps.add(f"invoices-{kind.split('-')[1]}")
                        continue
                    assert "BucketsMedia" in text, text
                    caps.add(f"{kind}:{r['Fn::Join'][1][-1].lstrip('/').rstrip('*')}")
            else:
                caps.add(f"other:{action}")
    return caps


def expected_capabilities(stage: str, name: str, profile: FunctionProfile) -> set[str]:
    caps = {"logs", "vpc-eni", "xray", "config-parameter"}
    if profile.provider_credentials:
        caps.add("provider-secret")
    if profile.database:
        caps.add("db")
    if profile.redis:
        caps.add("redis-secret")
    if profile.publishes_events:
        caps |= {f"send:{queue_name(stage, c)}" for c in events_routing.consumers()}
        caps.add(f"send:{queue_name(stage, 'unrouted')}")
    if name in events_routing.queue_consumers():
        caps.add(f"consume:{queue_name(stage, name)}")
    if profile.submits_media_jobs:
        from infra_cdk.media import MEDIA_CLASSES

        caps |= {f"batch-submit-{kind}:{STAGES[stage].prefix}-{mc.name}" for mc in MEDIA_CLASSES
                 for kind in ("queue", "definition")}
    if profile.describes_media_jobs:
        caps.add("batch-describe")
    caps |= {f"s3-list:{p}" for p in profile.media_list_prefixes}
    if profile.starts_workflow:
        caps.add(f"start-workflow:{STAGES[stage].prefix}-attempt")
    caps |= {f"s3-read:{p}" for p in profile.media_read_prefixes}
    caps |= {f"s3-write:{p}" for p in profile.media_write_prefixes}
    if profile.archives_invoices:
        caps |= {"invoices-read", "invoices-write"}
    return caps


__all__ = ["PROFILES", "capabilities", "expected_capabilities", "lambdas", "function_name", "queue_name",
           "statements_of_role", "role_logical_id"]


def alarms(synth, stage: str) -> dict[str, dict]:
    """The App stack's CloudWatch alarms' properties by alarm name."""
    return {r["Properties"]["AlarmName"]: r["Properties"] for r in synth.resources(stage, "App", "AWS::CloudWatch::Alarm").values()}


def alarm_topic(synth, stage: str) -> dict:
    """A Ref to the App stack's one SNS topic, where alarms page."""
    [topic_id] = synth.resources(stage, "App", "AWS::SNS::Topic")
    return {"Ref": topic_id}
