"""Queues, DLQs and schedules come from aivedio.events_routing, the table the local runtime reads."""
from __future__ import annotations

import pytest

pytest.importorskip("aws_cdk", reason="the cdk extra is not installed: pip install -e '.[cdk]'")
pytest.importorskip("cdk_nag", reason="the cdk extra is not installed: pip install -e '.[cdk]'")

import json
import re
from types import SimpleNamespace

from aivedio import events_routing
from aivedio.config import PlatformConfig
from aivedio.local import runtime
from infra_cdk.functions import PROFILES
from infra_cdk.messaging import MAX_RECEIVES, VISIBILITY_TIMEOUT_FACTOR
from tests.infra.helpers import lambdas, queue_name


def _queues(synth, stage):
    return {r["Properties"]["QueueName"]: (lid, r) for lid, r in synth.resources(stage, "App", "AWS::SQS::Queue").items()}


def test_each_queue_consumer_has_a_dlq_and_reports_partial_failures(synth, stage):
    template = synth.template_json(stage, "App")
    fns = lambdas(template)
    queues = _queues(synth, stage)
    by_id = {lid: name for name, (lid, _) in queues.items()}
    mappings = synth.resources(stage, "App", "AWS::Lambda::EventSourceMapping")
    consumers = events_routing.consumers()
    assert consumers, "the routing table has consumers"
    for consumer in consumers:
        fn_id = fns[consumer]["logical_id"]
        mine = [m for m in mappings.values() if m["Properties"]["FunctionName"] == {"Ref": fn_id}]
        assert len(mine) == 1, f"{consumer}: {len(mine)} event source mappings"
        props = mine[0]["Properties"]
        assert by_id[props["EventSourceArn"]["Fn::GetAtt"][0]] == queue_name(stage, consumer)
        assert props["FunctionResponseTypes"] == ["ReportBatchItemFailures"]
        _, queue = queues[queue_name(stage, consumer)]
        redrive = queue["Properties"]["RedrivePolicy"]
        assert redrive["maxReceiveCount"] == MAX_RECEIVES
        assert by_id[redrive["deadLetterTargetArn"]["Fn::GetAtt"][0]] == f"{queue_name(stage, consumer)}-dlq"
        assert queue["Properties"]["VisibilityTimeout"] >= VISIBILITY_TIMEOUT_FACTOR * PROFILES[consumer].timeout_seconds
    # Every event source mapping belongs to a consumer of the table, and every mapped queue has a DLQ.
    assert len(mappings) == len(consumers)


def test_queues_are_encrypted_and_tls_only(synth, stage):
    policies = synth.resources(stage, "App", "AWS::SQS::QueuePolicy")
    secured = {json.dumps(q) for p in policies.values() for q in p["Properties"]["Queues"]
               if "aws:SecureTransport" in json.dumps(p["Properties"]["PolicyDocument"])}
    for name, (lid, q) in _queues(synth, stage).items():
        assert q["Properties"]["SqsManagedSseEnabled"] is True, name
        assert json.dumps({"Ref": lid}) in secured, f"{name} accepts plain HTTP"


def test_the_relay_routes_each_event_type_to_its_consumers_queue(synth, stage):
    template = synth.template_json(stage, "App")
    relay = lambdas(template)["outbox_relay"]
    raw = relay["Properties"]["Environment"]["Variables"]["AIVEDIO_EVENT_QUEUES"]
    rendered = _render(raw, template)
    routes = json.loads(rendered)
    want = {s.event_type: queue_name(stage, s.consumer) for s in events_routing.SUBSCRIPTIONS}
    want["*"] = queue_name(stage, "unrouted")
    assert routes == want


def _render(value, template) -> str:
    """A Fn::Join of literals and queue Refs, with each Ref replaced by the queue's name."""
    names = {lid: r["Properties"]["QueueName"] for lid, r in template["Resources"].items() if r["Type"] == "AWS::SQS::Queue"}
    if isinstance(value, str):
        return value
    sep, parts = value["Fn::Join"]
    return sep.join(p if isinstance(p, str) else names[p["Ref"]] for p in parts)


def test_each_schedule_invokes_its_function(synth, stage):
    template = synth.template_json(stage, "App")
    fns = lambdas(template)
    rules = {r["Properties"]["Name"]: r for r in synth.resources(stage, "App", "AWS::Events::Rule").values()}
    for s in events_routing.SCHEDULES:
        rule = rules[f"aivedio-{stage}-{s.name}"]
        unit = "minute" if s.aws_every_minutes == 1 else "minutes"
        assert rule["Properties"]["ScheduleExpression"] == f"rate({s.aws_every_minutes} {unit})"
        [target] = rule["Properties"]["Targets"]
        assert target["Arn"] == {"Fn::GetAtt": [fns[s.function]["logical_id"], "Arn"]}
        assert target["RetryPolicy"]["MaximumRetryAttempts"] == 0
    assert len(rules) == len(events_routing.SCHEDULES)


def test_the_local_runtime_reads_the_same_table():
    """Local loops are exactly the AWS schedules (same names, same handlers); local subscriptions
    are exactly the AWS queue consumers."""
    platform = SimpleNamespace(config=PlatformConfig())
    loops = {loop.name for loop in runtime.default_loops(platform)}
    assert loops == {s.name for s in events_routing.SCHEDULES}
    assert runtime.SUBSCRIPTIONS == [(s.event_type, s.module) for s in events_routing.SUBSCRIPTIONS]
    for s in events_routing.SCHEDULES + events_routing.SUBSCRIPTIONS:
        assert re.fullmatch(r"functions\.[a-z_]+\.handler", s.module)
        assert s.module.split(".")[1] in PROFILES
