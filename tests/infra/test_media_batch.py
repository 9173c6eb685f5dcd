"""Media jobs on AWS Batch (issue 17, infra_cdk/media.py): per media resource class its own compute
environment, job queue and job definition; the dispatch schedule that submits to them; the rule
that sends their finished jobs to media_events' queue; and IAM that reaches exactly those."""
from __future__ import annotations

import pytest

pytest.importorskip("aws_cdk", reason="the cdk extra is not installed: pip install -e '.[cdk]'")
pytest.importorskip("cdk_nag", reason="the cdk extra is not installed: pip install -e '.[cdk]'")

import json

from aivedio import events_routing
from aivedio.media import batch as media_batch
from aivedio.media.pipeline import MEDIA_CLASSES as PIPELINE_CLASSES
from infra_cdk.functions import PROFILES
from infra_cdk.media import MEDIA_CLASSES, OUTPUTS_PREFIX, MediaClass
from infra_cdk.messaging import MAX_RECEIVES
from infra_cdk.stages import STAGES
from tests.infra.helpers import capabilities, lambdas, queue_name, role_logical_id, statements_of_role

CLASSES = {mc.name: mc for mc in MEDIA_CLASSES}


def _by_name(synth, stage, type_, prop) -> dict[str, tuple[str, dict]]:
    return {r["Properties"][prop]: (lid, r) for lid, r in synth.resources(stage, "App", type_).items()}


def _list(v):
    return v if isinstance(v, list) else [v]


def _render(value, template) -> str:
    """A Fn::Join of literals and Refs/GetAtts, each token replaced by `<logical id>`."""
    if isinstance(value, str):
        return value
    sep, parts = value["Fn::Join"]
    out = []
    for p in parts:
        if isinstance(p, str):
            out.append(p)
        elif "Ref" in p:
            out.append(f"<{p['Ref']}>")
        else:
            out.append(f"<{p['Fn::GetAtt'][0]}>")
    return sep.join(out)


# --- compute environments, queues, job definitions -------------------------------------------

def test_one_environment_queue_and_job_definition_per_media_class(synth, stage):
    envs = _by_name(synth, stage, "AWS::Batch::ComputeEnvironment", "ComputeEnvironmentName")
    queues = _by_name(synth, stage, "AWS::Batch::JobQueue", "JobQueueName")
    jobs = _by_name(synth, stage, "AWS::Batch::JobDefinition", "JobDefinitionName")
    names = {f"{STAGES[stage].prefix}-{n}" for n in ("cpu-proxy", "gpu-render", "gpu-highmem")}
    assert set(envs) == set(queues) == set(jobs) == names
    assert set(CLASSES) == set(PIPELINE_CLASSES)
    for name in names:
        [order] = queues[name][1]["Properties"]["ComputeEnvironmentOrder"]
        assert order["ComputeEnvironment"]["Fn::GetAtt"][0] == envs[name][0], f"{name}: its queue feeds another environment"


def test_environments_have_distinct_instance_types_and_their_stages_max_vcpus(synth, stage):
    envs = _by_name(synth, stage, "AWS::Batch::ComputeEnvironment", "ComputeEnvironmentName")
    seen: dict[str, str] = {}
    maxes = {}
    for mc in MEDIA_CLASSES:
        _, env = envs[f"{STAGES[stage].prefix}-{mc.name}"]
        res = env["Properties"]["ComputeResources"]
        assert sorted(res["InstanceTypes"]) == sorted(mc.instance_types)
        for t in res["InstanceTypes"]:
            assert t not in seen, f"{t} serves both {seen[t]} and {mc.name}: one class could take the other's instances"
            seen[t] = mc.name
        assert res["MinvCpus"] == 0
        maxes[mc.name] = res["MaxvCpus"]
        assert res["MaxvCpus"] == STAGES[stage].batch_max_vcpus[mc.name]
        assert json.dumps(res["Subnets"]).count("egressSubnet") >= 1 and "isolated" not in json.dumps(res["Subnets"])
        images = {i["ImageType"] for i in res["Ec2Configuration"]}
        families = {t.split(".")[0] for t in mc.instance_types}
        if mc.name == "cpu-proxy":
            assert families <= {"c6i", "c7i"} and images == {"ECS_AL2023"}
        elif mc.name == "gpu-render":
            assert families <= {"g5", "g6"} and images == {"ECS_AL2_NVIDIA"}
        else:  # gpu-highmem: L40S, 48 GB of GPU memory
            assert families == {"g6e"} and images == {"ECS_AL2_NVIDIA"}
    assert set(STAGES[stage].batch_max_vcpus) == set(CLASSES)


