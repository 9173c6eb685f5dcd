"""Dead letters in AWS: every consumer's DLQ is kept (14 days) and alarms to the alarm topic as soon as
it holds a message, naming its redrive path (`aivedio admin queue redrive`); the outbox's own dead
letters alarm through the OutboxDeadLetters gauge, which its service publishes on every run, so a
gauge gone missing (the service stopped) alarms too; and the redrive path grants no function
anything (it is an operator command run with the operator's credentials)."""
from __future__ import annotations

import pytest

pytest.importorskip("aws_cdk", reason="the cdk extra is not installed: pip install -e '.[cdk]'")
pytest.importorskip("cdk_nag", reason="the cdk extra is not installed: pip install -e '.[cdk]'")

import json

from aivedio import events_routing
from aivedio import metrics_catalog as mc
from aivedio.reconcile import outbox_dead_letters as svc
from infra_cdk.messaging import DLQ_RETENTION_DAYS
from tests.infra.helpers import alarm_topic as _topic
from tests.infra.helpers import alarms as _alarms
from tests.infra.helpers import queue_name


def test_each_dlq_is_kept_and_alarms_on_its_first_message(synth, stage):
    queues = {r["Properties"]["QueueName"]: lid for lid, r in synth.resources(stage, "App", "AWS::SQS::Queue").items()}
    resources = synth.template_json(stage, "App")["Resources"]
    alarms, topic = _alarms(synth, stage), _topic(synth, stage)
    for consumer in events_routing.consumers():
        dlq = f"{queue_name(stage, consumer)}-dlq"
        assert resources[queues[dlq]]["Properties"]["MessageRetentionPeriod"] == DLQ_RETENTION_DAYS * 86400
        a = alarms[f"aivedio-{stage}-dlq-{consumer.replace('_', '-')}"]
        assert (a["Namespace"], a["MetricName"], a["Threshold"], a["ComparisonOperator"], a["EvaluationPeriods"]) == (
            "AWS/SQS", "ApproximateNumberOfMessagesVisible", 0, "GreaterThanThreshold", 1)
        [dim] = a["Dimensions"]
        assert dim["Name"] == "QueueName" and dim["Value"] == {"Fn::GetAtt": [queues[dlq], "QueueName"]}
        assert a["AlarmActions"] == [topic] and a["OKActions"] == [topic]
        assert f"aivedio admin queue redrive --queue {queue_name(stage, consumer)}" in a["AlarmDescription"]


def test_outbox_dead_letters_alarm_on_the_gauge(synth, stage):
    a = _alarms(synth, stage)[f"aivedio-{stage}-outbox-dead-letters"]
    assert (a["Namespace"], a["MetricName"], a["Statistic"]) == (mc.NAMESPACE, mc.OUTBOX_DEAD_LETTERS.name,
                                                                 mc.OUTBOX_DEAD_LETTERS.statistic)
    assert a["Dimensions"] == [{"Name": "service", "Value": mc.SERVICE}]
    # Published every run, 0 included: no datapoint over two runs means the service stopped.
    every = events_routing.schedule(svc.NAME).aws_every_minutes
    assert (a["Threshold"], a["ComparisonOperator"], a["TreatMissingData"]) == (0, "GreaterThanThreshold", "breaching")
    assert (a["Period"], a["EvaluationPeriods"]) == (2 * every * 60, 1)
    assert a["AlarmActions"] == [_topic(synth, stage)] and a["OKActions"] == [_topic(synth, stage)]
    assert "not running" in a["AlarmDescription"]
    dash = next(iter(synth.resources(stage, "App", "AWS::CloudWatch::Dashboard").values()))
    assert mc.OUTBOX_DEAD_LETTERS.name in json.dumps(dash["Properties"]["DashboardBody"])


def test_no_function_may_move_messages_between_queues(synth, stage):
    """The redrive is the operator's: sqs:StartMessageMoveTask is granted to no role of the app."""
    template = synth.template_json(stage, "App")
    actions = []
    for r in template["Resources"].values():
        docs = [p["PolicyDocument"] for p in r["Properties"].get("Policies", [])] if r["Type"] == "AWS::IAM::Role" else []
        if r["Type"] == "AWS::IAM::Policy":
            docs.append(r["Properties"]["PolicyDocument"])
        for d in docs:
            for s in d["Statement"]:
                actions += s["Action"] if isinstance(s["Action"], list) else [s["Action"]]
    assert actions and not [a for a in actions if "MessageMoveTask" in a or a in ("sqs:*", "*")]
