"""AWS Batch for media jobs: per resource class a managed EC2 compute environment, a job queue
and a job definition, running the gpu-render container (containers/gpu-render).

The resource classes are the ones admission assigns (aivedio.admission.estimates): CPU instances
for `video-standard` (FFmpeg transcodes), NVIDIA GPU instances with the ECS GPU AMI for `video-4k`
(A10G) and `video-v2v` (L40S, 48 GB for video-to-video models). The environments scale from zero
vCPUs and sit in private subnets with a NAT route: workers fetch provider results from the
internet and read and write the media bucket.

Image (`-c render_image=auto|asset|ecr`, default auto = asset when the Dockerfile exists):
- asset: `ContainerImage.from_asset` builds containers/gpu-render/Dockerfile with the repository
  root as context (the image installs the project), narrowed by Dockerfile.dockerignore beside
  it. Synthesis only stages those files into cdk.out (no Docker, offline); Docker builds the
  image when `cdk deploy` publishes the asset.
- ecr: an ECR repository this stack creates and the image tag given by the `GpuRenderImageTag`
  parameter (pushed by CI), so deploying needs no Docker at all."""
from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import CfnParameter, Duration, IgnoreMode, RemovalPolicy, Size
from aws_cdk import aws_batch as batch
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_ecr_assets as ecr_assets
from aws_cdk import aws_ecs as ecs
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from cdk_nag import RegexAppliesTo
from constructs import Construct

from infra_cdk.nag import suppress
from infra_cdk.network import EGRESS
from infra_cdk.stages import ROOT, StageConfig

RENDER_DIR = ROOT / "containers" / "gpu-render"
RENDER_DOCKERFILE = "containers/gpu-render/Dockerfile"  # relative to the build context, ROOT


def render_context_exclude() -> list[str]:
    """Docker ignore rules of the image's build context (Dockerfile.dockerignore)."""
    text = (RENDER_DIR / "Dockerfile.dockerignore").read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@dataclass(frozen=True)
class ResourceClass:
    name: str
    instance_types: tuple[str, ...]
    gpus: int  # per job
    vcpus: float  # per job
    memory_mib: int  # per job; leaves room for the ECS agent on the smallest instance type
    timeout_minutes: int
    priority: int  # job queue priority

    @property
    def gpu(self) -> bool:
        return self.gpus > 0


RESOURCE_CLASSES: tuple[ResourceClass, ...] = (
    ResourceClass("video-standard", ("c6i.2xlarge", "c6i.4xlarge", "c7i.2xlarge", "c7i.4xlarge"),
                  gpus=0, vcpus=4, memory_mib=7_168, timeout_minutes=60, priority=10),
    ResourceClass("video-4k", ("g5.2xlarge", "g5.4xlarge", "g6.2xlarge", "g6.4xlarge"),
                  gpus=1, vcpus=6, memory_mib=28_672, timeout_minutes=120, priority=20),
    ResourceClass("video-v2v", ("g6e.2xlarge", "g6e.4xlarge"),
                  gpus=1, vcpus=6, memory_mib=57_344, timeout_minutes=180, priority=20),
)


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
                                 description="gpu-render jobs: the media bucket only")
        self.job_role.add_to_policy(iam.PolicyStatement(
            actions=["s3:GetObject", "s3:PutObject", "s3:PutObjectTagging", "s3:AbortMultipartUpload"],
            resources=[media_bucket.arn_for_objects("*")]))
        suppress(self.job_role, ("AwsSolutions-IAM5", "Media jobs read inputs and write outputs under keys per tenant "
                                                      "and task, unknown in advance, of the one media bucket; no List, "
                                                      "no Delete (lifecycle rules expire objects).",
                                 [RegexAppliesTo(regex=r"/^Resource::<.*Media.*\.Arn>\/\*$/g")]),
                 children=True)

        self.environments: dict[str, batch.ManagedEc2EcsComputeEnvironment] = {}
        self.queues: dict[str, batch.JobQueue] = {}
        self.job_definitions: dict[str, batch.EcsJobDefinition] = {}
        for rc in RESOURCE_CLASSES:
            ce = batch.ManagedEc2EcsComputeEnvironment(
                self, f"{rc.name}-ce", compute_environment_name=f"{stage.prefix}-{rc.name}",
                vpc=vpc, vpc_subnets=EGRESS, security_groups=[self.sg],
                instance_types=[ec2.InstanceType(t) for t in rc.instance_types], use_optimal_instance_classes=False,
                images=[batch.EcsMachineImage(image_type=batch.EcsMachineImageType.ECS_AL2_NVIDIA if rc.gpu
                                              else batch.EcsMachineImageType.ECS_AL2023)],
                minv_cpus=0, maxv_cpus=stage.batch_max_vcpus[rc.name],
                spot=stage.batch_spot,
                allocation_strategy=(batch.AllocationStrategy.SPOT_PRICE_CAPACITY_OPTIMIZED if stage.batch_spot
                                     else batch.AllocationStrategy.BEST_FIT_PROGRESSIVE),
                update_to_latest_image_version=True,
            )
            queue = batch.JobQueue(self, f"{rc.name}-queue", job_queue_name=f"{stage.prefix}-{rc.name}",
                                   priority=rc.priority,
                                   compute_environments=[batch.OrderedComputeEnvironment(compute_environment=ce, order=1)])
            job = batch.EcsJobDefinition(
                self, f"{rc.name}-job", job_definition_name=f"{stage.prefix}-{rc.name}",
                container=batch.EcsEc2ContainerDefinition(
                    self, f"{rc.name}-container", image=image, cpu=rc.vcpus, memory=Size.mebibytes(rc.memory_mib),
                    gpu=rc.gpus or None, job_role=self.job_role,
                    logging=ecs.LogDriver.aws_logs(stream_prefix=rc.name, log_group=self.logs),
                    environment={"AIVEDIO_STAGE": stage.name, "AIVEDIO_RESOURCE_CLASS": rc.name,
                                 "AIVEDIO_MEDIA_BUCKET": media_bucket.bucket_name},
                    readonly_root_filesystem=False,
                ),
                retry_attempts=2, timeout=Duration.minutes(rc.timeout_minutes), propagate_tags=True,
            )
            self.environments[rc.name], self.queues[rc.name], self.job_definitions[rc.name] = ce, queue, job
            suppress(job.container.execution_role, (
                "AwsSolutions-IAM5", "ecr:GetAuthorizationToken has no resource-level permissions (it returns a "
                                     "registry token); the image pull actions name the one repository.",
                ["Resource::*"]), children=True)
            suppress(ce, ("AwsSolutions-IAM4", "Batch's EC2 instance role needs the AWS managed "
                                               "AmazonEC2ContainerServiceforEC2Role for the ECS agent; it is the "
                                               "documented policy for Batch container instances.",
                          ["Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AmazonEC2ContainerServiceforEC2Role"]),
                     children=True)

    def grant_submit(self, grantee: iam.IGrantable, resource_class: str) -> None:
        """For the media functions the media issue adds: submit jobs of one class to its queue."""
        iam.Grant.add_to_principal(
            grantee=grantee, actions=["batch:SubmitJob"],
            resource_arns=[self.queues[resource_class].job_queue_arn,
                           self.job_definitions[resource_class].job_definition_arn])
