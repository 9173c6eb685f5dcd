"""The media pipeline's AWS side (functions/media_submit, functions/media_events, aivedio.media.batch)
against moto's Batch, S3 and SQS, on the real PostgreSQL: tasks admitted and claimed by the real
admission and scheduler, the provider's success applied by the real lifecycle.

moto's Batch (`use_docker: False`) accepts SubmitJob and answers DescribeJobs (every job SUCCEEDED
at once, with the container environment the submitter set) but runs nothing, so the worker's part
is played here: its result.json (and its output objects) put in moto's S3 under the job's outputs,
and a "Batch Job State Change" event made from the job's DescribeJobs entry (the event's detail has
the same shape), sent through a moto SQS queue to media_events as the Lambda event source would
deliver it. What is asserted is what the handlers did: the SubmitJob calls (queue, definition, name,
SPEC, size, timeout), mark_started, and pipeline.complete's effect on the database."""
from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone

import pytest

moto = pytest.importorskip("moto", reason="moto is in the dev extra: pip install -e '.[dev]'")

import boto3  # noqa: E402
from moto import mock_aws  # noqa: E402

from aivedio.attempts import lifecycle  # noqa: E402
from aivedio.bootstrap import apply_config  # noqa: E402
from aivedio.config import ManualClock, MediaConfig, PlatformConfig, ProviderAccount, ProviderConfig  # noqa: E402
from aivedio.context import set_platform  # noqa: E402
from aivedio_tools.local.lambda_context import FakeLambdaContext  # noqa: E402
from aivedio.media import batch, pipeline  # noqa: E402
from aivedio_tools.local import media_dispatch  # noqa: E402
from aivedio.providers.adapter import parse_job  # noqa: E402
from aivedio.reconcile import room  # noqa: E402
from aivedio.scheduling.scheduler import Scheduler  # noqa: E402
from functions.media_events import handler as media_events  # noqa: E402
from functions.media_submit import handler as media_submit  # noqa: E402
from tests.admission_support import new_tenant  # noqa: E402
from tests.conftest import create_test_database, drop_test_database  # noqa: E402
from tests.scheduler_support import BODY_1U, OPEN, UNCAPPED, submit  # noqa: E402

pytestmark = pytest.mark.xdist_group("media")

REGION = "us-east-1"
BUCKET = "aivedio-test-media"
PREFIX = "aivedio-test"
CLASSES = {  # as infra_cdk/media.py sizes them (the test does not need the CDK extra)
    "cpu-proxy": {"timeout_seconds": 3600, "vcpus_per_unit": 2, "memory_mib_per_unit": 3072},
    "gpu-render": {"timeout_seconds": 7200},
    "gpu-highmem": {"timeout_seconds": 10800},
}
BODY_4K = {**BODY_1U, "resolution": "4k"}


# --- moto's AWS ---------------------------------------------------------------------------------

