"""State, the API edge, Batch and observability (the workflow: test_workflows.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("aws_cdk", reason="the cdk extra is not installed: pip install -e '.[cdk]'")
pytest.importorskip("cdk_nag", reason="the cdk extra is not installed: pip install -e '.[cdk]'")

import json
import re
from pathlib import Path

from aws_cdk.assertions import Match

from aivedio import metrics_catalog as mc
from aivedio.config import LANES, Limits
from aivedio.media.retention import RETENTION_CLASSES
from infra_cdk.media import RESOURCE_CLASSES
from infra_cdk.stages import STAGES

ROOT = Path(__file__).resolve().parents[2]


# --- data -------------------------------------------------------------------------------------

def test_aurora_is_serverless_v2_encrypted_with_iam_auth(synth, stage):
    t = synth.template(stage, "Data")
    cfg = STAGES[stage]
    t.has_resource_properties("AWS::RDS::DBCluster", {
        "Engine": "aurora-postgresql", "StorageEncrypted": True, "EnableIAMDatabaseAuthentication": True,
        "ServerlessV2ScalingConfiguration": {"MinCapacity": cfg.aurora_min_acu, "MaxCapacity": cfg.aurora_max_acu},
        "DeletionProtection": cfg.deletion_protection, "BackupRetentionPeriod": cfg.backup_days,
    })
    t.resource_count_is("AWS::RDS::DBInstance", 1 + cfg.aurora_readers)
    t.all_resources_properties("AWS::RDS::DBInstance", {"DBInstanceClass": "db.serverless"})
    t.has_resource_properties("AWS::RDS::DBProxy", {"RequireTLS": True, "Auth": [Match.object_like({"IAMAuth": "REQUIRED"})]})
    t.has_resource_properties("AWS::SecretsManager::RotationSchedule", Match.any_value())


def test_redis_has_tls_and_rbac_per_stage(synth, stage):
    t = synth.template(stage, "Data")
    t.resource_count_is("AWS::ElastiCache::User", 2)
    t.has_resource_properties("AWS::ElastiCache::User", {"UserName": "default", "AccessString": "off -@all"})
    if STAGES[stage].redis_mode == "serverless":
        t.has_resource_properties("AWS::ElastiCache::ServerlessCache", {"Engine": "redis", "UserGroupId": Match.any_value()})
        t.resource_count_is("AWS::ElastiCache::ReplicationGroup", 0)
    else:
        t.has_resource_properties("AWS::ElastiCache::ReplicationGroup", {
            "TransitEncryptionEnabled": True, "AtRestEncryptionEnabled": True, "MultiAZEnabled": True,
            "AutomaticFailoverEnabled": True, "UserGroupIds": Match.any_value()})
        t.resource_count_is("AWS::ElastiCache::ServerlessCache", 0)


def test_media_bucket_has_a_lifecycle_rule_per_retention_class(synth, stage):
    buckets = synth.resources(stage, "Data", "AWS::S3::Bucket")
    media = next(b for lid, b in buckets.items() if lid.startswith("BucketsMedia"))
    rules = {r["Id"]: r for r in media["Properties"]["LifecycleConfiguration"]["Rules"]}
    for rc in RETENTION_CLASSES:
        rule = rules[f"retention-{rc.name}"]
        assert rule["TagFilters"] == [{"Key": "retention_class", "Value": rc.name}]
        assert rule.get("ExpirationInDays") == rc.expire_after_days
    assert media["DeletionPolicy"] == ("Retain" if STAGES[stage].retain else "Delete")
    # Cost allocation reads the bucket's tags, never an object's: the CUR's storage lines of this
    # bucket carry this one, and the monthly storage check reads them (aivedio.media.storage_cost).
    assert {"Key": "aivedio:cost-scope", "Value": "media-storage"} in media["Properties"]["Tags"]
    others = [b for lid, b in buckets.items() if not lid.startswith("BucketsMedia")]
    assert others and not [b for b in others if any(t["Key"] == "aivedio:cost-scope" for t in b["Properties"].get("Tags", []))]


def test_invoice_archive_is_versioned_and_object_locked(synth, stage):
    buckets = synth.resources(stage, "Data", "AWS::S3::Bucket")
    archive = next(b for lid, b in buckets.items() if lid.startswith("BucketsInvoiceArchive"))
    props = archive["Properties"]
    assert props["VersioningConfiguration"] == {"Status": "Enabled"}
    assert props["ObjectLockEnabled"] is True
    retention = props["ObjectLockConfiguration"]["Rule"]["DefaultRetention"]
    assert retention == {"Mode": STAGES[stage].invoice_lock_mode, "Days": STAGES[stage].invoice_lock_days}
    assert archive["DeletionPolicy"] == "Retain"


# --- api --------------------------------------------------------------------------------------

def test_api_stage_throttles_logs_and_traces(synth, stage):
    t = synth.template(stage, "App")
    cfg = STAGES[stage]
    t.has_resource_properties("AWS::ApiGateway::Stage", {
        "TracingEnabled": True,
        "AccessLogSetting": {"DestinationArn": Match.any_value(), "Format": Match.any_value()},
        "MethodSettings": Match.array_with([Match.object_like({
            "ThrottlingRateLimit": cfg.api_rate_limit, "ThrottlingBurstLimit": cfg.api_burst_limit,
            "LoggingLevel": "ERROR"})]),
    })
    t.has_resource_properties("AWS::ApiGateway::UsagePlan", {
        "Throttle": {"RateLimit": cfg.api_rate_limit, "BurstLimit": cfg.api_burst_limit},
        "Quota": {"Limit": cfg.api_quota_per_day, "Period": "DAY"}})
    t.has_resource_properties("AWS::ApiGateway::RequestValidator", {"ValidateRequestParameters": True})
    methods = {k: m for k, m in synth.resources(stage, "App", "AWS::ApiGateway::Method").items()
               if m["Properties"]["RestApiId"]["Ref"].startswith("ApiRestApi")}  # the tenant API's (admin: its own test)
    assert len(methods) == 2 and all(m["Properties"]["Integration"]["Type"] == "AWS_PROXY" for m in methods.values())


def test_waf_limits_the_request_body_to_the_platform_limit(synth, stage):
    t = synth.template(stage, "App")
    acl = next(iter(synth.resources(stage, "App", "AWS::WAFv2::WebACL").values()))
    [size_rule] = [r for r in acl["Properties"]["Rules"] if r["Name"] == "body-size"]
    stmt = size_rule["Statement"]["SizeConstraintStatement"]
    assert stmt["Size"] == Limits().max_body_bytes and stmt["ComparisonOperator"] == "GT"
    assert stmt["FieldToMatch"]["Body"]["OversizeHandling"] == "MATCH"
    # Blocked with a 413 in the API's error shape (its body under the rule's name: test_alarms_and_gateway_errors).
    assert size_rule["Action"] == {"Block": {"CustomResponse": {"ResponseCode": 413, "CustomResponseBodyKey": "body-size"}}}
    t.resource_count_is("AWS::WAFv2::WebACLAssociation", 2)  # the tenant API's stage and the admin API's


# --- media ------------------------------------------------------------------------------------

def test_resource_classes_match_the_media_pipelines_classes():
    """Batch runs media jobs, one environment per media resource class of the pipeline (the
    admission classes video-standard/4k/v2v size provider work, not media work)."""
    from aivedio.media.pipeline import MEDIA_CLASSES

    assert {rc.name for rc in RESOURCE_CLASSES} == set(MEDIA_CLASSES) == {"cpu-proxy", "gpu-render", "gpu-highmem"}


def test_batch_environments_have_the_resource_classes_instance_types(synth, stage):
    envs = {r["Properties"]["ComputeEnvironmentName"]: r for r in synth.resources(stage, "App", "AWS::Batch::ComputeEnvironment").values()}
    env_ids = {lid: r["Properties"]["ComputeEnvironmentName"]
               for lid, r in synth.resources(stage, "App", "AWS::Batch::ComputeEnvironment").items()}
    jobs = {r["Properties"]["JobDefinitionName"]: r for r in synth.resources(stage, "App", "AWS::Batch::JobDefinition").values()}
    queues = {r["Properties"]["JobQueueName"]: r for r in synth.resources(stage, "App", "AWS::Batch::JobQueue").values()}
    assert len(envs) == len(jobs) == len(queues) == len(RESOURCE_CLASSES)
    for rc in RESOURCE_CLASSES:
        name = f"aivedio-{stage}-{rc.name}"
        res = envs[name]["Properties"]["ComputeResources"]
        assert sorted(res["InstanceTypes"]) == sorted(rc.instance_types)
        assert res["MinvCpus"] == 0 and res["MaxvCpus"] == STAGES[stage].batch_max_vcpus[rc.name]
        images = {i["ImageType"] for i in res["Ec2Configuration"]}
        requirements = {r["Type"]: r["Value"] for r in jobs[name]["Properties"]["ContainerProperties"]["ResourceRequirements"]}
        if rc.name in ("gpu-render", "gpu-highmem"):
            assert rc.gpu and all(t.startswith(("g4", "g5", "g6", "p")) for t in rc.instance_types)
            assert images == {"ECS_AL2_NVIDIA"}
            assert requirements["GPU"] == str(rc.gpus)
        else:
            assert not rc.gpu and not any(t.startswith(("g", "p")) for t in rc.instance_types)
            assert "GPU" not in requirements
        [order] = queues[name]["Properties"]["ComputeEnvironmentOrder"]
        assert env_ids[order["ComputeEnvironment"]["Fn::GetAtt"][0]] == name


def test_job_definitions_run_the_gpu_render_image_built_from_its_dockerfile(synth, stage):
    """The asset is staged at synth (no Docker): the Dockerfile of containers/gpu-render, with the
    repository root as context, narrowed to what the image installs."""
    images = json.loads((synth.outdir / f"AiVedio-{stage}-App.assets.json").read_text())["dockerImages"]
    [(asset_hash, asset)] = images.items()
    assert asset["source"]["dockerFile"] == "containers/gpu-render/Dockerfile"
    assert asset["source"]["platform"] == "linux/amd64"
    staged = synth.outdir / asset["source"]["directory"]
    assert sorted(p.name for p in staged.iterdir()) == ["containers", "pyproject.toml", "shared"]
    assert sorted(p.name for p in (staged / "containers" / "gpu-render").iterdir()) == \
        ["Dockerfile", "Dockerfile.dockerignore", "README.md", "worker.py"]
    assert (staged / "shared" / "aivedio" / "__init__.py").is_file()
    assert not list(staged.rglob("__pycache__")) and not list(staged.rglob("*.egg-info"))
    for job in synth.resources(stage, "App", "AWS::Batch::JobDefinition").values():
        assert asset_hash in json.dumps(job["Properties"]["ContainerProperties"]["Image"])
    assert not synth.resources(stage, "App", "AWS::ECR::Repository")  # the asset replaces the CI-pushed image


# --- observability ----------------------------------------------------------------------------

def test_dashboard_shows_the_required_figures(synth, stage):
    dash = next(iter(synth.resources(stage, "App", "AWS::CloudWatch::Dashboard").values()))
    body = json.dumps(dash["Properties"]["DashboardBody"])
    for spec in (mc.QUEUE_DEPTH_UNITS, mc.OLDEST_WAIT_SECONDS, mc.PROVIDER_UTILISATION, mc.ADMISSION_REJECTIONS,
                 mc.SUBMIT_UNKNOWN, mc.UNRECONCILED_COST):
        assert spec.name in body, spec.name
    for lane in LANES:
        assert lane in body


def test_every_catalog_metric_has_a_graph(synth, stage):
    """Nothing the platform emits is missing from the dashboard: each spec's name is graphed."""
    dash = next(iter(synth.resources(stage, "App", "AWS::CloudWatch::Dashboard").values()))
    body = json.dumps(dash["Properties"]["DashboardBody"])
    missing = [spec.name for spec in mc.ALL if not re.search(rf"(?<![A-Za-z]){spec.name}(?![A-Za-z])", body)]
    assert not missing, missing


def test_alarms_cover_starvation_backlog_dlqs_and_reconciliation(synth, stage):
    alarms = {r["Properties"]["AlarmName"]: r["Properties"] for r in synth.resources(stage, "App", "AWS::CloudWatch::Alarm").values()}
    prefix = f"aivedio-{stage}-"
    for lane in LANES:
        a = alarms[f"{prefix}starvation-{lane.lower().replace('_', '-')}"]
        assert a["MetricName"] == mc.OLDEST_WAIT_SECONDS.name
    assert alarms[f"{prefix}outbox-backlog"]["MetricName"] == mc.OUTBOX_BACKLOG.name
    assert alarms[f"{prefix}reconciliation-breaks"]["MetricName"] == mc.RECONCILIATION_BREAKS.name
    dlq_alarms = [a for n, a in alarms.items() if n.startswith(f"{prefix}dlq-")]
    assert dlq_alarms and all(a["MetricName"] == "ApproximateNumberOfMessagesVisible" for a in dlq_alarms)
    assert all(a["AlarmActions"] for a in alarms.values())
