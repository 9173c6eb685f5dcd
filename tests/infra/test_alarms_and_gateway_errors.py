"""What pages and what a tenant reads when AWS answers instead of the handler (issue 29, part 4),
read from the synthesized templates:

- alarms on a task open in manual review, on each degraded mode, on a budget reaching the restrict
  level and on unreconciled cost above the stage's threshold, each on the metric the platform
  publishes (aivedio.metrics_catalog, with the dimensions it publishes), routed to the alarm topic,
  and shown on the dashboard's first row;
- every response API Gateway gives on its own, on both APIs, and the WAF's blocks of the body-size
  and per-address rules, answer in the API's error shape {error, message, details}, from the one
  table the local server answers from (aivedio.gateway_errors)."""
from __future__ import annotations

import pytest

pytest.importorskip("aws_cdk", reason="the cdk extra is not installed: pip install -e '.[cdk]'")
pytest.importorskip("cdk_nag", reason="the cdk extra is not installed: pip install -e '.[cdk]'")

import json

from aivedio import degraded, gateway_errors
from aivedio import metrics_catalog as mc
from aivedio.config import BillingConfig
from aivedio.spend import invoices
from infra_cdk.observability import BUDGET_SCOPES
from infra_cdk.stages import STAGES as STAGE_CONFIGS
from tests.infra.helpers import alarm_topic as _topic
from tests.infra.helpers import alarms as _alarms


def _pages(synth, stage, a: dict, missing: str = "ignore") -> None:
    """Pages the topic both ways. A gauge published by a schedule or on a change keeps its state
    through a period without a datapoint ("ignore"): read as "all clear", a late minute would page OK."""
    assert a["AlarmActions"] == [_topic(synth, stage)] and a["OKActions"] == [_topic(synth, stage)]
    assert a["ComparisonOperator"] == "GreaterThanThreshold" and a["TreatMissingData"] == missing


def _dims(a: dict) -> dict[str, str]:
    return {d["Name"]: d["Value"] for d in a["Dimensions"]}


def test_money_risk_alarms_watch_what_the_platform_publishes_and_page(synth, stage):
    alarms = _alarms(synth, stage)
    prefix = f"aivedio-{stage}"

    review = alarms[f"{prefix}-manual-review-open"]
    assert (review["Namespace"], review["MetricName"], review["Statistic"], review["Threshold"]) == (
        mc.NAMESPACE, mc.MANUAL_REVIEW_OPEN.name, mc.MANUAL_REVIEW_OPEN.statistic, 0)
    assert _dims(review) == {"service": mc.SERVICE}
    _pages(synth, stage, review)

    for mode in degraded.MODES:
        a = alarms[f"{prefix}-degraded-{mode.replace('_', '-')}"]
        assert (a["MetricName"], a["Statistic"], a["Threshold"]) == (mc.DEGRADED_MODE.name, "Maximum", 0)
        assert _dims(a) == {"service": mc.SERVICE, "mode": mode}  # what degraded.enter publishes
        _pages(synth, stage, a)

    restrict = BillingConfig().budget_restrict_pct
    budget = alarms[f"{prefix}-budget-at-{restrict}pct"]
    metrics = {m["Id"]: m for m in budget["Metrics"]}
    [expr] = [m["Expression"] for m in metrics.values() if "Expression" in m]
    watched = [m["MetricStat"]["Metric"] for m in metrics.values() if "MetricStat" in m]
    assert {w["MetricName"] for w in watched} == {mc.BUDGET_ALERTS.name}
    assert sorted(_dims(w)["scope"] for w in watched) == sorted(BUDGET_SCOPES)
    assert {_dims(w)["level"] for w in watched} == {str(restrict)}  # spend.budgets publishes level=str(pct)
    assert all(f"FILL({m['Id']}, 0)" in expr for m in metrics.values() if "MetricStat" in m)
    _pages(synth, stage, budget, "notBreaching")  # FILL(…, 0): no alert published is no budget at the level

    cost = alarms[f"{prefix}-unreconciled-cost"]
    assert (cost["MetricName"], cost["Threshold"]) == (mc.UNRECONCILED_COST.name, STAGE_CONFIGS[stage].unreconciled_cost_alarm_usd)
    # Published once a run of the invoice service: every period it evaluates holds a datapoint.
    assert cost["Period"] * cost["EvaluationPeriods"] >= 2 * invoices.DEFAULTS.interval_seconds and cost["EvaluationPeriods"] == 1
    _pages(synth, stage, cost)

    [dash] = synth.resources(stage, "App", "AWS::CloudWatch::Dashboard").values()
    body = json.dumps(dash["Properties"]["DashboardBody"])
    ids = {lid for lid, r in synth.resources(stage, "App", "AWS::CloudWatch::Alarm").items()
           if r["Properties"]["AlarmName"] in {review["AlarmName"], budget["AlarmName"], cost["AlarmName"]}
           or r["Properties"]["AlarmName"].startswith(f"{prefix}-degraded-")}
    assert len(ids) == 3 + len(degraded.MODES) and all(lid in body for lid in ids)