def _batch_world() -> dict[str, dict]:
    """Three compute environments, job queues and job definitions, as the CDK app makes them."""
    ec2, iam, b = (boto3.client(s, region_name=REGION) for s in ("ec2", "iam", "batch"))
    vpc = ec2.create_vpc(CidrBlock="10.40.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.40.0.0/20")["Subnet"]["SubnetId"]
    sg = ec2.create_security_group(GroupName="workers", Description="media workers", VpcId=vpc)["GroupId"]
    service_role = iam.create_role(RoleName="batch", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    profile = iam.create_instance_profile(InstanceProfileName="workers")["InstanceProfile"]["Arn"]
    targets = {}
    for name, sizes in CLASSES.items():
        ce = b.create_compute_environment(
            computeEnvironmentName=f"{PREFIX}-{name}", type="MANAGED", state="ENABLED", serviceRole=service_role,
            computeResources={"type": "EC2", "minvCpus": 0, "maxvCpus": 16, "instanceTypes": ["c6i.4xlarge"],
                              "subnets": [subnet], "securityGroupIds": [sg], "instanceRole": profile})
        queue = b.create_job_queue(jobQueueName=f"{PREFIX}-{name}", state="ENABLED", priority=10,
                                   computeEnvironmentOrder=[{"order": 1, "computeEnvironment": ce["computeEnvironmentArn"]}])
        definition = b.register_job_definition(
            jobDefinitionName=f"{PREFIX}-{name}", type="container",
            containerProperties={"image": "gpu-render", "vcpus": 2, "memory": 3072},
            timeout={"attemptDurationSeconds": sizes["timeout_seconds"]}, retryStrategy={"attempts": 3})
        targets[name] = {"queue": queue["jobQueueArn"], "definition": definition["jobDefinitionArn"], **sizes}
    return targets


class World:
    def __init__(self, p, targets: dict, sqs_url: str):
        self.p, self.targets, self.sqs_url = p, targets, sqs_url
        self.batch, self.s3, self.sqs = p.extras["batch_client"], p.extras["s3_client"], boto3.client("sqs", region_name=REGION)
        self.submitted: list[dict] = []  # every SubmitJob's parameters, as sent
        self.batch.meta.events.register("provide-client-params.batch.SubmitJob",
                                        lambda params, **_: self.submitted.append(json.loads(json.dumps(params))))

    # the tasks ...
    def provider_succeeded(self, n: int = 1, body: dict = BODY_1U) -> list[lifecycle.AttemptRef]:
        """n tasks admitted, claimed, run by the provider and succeeded: a PENDING media job each."""
        p = self.p
        t = new_tenant(p, credits=1_000_000, **{**OPEN, **UNCAPPED})
        task_ids = submit(p, t.tenant_id, t.user_id, body=body, n=n)
        Scheduler(p).tick(10.0)
        with p.db.connection() as conn:
            rows = conn.execute("select tenant_id, task_id, attempt_id, fencing_token from task_attempt where task_id = any(%s)",
                                (task_ids,)).fetchall()
        refs = [lifecycle.AttemptRef(r["tenant_id"], r["task_id"], r["attempt_id"], r["fencing_token"]) for r in rows]
        for ref in refs:
            now = p.clock.now()
            doc = {"id": f"job-{ref.task_id}", "status": "succeeded", "created_at": now.isoformat(),
                   "finished_at": now.isoformat(), "output_url": f"https://cdn.provider.example/{ref.task_id}.mp4",
                   "usage": {"seconds": 5, "cost_amount": "0.25", "currency": "USD"}, "charge_id": f"ch-{ref.task_id}"}

            def tx(conn, ref=ref, doc=doc, now=now):
                conn.execute("""update task_attempt set state = 'RUNNING', submit_started_at = %s, submit_finished_at = %s,
                                       provider_job_id = %s where attempt_id = %s""", (now, now, doc["id"], ref.attempt_id))
                lifecycle.move(conn, lifecycle.load(conn, ref, lock=True), "RUNNING", now, started_at=now)
                return lifecycle.apply_job(conn, ref, parse_job(doc), source="test", now=now, media=p.config.media)

            assert p.db.transaction(tx).task_state == "PROVIDER_SUCCEEDED"
        return refs

    def one(self, sql: str, *args) -> dict | None:
        with self.p.db.connection() as conn:
            return conn.execute(sql, args).fetchone()

    def job(self, ref) -> dict:
        return self.one("select * from media_job where task_id = %s", ref.task_id)

    def task(self, ref) -> dict:
        return self.one("select * from generation_task where task_id = %s", ref.task_id)

    def outputs(self, ref) -> list[dict]:
        with self.p.db.connection() as conn:
            return conn.execute("select * from task_output where task_id = %s order by asset_type", (ref.task_id,)).fetchall()

    # ... the functions ...
    def dispatch(self) -> dict:
        return media_submit.lambda_handler({}, FakeLambdaContext("aivedio-test-media-submit", timeout_seconds=60))

    def deliver(self, *events: dict) -> dict:
        """Through moto SQS, as the event source mapping hands a batch to media_events."""
        for e in events:
            self.sqs.send_message(QueueUrl=self.sqs_url, MessageBody=json.dumps(e))
        got = self.sqs.receive_message(QueueUrl=self.sqs_url, MaxNumberOfMessages=10, AttributeNames=["All"])["Messages"]
        assert len(got) == len(events)
        records = [{"messageId": m["MessageId"], "receiptHandle": m["ReceiptHandle"], "body": m["Body"],
                    "attributes": m["Attributes"], "messageAttributes": {}, "md5OfBody": m["MD5OfBody"],
                    "eventSource": "aws:sqs", "eventSourceARN": f"arn:aws:sqs:{REGION}:123456789012:{PREFIX}-media_events",
                    "awsRegion": REGION} for m in got]
        out = media_events.lambda_handler({"Records": records}, FakeLambdaContext("aivedio-test-media-events", timeout_seconds=60))
        failed = {f["itemIdentifier"] for f in out["batchItemFailures"]}
        for m in got:
            if m["MessageId"] not in failed:
                self.sqs.delete_message(QueueUrl=self.sqs_url, ReceiptHandle=m["ReceiptHandle"])
        return out

    # ... and the worker's part.
    def described(self, ref) -> dict:
        [entry] = self.batch.describe_jobs(jobs=[self.job(ref)["worker_ref"]])["jobs"]
        return entry

    def state_change(self, ref, status: str, *, reason: str | None = None, exit_code: int | None = None,
                     detail: dict | None = None) -> dict:
        d = dict(detail or self.described(ref))
        d["status"] = status
        d["statusReason"] = reason or ("Essential container in task exited" if status == "FAILED" else "")
        if exit_code is not None:
            d["container"] = {**d["container"], "exitCode": exit_code}
        return {"version": "0", "id": str(uuid.uuid4()), "detail-type": "Batch Job State Change", "source": "aws.batch",
                "account": "123456789012", "time": datetime.now(timezone.utc).isoformat(), "region": REGION,
                "resources": [d["jobArn"]], "detail": d}

    def worker_wrote(self, ref, status: str = "ok", code: str | None = None, *, fencing_token: int | None = None) -> dict:
        spec = self.job(ref)["spec"]
        bucket, result_key = batch.result_location(spec["outputs"])
        prefix = result_key.rsplit("/", 1)[0] + "/"
        outputs = []
        if status == "ok":
            for asset, name, ctype in (("proxy", "proxy.mp4", "video/mp4"), ("thumbnail", "thumbnail.jpg", "image/jpeg")):
                self.s3.put_object(Bucket=bucket, Key=prefix + name, Body=b"x" * 1000, ContentType=ctype,
                                   Tagging=f"tenant_id={spec['tenant_id']}&retention_class={spec['retention_class']}")
                outputs.append({"asset_type": asset, "key": prefix + name, "bytes": 1000, "content_type": ctype,
                                "width": 1280, "height": 720, "codec": "h264" if asset == "proxy" else None,
                                "duration_seconds": 5.0 if asset == "proxy" else None})
        result = {"task_id": spec["task_id"], "output_version": spec["output_version"],
                  "fencing_token": spec["fencing_token"] if fencing_token is None else fencing_token,
                  "status": status, "code": code, "message": None,
                  "probe": {"container": "mp4", "video_codec": "h264", "duration_seconds": 5.0, "width": 1280, "height": 720,
                            "fps": 24, "has_audio": False, "bytes": 5000} if status == "ok" else None,
                  "outputs": outputs, "transcode_seconds": 2.5, "bytes_stored": 2000 if status == "ok" else 0}
        self.s3.put_object(Bucket=bucket, Key=result_key, Body=json.dumps(result).encode())
        return result


@pytest.fixture
def db_url() -> str:
    """A database per test (cloned from the migrated template): the media pools are small (two
    gpu-highmem units), so one test's claims must not hold another's slots."""
    url = create_test_database("media_aws")
    yield url
    drop_test_database(url)


@pytest.fixture
def world(make_platform, tmp_path, monkeypatch):
    with mock_aws(config={"batch": {"use_docker": False}}):
        monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
        targets = _batch_world()
        monkeypatch.setenv(batch.BATCH_ENV, json.dumps(targets))
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket=BUCKET)
        sqs_url = boto3.client("sqs", region_name=REGION).create_queue(QueueName=f"{PREFIX}-media_events")["QueueUrl"]
        cfg = PlatformConfig(providers=[ProviderConfig(name="provider-a",
                                                       accounts=[ProviderAccount(account_id="account-01", max_concurrency=500)])],
                             media=MediaConfig(local_dir=tmp_path / "media"))
        p = make_platform(cfg, clock=ManualClock(datetime.now(timezone.utc)), media_bucket=BUCKET)
        p.extras.update(batch_client=boto3.client("batch", region_name=REGION), s3_client=s3)
        with p.db.connection() as conn:
            apply_config(conn, p.config, p.clock)
        set_platform(p)
        try:
            yield World(p, targets, sqs_url)
        finally:
            set_platform(None)


