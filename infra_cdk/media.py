"""AWS Batch for media jobs (issue 17): per media resource class (aivedio.media.pipeline.MEDIA_CLASSES)
a managed EC2 compute environment, a job queue and a job definition, running the gpu-render
container (containers/gpu-render); the dispatch schedule that submits to them; and the rule that
turns their jobs' state changes into completions.

Media classes, each on instances of its own, so a flood of one kind of work cannot take another's:
- cpu-proxy: CPU instances (c6i/c7i) for FFmpeg transcodes (the proxy, thumbnail and delivery
  encode). A job asks for vCPUs and memory in proportion to its worker-slot units (a 720p proxy 1,
  1080p 2, a 4K transcode 6), the same units the platform reserves for it;
- gpu-render: NVIDIA GPU instances (g5 A10G / g6 L4) with the ECS GPU AMI, one GPU a job;
- gpu-highmem: L40S instances with 48 GB of GPU memory (g6e), one GPU a job.
Every environment scales from zero vCPUs up to the stage's `batch_max_vcpus` for its class, in
private subnets with a NAT route: workers fetch provider results from the internet and write the
media bucket's outputs/ prefix (tagged for the lifecycle rules).

A job's attempt is retried by Batch only when its host went away (Spot reclaimed, instance
terminated: status reason "Host EC2*"); any exit of the worker ends the attempt, exit 2 (an invalid
SPEC) and 3 (rejected media) named first: retrying media work is the platform's decision
(aivedio.media.pipeline.complete, with backoff and the same output version), not Batch's. Each
class has a timeout (attemptDurationSeconds), and each job a shorter one from its SPEC
(aivedio.media.batch.submit_request).

The path (functions/media_submit, functions/media_events, aivedio.media.batch):
- the `media-dispatch` schedule (aivedio.events_routing) runs media_submit, which claims media jobs
  whose worker slots fit and submits each (batch:SubmitJob on these queues and job definitions only);
- an EventBridge rule sends these queues' "Batch Job State Change" events, SUCCEEDED or FAILED, to
  media_events' own SQS queue (DLQ, alarm: infra_cdk/messaging.py); media_events reads result.json
  from the job's outputs and completes the media job;
- a lost event: the media-jobs reconciler (the maintenance function) asks batch:DescribeJobs.

Image (`-c render_image=auto|asset|ecr`, default auto = asset when the Dockerfile exists):
- asset: `ContainerImage.from_asset` builds containers/gpu-render/Dockerfile with the repository
  root as context (the image installs the project), narrowed by Dockerfile.dockerignore beside
  it. Synthesis only stages those files into cdk.out (no Docker, offline); Docker builds the
  image when `cdk deploy` publishes the asset.
- ecr: an ECR repository this stack creates and the image tag given by the `GpuRenderImageTag`
  parameter (pushed by CI), so deploying needs no Docker at all."""
from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import CfnParameter, Duration, IgnoreMode, RemovalPolicy, Size, Stack
from aws_cdk import aws_batch as batch
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_ecr_assets as ecr_assets
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sqs as sqs
from cdk_nag import RegexAppliesTo
from constructs import Construct

from aivedio import events_routing
from aivedio.media import batch as media_batch
from aivedio.media.pipeline import MEDIA_CLASSES as PIPELINE_CLASSES
from infra_cdk.nag import suppress
from infra_cdk.network import EGRESS
from infra_cdk.stages import ROOT, StageConfig

RENDER_DIR = ROOT / "containers" / "gpu-render"
RENDER_DOCKERFILE = "containers/gpu-render/Dockerfile"  # relative to the build context, ROOT
OUTPUTS_PREFIX = "outputs/"  # where workers write (and media_events reads) under the media bucket
INPUTS_PREFIX = "inputs/"
EXIT_INVALID_SPEC, EXIT_REJECTED = 2, 3  # containers/gpu-render/worker.py's exit statuses that end a job
HOST_RETRIES = 3  # attempts per Batch job: the first, and two more after a lost host
ECS_AGENT_RESERVE_MIB = 1024  # what an instance keeps for the OS and the ECS agent
BATCH_EVENTS = next(e for e in events_routing.AWS_EVENTS if e.source == "aws.batch")


