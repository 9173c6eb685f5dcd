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
from aivedio_tools.local import runtime
from infra_cdk.functions import PROFILES
from infra_cdk.messaging import MAX_RECEIVES, VISIBILITY_TIMEOUT_FACTOR
from tests.infra.helpers import capabilities, lambdas, queue_name


def _queues(synth, stage):
    return {r["Properties"]["QueueName"]: (lid, r) for lid, r in synth.resources(stage, "App", "AWS::SQS::Queue").items()}


def test_each_queue_consumer_has_a_dlq_and_reports_partial_failures(synth, stage):
    template = synth.template_json(stage, "App")
    fns = lambdas(template)
    queues = _queues(synth, stage)
    by_id = {lid: name for name, (lid, _) in queues.items()}
    mappings = synth.resources(stage, "App", "AWS::Lambda::EventSourceMapping")
    consumers = events_routing.queue_consumers()  # outbox events' consumers and AWS events' (Batch)
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


def _rate(minutes: int) -> str:
    """EventBridge's rate expression as CDK writes it: in the largest whole unit."""
    for size, unit in ((1440, "day"), (60, "hour"), (1, "minute")):
        if minutes % size == 0:
            n = minutes // size
            return f"rate({n} {unit}{'' if n == 1 else 's'})"
    raise AssertionError(minutes)


def test_each_schedule_invokes_its_function(synth, stage):
    template = synth.template_json(stage, "App")
    fns = lambdas(template)
    rules = {r["Properties"]["Name"]: r for r in synth.resources(stage, "App", "AWS::Events::Rule").values()}
    for s in events_routing.SCHEDULES:
        rule = rules[f"aivedio-{stage}-{s.name}"]
        assert rule["Properties"]["ScheduleExpression"] == _rate(s.aws_every_minutes)
        [target] = rule["Properties"]["Targets"]
        assert target["Arn"] == {"Fn::GetAtt": [fns[s.function]["logical_id"], "Arn"]}
        assert target["RetryPolicy"]["MaximumRetryAttempts"] == 0
        if s.payload is None:
            assert "Input" not in target, s.name
        else:  # a maintenance service: functions/maintenance runs the service its input names
            assert s.function == "maintenance" and json.loads(target["Input"]) == {"service": s.name}
    assert len(rules) == len(events_routing.SCHEDULES) + len(events_routing.AWS_EVENTS)  # + the AWS events' rules


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


# --- continuous schedules: the relay and the tick are always running -----------------------------

def test_continuous_schedules_always_have_a_run_in_progress(synth, stage):
    """Each run polls until RESERVE before its timeout, which is two schedule periods: a new run
    starts every minute while the last still polls, so one is always there; the stage leaves room
    for the two at once; a stale event is dropped, never retried."""
    from functions.outbox_relay.handler import RESERVE_MILLIS as RELAY_RESERVE
    from functions.scheduler_tick.handler import RESERVE_MILLIS as TICK_RESERVE
    from infra_cdk.messaging import CONTINUOUS_PERIODS, CONTINUOUS_RUNS

    template = synth.template_json(stage, "App")
    fns = lambdas(template)
    rules = {r["Properties"]["Name"]: r for r in synth.resources(stage, "App", "AWS::Events::Rule").values()}
    configs = {r["Properties"]["FunctionName"]["Ref"]: r["Properties"]
               for r in template["Resources"].values() if r["Type"] == "AWS::Lambda::EventInvokeConfig"}
    continuous = {s.function: s for s in events_routing.SCHEDULES if s.continuous}
    assert set(continuous) == {"outbox_relay", "scheduler_tick"}
    reserve = {"outbox_relay": RELAY_RESERVE, "scheduler_tick": TICK_RESERVE}
    for name, s in continuous.items():
        props = fns[name]["Properties"]
        assert rules[f"aivedio-{stage}-{s.name}"]["Properties"]["ScheduleExpression"] == "rate(1 minute)"
        period = 60 * s.aws_every_minutes
        assert props["Timeout"] == CONTINUOUS_PERIODS * period == 120
        run_seconds = props["Timeout"] - reserve[name] / 1000
        assert period < run_seconds < 2 * period, f"{name}: a run of {run_seconds}s must outlast one period, not two"
        assert props.get("ReservedConcurrentExecutions") >= CONTINUOUS_RUNS, name
        cfg = configs[fns[name]["logical_id"]]
        assert cfg["MaximumRetryAttempts"] == 0 and cfg["MaximumEventAgeInSeconds"] == 60
        # Between idle polls they wait for wake-ups on Redis (aivedio.wakeups).
        assert props["Environment"]["Variables"]["AIVEDIO_REDIS_URL"] != "none", name


def test_the_relay_and_the_tick_may_do_exactly_what_polling_needs(synth, stage):
    """IAM least privilege for the two continuous functions, spelled out: the database, the Redis
    secret (wake-ups), and for the relay sending to the event queues; nothing else (no Lambda
    invoke, no queue to consume)."""
    template = synth.template_json(stage, "App")
    fns = lambdas(template)
    base = {"logs", "vpc-eni", "xray", "config-parameter", "db", "redis-secret"}
    sends = {f"send:{queue_name(stage, c)}" for c in events_routing.consumers()} | {f"send:{queue_name(stage, 'unrouted')}"}
    assert capabilities(template, fns["scheduler_tick"]) == base
    assert capabilities(template, fns["outbox_relay"]) == base | sends


def test_a_continuous_schedule_needs_a_long_enough_run_and_room_for_two(monkeypatch):
    from dataclasses import replace

    from infra_cdk import messaging
    from infra_cdk.stages import STAGES

    s = events_routing.schedule(events_routing.RELAY)
    fn = SimpleNamespace(profile=replace(PROFILES["outbox_relay"], timeout_seconds=60))
    with pytest.raises(SystemExit, match="timeout"):
        messaging._check_continuous(s, fn, STAGES["dev"])
    fn = SimpleNamespace(profile=PROFILES["outbox_relay"])
    stage = replace(STAGES["dev"], reserved_concurrency={**STAGES["dev"].reserved_concurrency, "outbox_relay": 1})
    with pytest.raises(SystemExit, match="at least 2"):
        messaging._check_continuous(s, fn, stage)
    messaging._check_continuous(s, fn, STAGES["dev"])


def test_queue_consumers_are_invoked_without_a_batching_window(synth, stage):
    """A TaskQueued and a TaskDispatchRequested each cross one queue on the way to the provider: a
    batching window would add up to its length to each hop, so none is configured (the mapping
    invokes as soon as its long poll returns messages)."""
    mappings = synth.resources(stage, "App", "AWS::Lambda::EventSourceMapping")
    assert mappings
    for m in mappings.values():
        assert m["Properties"].get("MaximumBatchingWindowInSeconds", 0) == 0, m["Properties"]["FunctionName"]