# --- submit -------------------------------------------------------------------------------------

def test_media_submit_submits_each_claim_to_its_class_queue_with_the_spec(world):
    proxy = world.provider_succeeded(2)
    [highmem] = world.provider_succeeded(1, body=BODY_4K)
    counts = world.dispatch()
    assert counts == {"claimed": 3, "submitted": 3, "failed": 0, "stale": 0}
    assert len(world.submitted) == 3
    by_name = {s["jobName"]: s for s in world.submitted}
    for ref in [*proxy, highmem]:
        job = world.job(ref)
        assert job["state"] == "RUNNING" and job["worker_ref"]
        name = batch.job_name(ref.task_id, job["output_version"], job["fencing_token"])
        sent = by_name[name]
        media_class = "gpu-highmem" if ref == highmem else "cpu-proxy"
        assert job["resource_class"] == media_class
        assert (sent["jobQueue"], sent["jobDefinition"]) == (world.targets[media_class]["queue"],
                                                              world.targets[media_class]["definition"])
        [env] = sent["containerOverrides"]["environment"]
        assert env["name"] == "AIVEDIO_JOB_SPEC" and json.loads(env["value"]) == job["spec"]
        spec = job["spec"]
        assert spec["outputs"] == f"s3://{BUCKET}/outputs/{ref.tenant_id}/{ref.task_id}/v1/"
        assert spec["fencing_token"] == job["fencing_token"] and spec["operation"] == "ingest"
        # The worker's own timeout plus the margin, within the class's.
        assert sent["timeout"] == {"attemptDurationSeconds": int(spec["limits"]["timeout_seconds"]) + batch.TIMEOUT_MARGIN_SECONDS}
        # What Batch holds: the job under that name, on that queue, with the SPEC in its environment.
        entry = world.described(ref)
        assert entry["jobName"] == name and entry["jobQueue"] == world.targets[media_class]["queue"]
        assert batch.spec_of_job(entry) == spec
    # A cpu-proxy job asks for vCPUs and memory by its worker-slot units (720p: 1); a GPU job keeps its definition's.
    proxy_sent = by_name[batch.job_name(proxy[0].task_id, 1, world.job(proxy[0])["fencing_token"])]
    assert proxy_sent["containerOverrides"]["resourceRequirements"] == [{"type": "VCPU", "value": "2"},
                                                                        {"type": "MEMORY", "value": "3072"}]
    highmem_sent = by_name[batch.job_name(highmem.task_id, 1, world.job(highmem)["fencing_token"])]
    assert "resourceRequirements" not in highmem_sent["containerOverrides"]