def _rendered(template: str) -> dict:
    return json.loads(template.replace("$context.requestId", "req-1"))


@pytest.mark.parametrize("kind", ["App"])
def test_every_gateway_response_of_both_apis_answers_in_the_error_shape(synth, stage, kind):
    resources = synth.template_json(stage, kind)["Resources"]
    apis = {lid: r["Properties"]["Name"] for lid, r in resources.items() if r["Type"] == "AWS::ApiGateway::RestApi"}
    assert sorted(apis.values()) == sorted([f"aivedio-{stage}-api", f"aivedio-{stage}-admin-api"])
    responses = [r["Properties"] for r in resources.values() if r["Type"] == "AWS::ApiGateway::GatewayResponse"]
    for api_id in apis:
        mine = {p["ResponseType"]: p for p in responses if p["RestApiId"] == {"Ref": api_id}}
        assert set(mine) == set(gateway_errors.GATEWAY_ERRORS), apis[api_id]
        for response_type, error in gateway_errors.GATEWAY_ERRORS.items():
            p = mine[response_type]
            doc = _rendered(p["ResponseTemplates"]["application/json"])
            assert set(doc) == {"error", "message", "details"} and doc["error"] == error.code
            assert p.get("StatusCode") == (None if error.status is None else str(error.status))
            assert p["ResponseParameters"]["gatewayresponse.header.Content-Type"] == "'application/json'"
            if error.retry_after_seconds is not None:
                assert p["ResponseParameters"]["gatewayresponse.header.Retry-After"] == f"'{error.retry_after_seconds}'"
            if (error.status or 500) >= 500:
                assert doc["details"] == {"request_id": "req-1"}  # as the handler's own 500
    # The contract's own statuses where API Gateway refuses first.
    assert gateway_errors.GATEWAY_ERRORS["REQUEST_TOO_LARGE"].code == "PAYLOAD_TOO_LARGE"
    assert gateway_errors.GATEWAY_ERRORS["THROTTLED"].status == 429


def test_the_wafs_blocks_answer_in_the_error_shape(synth, stage):
    [acl] = synth.resources(stage, "App", "AWS::WAFv2::WebACL").values()
    props = acl["Properties"]
    bodies = props["CustomResponseBodies"]
    rules = {r["Name"]: r for r in props["Rules"]}
    for rule, error in gateway_errors.WAF_BLOCKS.items():
        custom = rules[rule]["Action"]["Block"]["CustomResponse"]
        assert custom["ResponseCode"] == error.status and custom["CustomResponseBodyKey"] == rule
        assert bodies[rule]["ContentType"] == "APPLICATION_JSON"
        assert json.loads(bodies[rule]["Content"]) == gateway_errors.body(error)
        want = [] if error.retry_after_seconds is None else [{"Name": "Retry-After", "Value": str(error.retry_after_seconds)}]
        assert custom.get("ResponseHeaders", []) == want, rule
    assert gateway_errors.WAF_BLOCKS["rate-per-ip"].retry_after_seconds  # the per-address block says when to come back
    assert gateway_errors.WAF_BLOCKS["body-size"].code == "PAYLOAD_TOO_LARGE"  # the handler's own 413 code
