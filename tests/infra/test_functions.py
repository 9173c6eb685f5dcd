"""Every handler under functions/ is deployed, from the right code, and imports."""
from __future__ import annotations

import pytest

pytest.importorskip("aws_cdk", reason="the cdk extra is not installed: pip install -e '.[cdk]'")
pytest.importorskip("cdk_nag", reason="the cdk extra is not installed: pip install -e '.[cdk]'")

import importlib
import json
from pathlib import Path

from aivedio import events_routing
from infra_cdk.functions import PROFILES, discover, handler_path
from infra_cdk.stages import STAGES
from layers import build as layer_build
from tests.infra.helpers import function_name, lambdas

ROOT = Path(__file__).resolve().parents[2]


def test_every_handler_in_the_tree_has_a_profile():
    names = discover()
    assert {"api", "outbox_relay", "scheduler_tick", "scheduler_maintenance", "queue_indexer", "db_migrate"} <= set(names)
    missing = [n for n in names if n not in PROFILES]
    assert not missing, f"add these to infra_cdk/functions.py PROFILES: {missing}"
    assert not set(PROFILES) - set(names), "a profile without a handler under functions/"


def test_every_function_is_deployed_with_its_handler(synth, stage):
    fns = lambdas(synth.template_json(stage, "App"))
    assert sorted(fns) == discover()
    for name, fn in fns.items():
        props = fn["Properties"]
        assert props["Handler"] == handler_path(name)
        assert props["FunctionName"] == function_name(stage, name)
        assert props["Runtime"] == f"python{layer_build.PYTHON_VERSION}"
        assert props["Architectures"] == [layer_build.ARCHITECTURE]
        assert props["TracingConfig"] == {"Mode": "Active"}
        assert props["Environment"]["Variables"]["POWERTOOLS_METRICS_NAMESPACE"] == "AiVedio"


def _code_asset(synth, fn: dict) -> Path:
    """The staged directory of a function's code, found through the stack's asset manifest."""
    key = fn["Properties"]["Code"]["S3Key"]
    files = json.loads((synth.outdir / "AiVedio-dev-App.assets.json").read_text())["files"]
    return synth.outdir / files[key.removesuffix(".zip")]["source"]["path"]


def test_every_handler_path_exists_in_the_code_asset_and_imports(synth):
    fns = lambdas(synth.template_json("dev", "App"))
    asset_dirs = {_code_asset(synth, fn) for fn in fns.values()}
    assert len(asset_dirs) == 1, "all functions share the one functions/ asset"
    asset = asset_dirs.pop()
    for name, fn in fns.items():
        module, attr = fn["Properties"]["Handler"].rsplit(".", 1)
        assert (asset / (module.replace(".", "/") + ".py")).is_file(), f"{module} is not in the code asset"
        handler = getattr(importlib.import_module(module), attr)
        assert callable(handler), f"{module}.{attr} is not callable"


def test_the_code_asset_holds_the_functions_tree_only(synth):
    fn = next(iter(lambdas(synth.template_json("dev", "App")).values()))
    asset = _code_asset(synth, fn)
    assert sorted(p.name for p in asset.iterdir()) == ["functions"]
    assert not list(asset.rglob("__pycache__"))


def test_every_function_has_the_core_layer_and_only_the_media_functions_pyav(synth, stage):
    template = synth.template_json(stage, "App")
    layers = {lid: r for lid, r in template["Resources"].items() if r["Type"] == "AWS::Lambda::LayerVersion"}
    assert len(layers) == 2
    [core] = [lid for lid in layers if lid.startswith("FunctionsSharedLayer")]
    [media] = [lid for lid in layers if lid.startswith("FunctionsMediaLayer")]
    for layer in layers.values():
        assert layer["Properties"]["CompatibleRuntimes"] == [f"python{layer_build.PYTHON_VERSION}"]
    with_media = []
    for name, fn in lambdas(template).items():
        want = [{"Ref": core}] + ([{"Ref": media}] if PROFILES[name].parses_media else [])
        assert sorted(fn["Properties"]["Layers"], key=str) == sorted(want, key=str), name  # no file is in both
        if PROFILES[name].parses_media:
            with_media.append(name)
    assert with_media == ["api"]  # admission probes inputs (aivedio.media.probe); nothing else opens media