def test_a_second_run_submits_nothing_more(world):
    [ref] = world.provider_succeeded(1)
    assert world.dispatch()["submitted"] == 1
    first = world.job(ref)
    assert world.dispatch() == {"claimed": 0, "submitted": 0, "failed": 0, "stale": 0}
    assert len(world.submitted) == 1
    assert world.job(ref)["worker_ref"] == first["worker_ref"]
    queue = world.targets["cpu-proxy"]["queue"]
    listed = world.batch.list_jobs(jobQueue=queue, filters=[{"name": "JOB_NAME", "values": [
        batch.job_name(ref.task_id, 1, first["fencing_token"])]}])["jobSummaryList"]
    assert len(listed) == 1


def test_a_4k_transcode_asks_for_six_units_of_cpu():
    target = batch.BatchTarget(queue="q", definition="d", timeout_seconds=3600, vcpus_per_unit=2, memory_mib_per_unit=3072)
    spec = {"task_id": str(uuid.uuid4()), "output_version": 2, "fencing_token": 41, "order": {"resolution": "4k"},
            "limits": {"timeout_seconds": 7200}}
    req = batch.submit_request({"resource_class": "cpu-proxy", "spec": spec}, target)
    assert req["containerOverrides"]["resourceRequirements"] == [{"type": "VCPU", "value": "12"},
                                                                 {"type": "MEMORY", "value": str(6 * 3072)}]
    assert req["timeout"] == {"attemptDurationSeconds": 3600}  # capped at the class's timeout
    assert req["jobName"] == f"media-{spec['task_id']}-v2-41"
    assert batch.parse_job_name(req["jobName"]) == batch.JobKey(spec["task_id"], 2, 41)