def render_context_exclude() -> list[str]:
    """Docker ignore rules of the image's build context (Dockerfile.dockerignore)."""
    text = (RENDER_DIR / "Dockerfile.dockerignore").read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


# vCPUs, memory (MiB), NVIDIA GPUs: the instance types the classes use, to check every job fits one.
INSTANCE_SHAPES: dict[str, tuple[int, int, int]] = {
    "c6i.2xlarge": (8, 16_384, 0), "c6i.4xlarge": (16, 32_768, 0),
    "c7i.2xlarge": (8, 16_384, 0), "c7i.4xlarge": (16, 32_768, 0),
    "g5.2xlarge": (8, 32_768, 1), "g5.4xlarge": (16, 65_536, 1),
    "g6.2xlarge": (8, 32_768, 1), "g6.4xlarge": (16, 65_536, 1),
    "g6e.2xlarge": (8, 65_536, 1), "g6e.4xlarge": (16, 131_072, 1),
}


@dataclass(frozen=True)
class MediaClass:
    name: str  # a key of aivedio.media.pipeline.MEDIA_CLASSES
    instance_types: tuple[str, ...]
    gpus: int  # per job
    vcpus: float  # per job (per unit, where sized by units)
    memory_mib: int  # per job (per unit, where sized by units)
    timeout_minutes: int  # the job definition's attemptDurationSeconds
    priority: int  # job queue priority
    sized_by_units: bool = False  # a job asks for vcpus/memory_mib times its worker-slot units

    @property
    def gpu(self) -> bool:
        return self.gpus > 0

    def job_size(self, units: int) -> tuple[float, int]:
        return (self.vcpus * units, self.memory_mib * units) if self.sized_by_units else (self.vcpus, self.memory_mib)

    def check_fits(self, max_units: int) -> None:
        """The largest job of the class fits one of its instance types (else Batch leaves it RUNNABLE)."""
        vcpus, memory = self.job_size(max_units)
        if not any(v >= vcpus and m - ECS_AGENT_RESERVE_MIB >= memory and g >= self.gpus
                   for v, m, g in (INSTANCE_SHAPES[t] for t in self.instance_types)):
            raise SystemExit(f"media class {self.name}: a job of {max_units} units ({vcpus} vCPUs, {memory} MiB, "
                             f"{self.gpus} GPUs) fits none of {self.instance_types}")

    def target(self, queue: batch.JobQueue, job: batch.EcsJobDefinition) -> dict:
        """Its entry of AIVEDIO_MEDIA_BATCH (aivedio.media.batch.targets)."""
        t = {"queue": queue.job_queue_arn, "definition": job.job_definition_arn, "timeout_seconds": self.timeout_minutes * 60}
        if self.sized_by_units:
            t.update(vcpus_per_unit=self.vcpus, memory_mib_per_unit=self.memory_mib)
        return t


MEDIA_CLASSES: tuple[MediaClass, ...] = (
    MediaClass("cpu-proxy", ("c6i.2xlarge", "c6i.4xlarge", "c7i.2xlarge", "c7i.4xlarge"),
               gpus=0, vcpus=2, memory_mib=3_072, timeout_minutes=60, priority=10, sized_by_units=True),
    MediaClass("gpu-render", ("g5.2xlarge", "g5.4xlarge", "g6.2xlarge", "g6.4xlarge"),
               gpus=1, vcpus=6, memory_mib=28_672, timeout_minutes=120, priority=20),
    MediaClass("gpu-highmem", ("g6e.2xlarge", "g6e.4xlarge"),
               gpus=1, vcpus=6, memory_mib=57_344, timeout_minutes=180, priority=20),
)
RESOURCE_CLASSES = MEDIA_CLASSES  # the name this module's classes had before the media pipeline