def test_job_definitions_have_their_class_size_timeout_and_host_only_retries(synth, stage):
    jobs = _by_name(synth, stage, "AWS::Batch::JobDefinition", "JobDefinitionName")
    timeouts = set()
    for mc in MEDIA_CLASSES:
        _, job = jobs[f"{STAGES[stage].prefix}-{mc.name}"]
        props = job["Properties"]
        assert props["Timeout"] == {"AttemptDurationSeconds": mc.timeout_minutes * 60}
        timeouts.add(mc.timeout_minutes)
        assert props["RetryStrategy"] == {"Attempts": 3, "EvaluateOnExit": [
            {"Action": "RETRY", "OnStatusReason": "Host EC2*"},  # Spot reclaimed, instance terminated
            {"Action": "EXIT", "OnExitCode": "2"},  # the SPEC is invalid
            {"Action": "EXIT", "OnExitCode": "3"},  # the media is rejected
            {"Action": "EXIT", "OnReason": "*"},  # any other exit: the pipeline retries, with backoff
        ]}
        container = props["ContainerProperties"]
        req = {r["Type"]: r["Value"] for r in container["ResourceRequirements"]}
        assert req["VCPU"] == str(int(mc.vcpus)) and req["MEMORY"] == str(mc.memory_mib)
        assert req.get("GPU") == (str(mc.gpus) if mc.gpu else None)
        env = {e["Name"]: e["Value"] for e in container["Environment"]}
        assert env["AIVEDIO_RESOURCE_CLASS"] == mc.name and "BucketsMedia" in json.dumps(env["AIVEDIO_MEDIA_BUCKET"])
        assert "Command" not in container  # the image's ENTRYPOINT is the worker; the SPEC comes in AIVEDIO_JOB_SPEC
    assert len(timeouts) == len(MEDIA_CLASSES)


def test_every_job_fits_an_instance_of_its_class():
    for mc in MEDIA_CLASSES:
        mc.check_fits(max(PIPELINE_CLASSES[mc.name].units.values()))
    # A 4K transcode (6 cpu-proxy units) asks for 12 vCPUs: the 4xlarge sizes exist for it.
    assert CLASSES["cpu-proxy"].job_size(6) == (12, 6 * 3072)
    too_big = MediaClass("x", ("c6i.2xlarge",), gpus=0, vcpus=2, memory_mib=3072, timeout_minutes=1, priority=1,
                         sized_by_units=True)
    with pytest.raises(SystemExit, match="fits none"):
        too_big.check_fits(6)


def test_the_job_role_writes_and_deletes_below_outputs_only(synth, stage):
    template = synth.template_json(stage, "App")
    [(role_id, _)] = [(lid, r) for lid, r in template["Resources"].items()
                      if r["Type"] == "AWS::IAM::Role" and lid.startswith("MediaJobRole")]
    on: dict[str, set[str]] = {}  # action -> the keys (or bucket) it applies to
    for st in statements_of_role(template, role_id):
        keys = {r["Fn::Join"][1][-1] if isinstance(r, dict) and "Fn::Join" in r else json.dumps(r) for r in _list(st["Resource"])}
        for action in _list(st["Action"]):
            if action == "s3:ListBucket":
                keys = set(st["Condition"]["StringLike"]["s3:prefix"])
            on.setdefault(action, set()).update(keys)
    outputs = {f"/{OUTPUTS_PREFIX}*"}
    assert {a: k for a, k in on.items() if a.startswith("s3:")} == {
        "s3:GetObject": {"/inputs/*", f"/{OUTPUTS_PREFIX}*"},
        "s3:PutObject": outputs, "s3:PutObjectTagging": outputs, "s3:AbortMultipartUpload": outputs,
        "s3:DeleteObject": outputs,  # a worker removes what it stored of media it rejected
        "s3:ListBucket": {f"{OUTPUTS_PREFIX}*"},
    }


# --- the dispatch schedule and the submitter ---------------------------------------------------