def test_only_internet_facing_functions_sit_in_subnets_with_a_nat_route(synth, stage):
    """Every other function reaches AWS through VPC endpoints, from isolated subnets."""
    for name, fn in lambdas(synth.template_json(stage, "App")).items():
        subnets = json.dumps(fn["Properties"]["VpcConfig"]["SubnetIds"])
        kind = "egress" if PROFILES[name].internet else "isolated"
        assert f"Vpc{kind}Subnet" in subnets and ("egress" if kind == "isolated" else "isolated") + "Subnet" not in subnets, \
            f"{name}: expected {kind} subnets, got {subnets}"


def test_vpc_endpoints_cover_what_functions_call(synth, stage):
    endpoints = synth.resources(stage, "Data", "AWS::EC2::VPCEndpoint")
    services = {json.dumps(r["Properties"]["ServiceName"]).split(".")[-1].strip('"]}') for r in endpoints.values()}
    for service in ("s3", "sqs", "states", "secretsmanager", "ssm", "logs", "monitoring", "xray"):
        assert any(s.endswith(service) for s in services), f"no VPC endpoint for {service}: {services}"


def test_bounded_functions_have_reserved_concurrency(synth, stage):
    fns = lambdas(synth.template_json(stage, "App"))
    bounded = STAGES[stage].reserved_concurrency
    assert "scheduler_tick" in bounded
    for name, fn in fns.items():
        assert fn["Properties"].get("ReservedConcurrentExecutions") == bounded.get(name), name


def test_scheduled_functions_do_not_retry_stale_ticks(synth, stage):
    template = synth.template_json(stage, "App")
    fns = lambdas(template)
    configs = {r["Properties"]["FunctionName"]["Ref"]: r["Properties"]
               for r in template["Resources"].values() if r["Type"] == "AWS::Lambda::EventInvokeConfig"}
    for s in events_routing.SCHEDULES:
        cfg = configs[fns[s.function]["logical_id"]]
        assert cfg["MaximumRetryAttempts"] == 0 and cfg["MaximumEventAgeInSeconds"] == 60


def test_functions_depend_on_the_schema_migration(synth, stage):
    template = synth.template_json(stage, "App")
    migration = [lid for lid, r in template["Resources"].items() if r["Type"] == "Custom::AiVedioSchemaMigration"]
    assert len(migration) == 1
    from aivedio.db.migrate import schema_fingerprint

    assert template["Resources"][migration[0]]["Properties"]["SchemaFingerprint"] == schema_fingerprint()
    for name, fn in lambdas(template).items():
        if PROFILES[name].migrates:
            continue
        assert migration[0] in fn.get("DependsOn", []), f"{name} may start before the schema is migrated"


def test_database_and_redis_settings_carry_no_password(synth, stage):
    for name, fn in lambdas(synth.template_json(stage, "App")).items():
        env = fn["Properties"]["Environment"]["Variables"]
        p = PROFILES[name]
        if p.database:
            url = json.dumps(env["AIVEDIO_DATABASE_URL"])
            assert "postgresql://aivedio_admin@" in url and "sslmode=require" in url
            assert env["AIVEDIO_DATABASE_IAM_AUTH"] == "1"
        else:
            assert "AIVEDIO_DATABASE_URL" not in env
        if p.redis:
            assert json.dumps(env["AIVEDIO_REDIS_URL"]).startswith('{"Fn::Join": ["", ["rediss://')
            assert "AIVEDIO_REDIS_SECRET_ARN" in env
        else:
            assert env["AIVEDIO_REDIS_URL"] == "none"
        assert "secretsmanager" not in json.dumps(env).replace("AIVEDIO_REDIS_SECRET_ARN", "")


def test_every_function_reads_the_platform_config_from_the_stacks_parameter(synth, stage):
    template = synth.template_json(stage, "App")
    params = {lid: r for lid, r in template["Resources"].items() if r["Type"] == "AWS::SSM::Parameter"}
    assert len(params) == 1
    (param_id, param), = params.items()
    assert param["Properties"]["Name"] == f"/{STAGES[stage].prefix}/platform-config"
    from infra_cdk.platform_config import config_file

    assert param["Properties"]["Value"] == config_file(STAGES[stage]).read_text()  # the stage's file, as validated
    for name, fn in lambdas(template).items():
        env = fn["Properties"]["Environment"]["Variables"]
        assert env["AIVEDIO_CONFIG_PARAMETER"] == {"Ref": param_id}, name
        assert "AIVEDIO_CONFIG" not in env, name


