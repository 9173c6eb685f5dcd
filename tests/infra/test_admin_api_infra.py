"""The admin API in AWS: its own REST API and stage, proxying only /admin and /dashboard paths to the
`admin_api` function; the tenant API proxies to `api` alone, whose routes hold nothing under /admin."""
from __future__ import annotations

import pytest

pytest.importorskip("aws_cdk", reason="the cdk extra is not installed: pip install -e '.[cdk]'")
pytest.importorskip("cdk_nag", reason="the cdk extra is not installed: pip install -e '.[cdk]'")

import json

from aws_cdk.assertions import Match

from infra_cdk.functions import PROFILES
from infra_cdk.stages import STAGES
from tests.infra.helpers import capabilities, lambdas


def _apis(synth, stage: str) -> dict[str, str]:
    """RestApi Name -> logical id."""
    return {r["Properties"]["Name"]: lid for lid, r in synth.resources(stage, "App", "AWS::ApiGateway::RestApi").items()}


def _integrated_functions(synth, stage: str, api_id: str) -> set[str]:
    """The function names the methods of one RestApi invoke."""
    template = synth.template_json(stage, "App")
    by_logical = {fn["logical_id"]: name for name, fn in lambdas(template).items()}
    out = set()
    for m in synth.resources(stage, "App", "AWS::ApiGateway::Method").values():
        if m["Properties"]["RestApiId"] != {"Ref": api_id}:
            continue
        integration = m["Properties"]["Integration"]
        assert integration["Type"] == "AWS_PROXY"
        text = json.dumps(integration["Uri"])
        out |= {name for lid, name in by_logical.items() if f'"{lid}"' in text}
    return out


def _paths(synth, stage: str, api_id: str) -> set[str]:
    res = {lid: r for lid, r in synth.resources(stage, "App", "AWS::ApiGateway::Resource").items()
           if r["Properties"]["RestApiId"] == {"Ref": api_id}}

    def path(lid: str) -> str:
        r = res[lid]["Properties"]
        parent = r["ParentId"]
        prefix = path(parent["Ref"]) if "Ref" in parent else ""
        return f"{prefix}/{r['PathPart']}"

    return {path(lid) for lid in res}


def test_admin_api_is_its_own_rest_api_proxying_to_the_admin_function(synth, stage):
    prefix = STAGES[stage].prefix
    apis = _apis(synth, stage)
    assert set(apis) == {f"{prefix}-api", f"{prefix}-admin-api"}
    assert _integrated_functions(synth, stage, apis[f"{prefix}-admin-api"]) == {"admin_api"}
    assert _integrated_functions(synth, stage, apis[f"{prefix}-api"]) == {"api"}
    assert _paths(synth, stage, apis[f"{prefix}-admin-api"]) == {"/admin", "/admin/{proxy+}", "/dashboard",
                                                                   "/dashboard/{proxy+}"}


def test_admin_api_stage_throttles_logs_traces_and_sits_behind_the_waf(synth, stage):
    t = synth.template(stage, "App")
    cfg = STAGES[stage]
    apis = _apis(synth, stage)
    t.has_resource_properties("AWS::ApiGateway::Stage", {
        "RestApiId": {"Ref": apis[f"{cfg.prefix}-admin-api"]},
        "StageName": cfg.name,
        "TracingEnabled": True,
        "AccessLogSetting": {"DestinationArn": Match.any_value(), "Format": Match.any_value()},
        "MethodSettings": Match.array_with([Match.object_like({
            "ThrottlingRateLimit": cfg.admin_api_rate_limit, "ThrottlingBurstLimit": cfg.admin_api_burst_limit,
            "LoggingLevel": "ERROR", "DataTraceEnabled": False})]),
    })
    associations = synth.resources(stage, "App", "AWS::WAFv2::WebACLAssociation")
    stages = {json.dumps(a["Properties"]["ResourceArn"]) for a in associations.values()}
    assert len(associations) == 2 and any("AdminApi" in s for s in stages)
    # One account-wide CloudWatch role setting, from the tenant API.
    t.resource_count_is("AWS::ApiGateway::Account", 1)


def test_admin_function_reaches_the_database_redis_and_providers_only(synth, stage):
    template = synth.template_json(stage, "App")
    fn = lambdas(template)["admin_api"]
    # The provider secret and the internet: resolving a MANUAL_REVIEW looks the job up first.
    assert capabilities(template, fn) == {"logs", "vpc-eni", "xray", "config-parameter", "db", "redis-secret",
                                          "provider-secret"}
    p = PROFILES["admin_api"]
    assert p.admin_api and not p.api and p.internet and not p.publishes_events and not p.submits_jobs
    assert fn["Properties"]["ReservedConcurrentExecutions"] == STAGES[stage].reserved_concurrency["admin_api"]


def test_the_tenant_api_has_no_admin_routes():
    from functions.api.handler import app

    rules = [r.rule.pattern for r in app._static_routes + app._dynamic_routes]
    assert rules and not [r for r in rules if "admin" in r or "dashboard" in r], rules


def test_the_admin_paths_in_aws_are_the_ones_aivedio_serve_mounts():
    from aivedio_tools.local.handlers import ADMIN_API_PREFIXES
    from infra_cdk.admin_api import ADMIN_PATH_ROOTS

    assert {f"/{root}" for root in ADMIN_PATH_ROOTS} == set(ADMIN_API_PREFIXES)