def test_a_failed_submit_leaves_the_claim_to_the_reconciler(world, monkeypatch):
    [ref] = world.provider_succeeded(1)
    broken = {**world.targets, "cpu-proxy": {**world.targets["cpu-proxy"],
                                             "queue": world.targets["cpu-proxy"]["queue"].replace(PREFIX, "gone")}}
    monkeypatch.setenv(batch.BATCH_ENV, json.dumps(broken))
    assert world.dispatch() == {"claimed": 1, "submitted": 0, "failed": 1, "stale": 0}
    job = world.job(ref)
    assert job["state"] == "RUNNING" and job["worker_ref"] is None
    # Past its lease, the media-jobs service retries it: PENDING again, the same output version.
    world.p.clock.advance((job["lease_until"] - world.p.clock.now()).total_seconds() + 3600)
    report = room.run(world.p, "media-jobs")
    assert report.details.get("retry") == 1, report
    again = world.job(ref)
    assert (again["state"], again["output_version"], again["error_code"]) == ("PENDING", 1, pipeline.WORKER_LOST)


# --- events -------------------------------------------------------------------------------------

def test_a_succeeded_job_completes_its_task_from_result_json(world):
    [ref] = world.provider_succeeded(1)
    world.dispatch()
    world.worker_wrote(ref, "ok")
    event = world.state_change(ref, "SUCCEEDED")
    assert world.deliver(event) == {"batchItemFailures": []}
    assert world.task(ref)["state"] == "SUCCEEDED"
    job = world.job(ref)
    assert job["state"] == "SUCCEEDED" and job["result"]["status"] == "ok"
    outs = world.outputs(ref)
    assert [(o["asset_type"], o["output_version"]) for o in outs] == [("proxy", 1), ("thumbnail", 1)]
    assert all(o["object_key"].startswith(f"outputs/{ref.tenant_id}/{ref.task_id}/v1/") and o["url"] is None for o in outs)
    # The same event again (SQS delivers at least once): nothing changes.
    assert world.deliver(event) == {"batchItemFailures": []}
    assert world.outputs(ref) == outs and world.job(ref)["updated_at"] == job["updated_at"]
    assert world.one("select count(*) as n from outbox_event where aggregate_id = %s and event_type = 'TaskSucceeded'",
                     ref.task_id)["n"] == 1


def test_a_rejected_result_ends_the_task_media_ingest_failed(world):
    [ref] = world.provider_succeeded(1)
    world.dispatch()
    world.worker_wrote(ref, "rejected", "MEDIA_TRUNCATED")
    world.deliver(world.state_change(ref, "FAILED", exit_code=3))
    assert world.task(ref)["state"] == "MEDIA_INGEST_FAILED"
    assert world.job(ref)["error_code"] == "MEDIA_TRUNCATED" and not world.outputs(ref)


def test_a_failed_job_without_result_json_is_a_transient_error(world):
    timed_out, killed = world.provider_succeeded(2)
    world.dispatch()
    world.deliver(world.state_change(timed_out, "FAILED", reason="Job attempt duration exceeded timeout"),
                  world.state_change(killed, "FAILED", reason="OutOfMemoryError: Container killed due to memory usage",
                                     exit_code=137))
    for ref, code in ((timed_out, "MEDIA_TIMEOUT"), (killed, "MEDIA_WORKER_LOST")):
        job = world.job(ref)
        assert (job["state"], job["output_version"], job["error_code"], job["tries"]) == ("PENDING", 1, code, 1), ref
        assert world.task(ref)["state"] == "MEDIA_PROCESSING"
    assert "exit code 137" in world.job(killed)["result"]["message"]