def test_the_media_dispatch_schedule_runs_media_submit(synth, stage):
    s = events_routing.schedule(events_routing.MEDIA_DISPATCH)
    assert s.function == "media_submit" and not s.continuous and s.aws_every_minutes == 1
    template = synth.template_json(stage, "App")
    rules = {r["Properties"]["Name"]: r for r in synth.resources(stage, "App", "AWS::Events::Rule").values()}
    [target] = rules[f"{STAGES[stage].prefix}-{s.name}"]["Properties"]["Targets"]
    assert target["Arn"] == {"Fn::GetAtt": [lambdas(template)["media_submit"]["logical_id"], "Arn"]}


def test_media_submit_is_told_each_class_queue_definition_and_timeout(synth, stage):
    template = synth.template_json(stage, "App")
    fn = lambdas(template)["media_submit"]
    env = fn["Properties"]["Environment"]["Variables"]
    queues = _by_name(synth, stage, "AWS::Batch::JobQueue", "JobQueueName")
    jobs = _by_name(synth, stage, "AWS::Batch::JobDefinition", "JobDefinitionName")
    doc = json.loads(_render(env[media_batch.BATCH_ENV], template))
    assert set(doc) == set(CLASSES)
    for name, t in doc.items():
        mc, full = CLASSES[name], f"{STAGES[stage].prefix}-{name}"
        assert t["queue"] == f"<{queues[full][0]}>" and t["definition"] == f"<{jobs[full][0]}>"
        assert t["timeout_seconds"] == mc.timeout_minutes * 60
        if mc.sized_by_units:
            assert (t["vcpus_per_unit"], t["memory_mib_per_unit"]) == (mc.vcpus, mc.memory_mib)
        else:
            assert "vcpus_per_unit" not in t
    assert "BucketsMedia" in json.dumps(env["AIVEDIO_MEDIA_BUCKET"])  # the SPEC's s3:// outputs
    # Parsed as the function parses it (the ARNs stand in for the tokens).
    parsed = media_batch.targets({media_batch.BATCH_ENV: json.dumps(doc)})
    assert parsed["cpu-proxy"].vcpus_per_unit == CLASSES["cpu-proxy"].vcpus


def test_media_submit_may_submit_to_the_three_queues_and_definitions_only(synth, stage):
    template = synth.template_json(stage, "App")
    fns = lambdas(template)
    queues = _by_name(synth, stage, "AWS::Batch::JobQueue", "JobQueueName")
    jobs = _by_name(synth, stage, "AWS::Batch::JobDefinition", "JobDefinitionName")
    stmts = [st for st in statements_of_role(template, role_logical_id(fns["media_submit"]))
             if any(a.startswith("batch:") for a in _list(st["Action"]))]
    assert [set(_list(st["Action"])) for st in stmts] == [{"batch:SubmitJob"}]
    want = [{"Fn::GetAtt": [lid, "JobQueueArn"]} for lid, _ in queues.values()] + [{"Ref": lid} for lid, _ in jobs.values()]
    assert sorted(map(json.dumps, stmts[0]["Resource"])) == sorted(map(json.dumps, want))
    caps = capabilities(template, fns["media_submit"])
    assert {c for c in caps if c.startswith(("s3-", "consume:", "send:", "batch-describe"))} == set()
    # Only media_submit submits; only the maintenance function (the media-jobs reconciler) describes.
    for name, fn in fns.items():
        actions = {a for st in statements_of_role(template, role_logical_id(fn)) for a in _list(st["Action"])}
        assert ("batch:SubmitJob" in actions) == (name == "media_submit"), name
        assert ("batch:DescribeJobs" in actions) == PROFILES[name].describes_media_jobs, name
        assert not {a for a in actions if a.startswith("batch:")} - {"batch:SubmitJob", "batch:DescribeJobs"}, name
    assert {n for n, p in PROFILES.items() if p.describes_media_jobs} == {"maintenance"}


def test_the_media_functions_reach_batch_through_a_vpc_endpoint(synth, stage):
    for name in ("media_submit", "media_events"):
        assert not PROFILES[name].internet, f"{name} needs no NAT: Batch and S3 have VPC endpoints"
    endpoints = synth.resources(stage, "Data", "AWS::EC2::VPCEndpoint")
    assert any(json.dumps(r["Properties"]["ServiceName"]).rstrip('"]}').endswith(".batch") for r in endpoints.values())


# --- completion: the Batch events rule, media_events' queue ----------------------------------