def retry_strategies() -> list[batch.RetryStrategy]:
    """Retry on a lost host only; every exit of the worker ends the attempt (at most 5 conditions)."""
    return [
        batch.RetryStrategy.of(batch.Action.RETRY, batch.Reason.SPOT_INSTANCE_RECLAIMED),  # "Host EC2*"
        batch.RetryStrategy.of(batch.Action.EXIT, batch.Reason.custom(on_exit_code=str(EXIT_INVALID_SPEC))),
        batch.RetryStrategy.of(batch.Action.EXIT, batch.Reason.custom(on_exit_code=str(EXIT_REJECTED))),
        batch.RetryStrategy.of(batch.Action.EXIT, batch.Reason.custom(on_reason="*")),  # anything else
    ]


def image_source(requested: str | None) -> str:
    has_dockerfile = (RENDER_DIR / "Dockerfile").is_file()
    if requested in (None, "", "auto"):
        return "asset" if has_dockerfile else "ecr"
    if requested == "asset" and not has_dockerfile:
        raise SystemExit(f"-c render_image=asset: {RENDER_DIR}/Dockerfile does not exist yet")
    if requested not in ("asset", "ecr"):
        raise SystemExit(f"-c render_image={requested!r}: expected asset, ecr or auto")
    return requested


class Media(Construct):
    def __init__(self, scope: Construct, cid: str, *, stage: StageConfig, vpc: ec2.IVpc, media_bucket: s3.IBucket,
                 render_image: str | None) -> None:
        super().__init__(scope, cid)
        if {mc.name for mc in MEDIA_CLASSES} != set(PIPELINE_CLASSES):
            raise SystemExit(f"infra_cdk/media.py MEDIA_CLASSES {[mc.name for mc in MEDIA_CLASSES]} are not the "
                             f"pipeline's media classes {sorted(PIPELINE_CLASSES)} (aivedio.media.pipeline)")
        self.stage, self.media_bucket = stage, media_bucket
        self.image_source = image_source(render_image)
        if self.image_source == "asset":
            image = ecs.ContainerImage.from_asset(
                str(ROOT), file=RENDER_DOCKERFILE, exclude=render_context_exclude(), ignore_mode=IgnoreMode.DOCKER,
                platform=ecr_assets.Platform.LINUX_AMD64)  # the compute environments are x86_64
            self.repository = None
        else:
            self.repository = ecr.Repository(
                self, "RenderRepository", repository_name=f"{stage.prefix}/gpu-render", image_scan_on_push=True,
                image_tag_mutability=ecr.TagMutability.IMMUTABLE,
                removal_policy=RemovalPolicy.RETAIN if stage.retain else RemovalPolicy.DESTROY,
                empty_on_delete=not stage.retain,
                lifecycle_rules=[ecr.LifecycleRule(max_image_count=50, description="keep the last 50 images")])
            tag = CfnParameter(self, "GpuRenderImageTag", type="String", default="bootstrap",
                               description="Tag of the gpu-render image in the repository (pushed by CI)")
            image = ecs.ContainerImage.from_ecr_repository(self.repository, tag=tag.value_as_string)

        self.sg = ec2.SecurityGroup(self, "WorkerSg", vpc=vpc, allow_all_outbound=True,
                                    description="Batch media workers: outbound only")
        self.logs = logs.LogGroup(self, "JobLogs", retention=stage.log_retention, removal_policy=stage.removal_policy)
        self.job_role = iam.Role(self, "JobRole", assumed_by=iam.ServicePrincipal("ecs-tasks.amazonaws.com"),
                                 description="gpu-render jobs: read the media bucket's inputs and outputs, write outputs")
        self.job_role.add_to_policy(iam.PolicyStatement(
            actions=["s3:GetObject"],
            resources=[media_bucket.arn_for_objects(f"{INPUTS_PREFIX}*"), media_bucket.arn_for_objects(f"{OUTPUTS_PREFIX}*")]))
        self.job_role.add_to_policy(iam.PolicyStatement(
            actions=["s3:PutObject", "s3:PutObjectTagging", "s3:AbortMultipartUpload"],
            resources=[media_bucket.arn_for_objects(f"{OUTPUTS_PREFIX}*")]))
        # A worker that rejects the media removes what it (or an earlier, killed attempt) stored of it:
        # nothing of bad media stays in the bucket.
        self.job_role.add_to_policy(iam.PolicyStatement(
            actions=["s3:DeleteObject"], resources=[media_bucket.arn_for_objects(f"{OUTPUTS_PREFIX}*")]))
        # A retry sees what an earlier attempt stored (a missing key reads NoSuchKey, not AccessDenied).
        self.job_role.add_to_policy(list_statement(media_bucket, OUTPUTS_PREFIX))
        suppress(self.job_role, ("AwsSolutions-IAM5", "Media jobs read inputs and write outputs under keys per tenant "
                                                      "and task, unknown in advance, below the media bucket's inputs/ "
                                                      "and outputs/ prefixes; they delete only below outputs/ (the "
                                                      "outputs of media they rejected) and list nothing else.",
                                 [RegexAppliesTo(regex=r"/^Resource::<.*Media.*\.Arn>\/(inputs|outputs)\/\*$/g")]),
                 children=True)

        self.environments: dict[str, batch.ManagedEc2EcsComputeEnvironment] = {}
        self.queues: dict[str, batch.JobQueue] = {}
        self.job_definitions: dict[str, batch.EcsJobDefinition] = {}
        self.targets: dict[str, dict] = {}
        for mc in MEDIA_CLASSES:
            mc.check_fits(max(PIPELINE_CLASSES[mc.name].units.values()))
            ce = batch.ManagedEc2EcsComputeEnvironment(
                self, f"{mc.name}-ce", compute_environment_name=f"{stage.prefix}-{mc.name}",
                vpc=vpc, vpc_subnets=EGRESS, security_groups=[self.sg],
                instance_types=[ec2.InstanceType(t) for t in mc.instance_types], use_optimal_instance_classes=False,
                images=[batch.EcsMachineImage(image_type=batch.EcsMachineImageType.ECS_AL2_NVIDIA if mc.gpu
                                              else batch.EcsMachineImageType.ECS_AL2023)],
                minv_cpus=0, maxv_cpus=stage.batch_max_vcpus[mc.name],
                spot=stage.batch_spot,
                allocation_strategy=(batch.AllocationStrategy.SPOT_PRICE_CAPACITY_OPTIMIZED if stage.batch_spot
                                     else batch.AllocationStrategy.BEST_FIT_PROGRESSIVE),
                update_to_latest_image_version=True,
            )
            queue = batch.JobQueue(self, f"{mc.name}-queue", job_queue_name=f"{stage.prefix}-{mc.name}",
                                   priority=mc.priority,
                                   compute_environments=[batch.OrderedComputeEnvironment(compute_environment=ce, order=1)])
            job = batch.EcsJobDefinition(
                self, f"{mc.name}-job", job_definition_name=f"{stage.prefix}-{mc.name}",
                container=batch.EcsEc2ContainerDefinition(
                    self, f"{mc.name}-container", image=image, cpu=mc.vcpus, memory=Size.mebibytes(mc.memory_mib),
                    gpu=mc.gpus or None, job_role=self.job_role,
                    logging=ecs.LogDriver.aws_logs(stream_prefix=mc.name, log_group=self.logs),
                    environment={"AIVEDIO_STAGE": stage.name, "AIVEDIO_RESOURCE_CLASS": mc.name,
                                 "AIVEDIO_MEDIA_BUCKET": media_bucket.bucket_name},
                    readonly_root_filesystem=False,
                ),
                retry_attempts=HOST_RETRIES, retry_strategies=retry_strategies(),
                timeout=Duration.minutes(mc.timeout_minutes), propagate_tags=True,
            )
            self.environments[mc.name], self.queues[mc.name], self.job_definitions[mc.name] = ce, queue, job
            self.targets[mc.name] = mc.target(queue, job)
            suppress(job.container.execution_role, (
                "AwsSolutions-IAM5", "ecr:GetAuthorizationToken has no resource-level permissions (it returns a "
                                     "registry token); the image pull actions name the one repository.",
                ["Resource::*"]), children=True)
            suppress(ce, ("AwsSolutions-IAM4", "Batch's EC2 instance role needs the AWS managed "
                                               "AmazonEC2ContainerServiceforEC2Role for the ECS agent; it is the "
                                               "documented policy for Batch container instances.",
                          ["Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AmazonEC2ContainerServiceforEC2Role"]),
                     children=True)
        self.rule: events.Rule | None = None

    def grant_submit(self, grantee: iam.IGrantable, resource_class: str | None = None) -> None:
        """batch:SubmitJob to the media job queues with their own job definitions (one class, or all)."""
        names = [resource_class] if resource_class else list(self.queues)
        iam.Grant.add_to_principal(
            grantee=grantee, actions=["batch:SubmitJob"],
            resource_arns=[arn for n in names for arn in (self.queues[n].job_queue_arn, self.job_definitions[n].job_definition_arn)])

    def targets_json(self) -> str:
        """AIVEDIO_MEDIA_BATCH: JSON whose ARNs are tokens CloudFormation renders at deploy time."""
        return Stack.of(self).to_json_string(self.targets)

    def connect(self, functions, event_queues: dict[str, sqs.IQueue]) -> None:
        """The media functions: submitters (SubmitJob here only), describers (DescribeJobs), and the
        rule that sends these queues' finished jobs to the Batch events consumer's queue."""
        for fn in functions:
            p = fn.profile
            if p.submits_media_jobs:
                self.grant_submit(fn.role)
            if p.describes_media_jobs:
                # DescribeJobs has no resource-level permissions (AWS Batch's service authorization reference).
                fn.role.add_to_policy(iam.PolicyStatement(actions=["batch:DescribeJobs"], resources=["*"]))
            if p.submits_media_jobs or p.describes_media_jobs:
                fn.add_environment(media_batch.BATCH_ENV, self.targets_json())
                fn.add_environment("AIVEDIO_MEDIA_BUCKET", self.media_bucket.bucket_name)  # the SPEC's outputs
        queue = event_queues.get(BATCH_EVENTS.consumer)
        if queue is None:
            raise SystemExit(f"no queue for {BATCH_EVENTS.consumer}, the consumer of Batch job state changes "
                             "(aivedio.events_routing.AWS_EVENTS; infra_cdk/messaging.py makes it)")
        self.rule = events.Rule(
            self, "JobStateRule", rule_name=f"{self.stage.prefix}-{BATCH_EVENTS.name}",
            description=f"finished media jobs ({', '.join(self.queues)}) to {BATCH_EVENTS.consumer}",
            event_pattern=event_pattern([q.job_queue_arn for q in self.queues.values()]))
        self.rule.add_target(targets.SqsQueue(queue))


def event_pattern(job_queue_arns: list[str]) -> events.EventPattern:
    return events.EventPattern(source=[BATCH_EVENTS.source], detail_type=[BATCH_EVENTS.detail_type],
                               detail={**BATCH_EVENTS.detail, "jobQueue": job_queue_arns})


def list_statement(bucket: s3.IBucket, prefix: str) -> iam.PolicyStatement:
    """s3:ListBucket below one prefix only: a reader told "no such key" instead of AccessDenied."""
    return iam.PolicyStatement(actions=["s3:ListBucket"], resources=[bucket.bucket_arn],
                               conditions={"StringLike": {"s3:prefix": [f"{prefix}*"]}})