def test_a_succeeded_job_without_its_own_result_is_an_invalid_result(world):
    [ref] = world.provider_succeeded(1)
    world.dispatch()
    world.worker_wrote(ref, "ok", fencing_token=world.job(ref)["fencing_token"] - 1)  # an older claim's result.json
    world.deliver(world.state_change(ref, "SUCCEEDED"))
    job = world.job(ref)
    assert (job["state"], job["error_code"]) == ("PENDING", "MEDIA_RESULT_INVALID") and not world.outputs(ref)


def test_an_old_claims_event_is_stale_after_a_retry(world):
    [ref] = world.provider_succeeded(1)
    world.dispatch()
    old = world.state_change(ref, "FAILED")
    world.deliver(old)  # a transient error: PENDING, retried after its backoff
    assert world.job(ref)["state"] == "PENDING"
    world.p.clock.advance(3600)
    assert world.dispatch()["submitted"] == 1
    job = world.job(ref)
    assert job["state"] == "RUNNING" and job["tries"] == 2 and job["output_version"] == 1
    world.deliver(old)  # the first claim's event, redelivered: its fencing token is not the job's any more
    assert world.job(ref)["updated_at"] == job["updated_at"]
    world.worker_wrote(ref, "ok")
    world.deliver(world.state_change(ref, "SUCCEEDED"))
    assert world.task(ref)["state"] == "SUCCEEDED" and len(world.outputs(ref)) == 2


def test_an_event_of_another_job_is_acknowledged_and_ignored(world):
    [ref] = world.provider_succeeded(1)
    world.dispatch()
    detail = {**world.described(ref), "jobName": "someone-elses-job"}
    assert world.deliver(world.state_change(ref, "SUCCEEDED", detail=detail)) == {"batchItemFailures": []}
    assert world.job(ref)["state"] == "RUNNING"


def test_a_lost_event_is_completed_by_the_reconciler_from_describe_jobs(world):
    """No event arrives: past the job's lease the media-jobs service asks DescribeJobs (moto's job
    is SUCCEEDED) and applies the job's result.json, as media_events would have."""
    [ref] = world.provider_succeeded(1)
    world.dispatch()
    world.worker_wrote(ref, "ok")
    job = world.job(ref)
    world.p.clock.advance((job["lease_until"] - world.p.clock.now()).total_seconds() + 3600)
    report = room.run(world.p, "media-jobs")
    assert report.details.get("applied") == 1, report
    assert world.task(ref)["state"] == "SUCCEEDED" and len(world.outputs(ref)) == 2


def test_media_submit_without_batch_runs_the_local_dispatcher(world, monkeypatch):
    monkeypatch.delenv(batch.BATCH_ENV)
    assert batch.targets() == {}
    config = world.p.config
    # The local runtime's dispatcher (it puts it in the extras), with the pipeline off (so this test
    # starts no worker subprocess).
    monkeypatch.setitem(world.p.extras, pipeline.LOCAL_DISPATCHER, media_dispatch.run_local)
    world.p.config = config.model_copy(update={"media": config.media.model_copy(update={"enabled": False})})
    try:
        assert world.dispatch() == {"claimed": 0, "disabled": True}
    finally:
        world.p.config = config
    assert not world.submitted


def test_results_are_read_from_the_outputs_prefix():
    assert batch.result_location("s3://b/outputs/t/k/v1/") == ("b", "outputs/t/k/v1/result.json")
    assert batch.result_location("s3://b/outputs/t/k/v1") == ("b", "outputs/t/k/v1/result.json")
    with pytest.raises(ValueError):
        batch.result_location("/local/dir/")
    assert batch.timed_out({"statusReason": "Job attempt duration exceeded timeout"})
    assert not batch.timed_out({"statusReason": "DockerTimeoutError: could not transition to started"})
    assert batch.parse_job_name("media-not-a-uuid-v1-2") is None
    assert timedelta(seconds=batch.BATCH_MIN_TIMEOUT_SECONDS) == timedelta(minutes=1)