def test_the_rule_sends_these_queues_finished_jobs_to_media_events(synth, stage):
    template = synth.template_json(stage, "App")
    rules = {r["Properties"]["Name"]: (lid, r) for lid, r in synth.resources(stage, "App", "AWS::Events::Rule").items()}
    rule_id, rule = rules[f"{STAGES[stage].prefix}-media-job-state"]
    queues = _by_name(synth, stage, "AWS::Batch::JobQueue", "JobQueueName")
    pattern = rule["Properties"]["EventPattern"]
    assert pattern["source"] == ["aws.batch"] and pattern["detail-type"] == ["Batch Job State Change"]
    assert pattern["detail"]["status"] == ["SUCCEEDED", "FAILED"]
    assert sorted(map(json.dumps, pattern["detail"]["jobQueue"])) == \
        sorted(json.dumps({"Fn::GetAtt": [lid, "JobQueueArn"]}) for lid, _ in queues.values())
    sqs_queues = _by_name(synth, stage, "AWS::SQS::Queue", "QueueName")
    events_queue_id, events_queue = sqs_queues[queue_name(stage, "media_events")]
    [target] = rule["Properties"]["Targets"]
    assert target["Arn"] == {"Fn::GetAtt": [events_queue_id, "Arn"]}
    # EventBridge may send there, from this rule only.
    policies = [p for p in synth.resources(stage, "App", "AWS::SQS::QueuePolicy").values()
                if {"Ref": events_queue_id} in p["Properties"]["Queues"]]
    grants = [st for p in policies for st in p["Properties"]["PolicyDocument"]["Statement"]
              if st.get("Principal") == {"Service": "events.amazonaws.com"}]
    assert grants and all(st["Condition"]["ArnEquals"]["aws:SourceArn"] == {"Fn::GetAtt": [rule_id, "Arn"]} for st in grants)
    # A DLQ after MAX_RECEIVES, partial batch failures, and the DLQ alarm with its redrive path.
    redrive = events_queue["Properties"]["RedrivePolicy"]
    assert redrive["maxReceiveCount"] == MAX_RECEIVES
    assert redrive["deadLetterTargetArn"] == {"Fn::GetAtt": [sqs_queues[f"{queue_name(stage, 'media_events')}-dlq"][0], "Arn"]}
    fn_id = lambdas(template)["media_events"]["logical_id"]
    [mapping] = [m for m in synth.resources(stage, "App", "AWS::Lambda::EventSourceMapping").values()
                 if m["Properties"]["FunctionName"] == {"Ref": fn_id}]
    assert mapping["Properties"]["EventSourceArn"] == {"Fn::GetAtt": [events_queue_id, "Arn"]}
    assert mapping["Properties"]["FunctionResponseTypes"] == ["ReportBatchItemFailures"]
    alarms = {r["Properties"]["AlarmName"]: r["Properties"] for r in synth.resources(stage, "App", "AWS::CloudWatch::Alarm").values()}
    alarm = alarms[f"{STAGES[stage].prefix}-dlq-media-events"]
    assert f"aivedio admin queue redrive --queue {queue_name(stage, 'media_events')}" in alarm["AlarmDescription"]


def test_the_relay_never_sends_to_the_batch_events_queue(synth, stage):
    template = synth.template_json(stage, "App")
    relay = capabilities(template, lambdas(template)["outbox_relay"])
    assert f"send:{queue_name(stage, 'media_events')}" not in relay
    raw = json.dumps(lambdas(template)["outbox_relay"]["Properties"]["Environment"]["Variables"]["AIVEDIO_EVENT_QUEUES"])
    events_queue_id = _by_name(synth, stage, "AWS::SQS::Queue", "QueueName")[queue_name(stage, "media_events")][0]
    assert events_queue_id not in raw


def test_media_events_reads_and_lists_outputs_only_and_submits_nothing(synth, stage):
    template = synth.template_json(stage, "App")
    caps = capabilities(template, lambdas(template)["media_events"])
    assert caps == {"logs", "vpc-eni", "xray", "config-parameter", "db", f"consume:{queue_name(stage, 'media_events')}",
                    f"s3-read:{OUTPUTS_PREFIX}", f"s3-list:{OUTPUTS_PREFIX}"}
    # The API presigns outputs' GET URLs with its role; the reconciler reads result.json like media_events.
    assert OUTPUTS_PREFIX in PROFILES["api"].media_read_prefixes
    assert f"s3-read:{OUTPUTS_PREFIX}" in capabilities(template, lambdas(template)["maintenance"])