def test_only_the_functions_that_talk_to_providers_get_the_provider_secret(synth, stage):
    data = synth.template_json(stage, "Data")
    secrets = {lid: r for lid, r in data["Resources"].items() if r["Type"] == "AWS::SecretsManager::Secret"
               and r["Properties"]["Name"] == f"{STAGES[stage].prefix}/provider-credentials"}
    assert len(secrets) == 1
    (secret_id, secret), = secrets.items()
    generated = secret["Properties"]["GenerateSecretString"]
    assert json.loads(generated["SecretStringTemplate"]) == {"providers": {}}  # no credential is made up
    assert "SecretString" not in secret["Properties"]
    for name, fn in lambdas(synth.template_json(stage, "App")).items():
        env = fn["Properties"]["Environment"]["Variables"]
        if PROFILES[name].provider_credentials:
            assert secret_id in json.dumps(env["AIVEDIO_PROVIDER_SECRET_ARN"]), name
        else:
            assert "AIVEDIO_PROVIDER_SECRET_ARN" not in env, name
    # admin_api: resolving a MANUAL_REVIEW looks the attempt's job up at its provider.
    assert {n for n, p in PROFILES.items() if p.provider_credentials} == {"api", "attempt_step", "maintenance", "admin_api"}


def test_jobs_are_submitted_with_the_apis_own_callback_url(synth, stage):
    template = synth.template_json(stage, "App")
    apis = [lid for lid, r in template["Resources"].items() if r["Type"] == "AWS::ApiGateway::RestApi"]
    for name, fn in lambdas(template).items():
        env = fn["Properties"]["Environment"]["Variables"]
        if PROFILES[name].submits_jobs:
            url = json.dumps(env["AIVEDIO_API_BASE_URL"])
            assert apis[0] in url and ".execute-api." in url and f"ApiRestApiDeploymentStage{stage}" in url, url
        else:
            assert "AIVEDIO_API_BASE_URL" not in env, name
    assert PROFILES["attempt_step"].submits_jobs


def test_a_flood_of_requests_cannot_take_the_concurrency_of_admitted_work(synth, stage):
    from infra_cdk.stages import UNRESERVED_MINIMUM

    cfg = STAGES[stage]
    fns = lambdas(synth.template_json(stage, "App"))
    reserved = {n: fn["Properties"].get("ReservedConcurrentExecutions") for n, fn in fns.items()}
    assert reserved["api"] and reserved["attempt_step"] and reserved["settlement"]
    total = sum(v for v in reserved.values() if v)
    # The api is capped; the attempt steps and settlement have their own; the unreserved functions
    # (reconcilers, consumers) share what is left, never less than Lambda's unreserved minimum.
    assert total + UNRESERVED_MINIMUM <= cfg.account_concurrency
    assert reserved["api"] < cfg.account_concurrency - total + reserved["api"] - UNRESERVED_MINIMUM + 1
    with pytest.raises(ValueError, match="unreserved"):
        import dataclasses

        dataclasses.replace(cfg, reserved_concurrency={**cfg.reserved_concurrency, "api": cfg.account_concurrency})


@pytest.mark.parametrize("text, why", [
    ('[[providers]]\nname = "p"\nbase_url = "https://p.example"\nwebhook_secret = "whsec_eA=="\n', "secrets go in"),
    ('[[providers]]\nname = "p"\nbase_url = "https://p.example"\n[[providers.accounts]]\naccount_id = "a"\napi_key = "k"\n',
     "accounts.0.api_key: secrets go in"),
    ('[[providers]]\nname = "p"\n', "needs a base_url"),
    ('time_scale = 1.0\n', "no \\[\\[providers\\]\\] entry"),
])
def test_a_stage_config_with_a_secret_or_a_simulator_fails_synthesis(tmp_path, text, why):
    from infra_cdk.platform_config import validated_config_text

    f = tmp_path / "stage.toml"
    f.write_text(text)
    with pytest.raises(SystemExit, match=why):
        validated_config_text(f)


def test_no_function_or_batch_job_can_break_a_safeguard_or_arm_a_failpoint(synth):
    """The chaos suite's switches (aivedio.faults.safeguards, aivedio.faults.failpoints) are never set
    by the deployed platform, in any template of any stage: not on a Lambda, not on a Batch job."""
    from aivedio.faults import failpoints, safeguards

    names = (safeguards.BREAK_ENV, safeguards.ALLOW_ENV, failpoints.ENV)
    templates = sorted(synth.outdir.glob("*.template.json"))
    assert len(templates) >= 4
    for path in templates:
        text = path.read_text()
        for name in names:
            assert name not in text, f"{path.name} sets {name}"
        assert safeguards.ALLOW_VALUE not in text, path.name
