"""Every handler under functions/ becomes a Lambda function: found in the tree, each with its own
role that starts empty and is granted only what its profile says it uses, the core layer
(build/layer, see layers/build.py) and, for the functions that open media, the media layer
(build/layer-media: PyAV), the functions/ tree as code, a log group with retention, X-Ray
tracing, and reserved concurrency where the stage bounds it.

A new function needs a line in PROFILES: synthesis fails for a handler without one, so nothing is
deployed with access it was not given on purpose. Queue consumers and schedules are not declared
here: they come from aivedio.events_routing (infra_cdk/messaging.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from aivedio import metrics_catalog
from infra_cdk.nag import suppress
from infra_cdk.network import EGRESS, ISOLATED
from infra_cdk.stages import ROOT, StageConfig
from layers import build as layer_build

FUNCTIONS_DIR = ROOT / "functions"
RUNTIME = lambda_.Runtime("python" + layer_build.PYTHON_VERSION, lambda_.RuntimeFamily.PYTHON)
STATE_MACHINE_ENV = "AIVEDIO_ATTEMPT_STATE_MACHINE_ARN"  # aivedio.config.settings_from_env reads it
ARCHITECTURE = lambda_.Architecture.X86_64 if layer_build.ARCHITECTURE == "x86_64" else lambda_.Architecture.ARM_64


@dataclass(frozen=True)
class FunctionProfile:
    """What one function uses. Everything defaults to nothing but logs and tracing."""

    description: str
    memory_mb: int = 512
    timeout_seconds: int = 60
    database: bool = False  # rds-db:connect on the proxy, and the network path to it
    redis: bool = False  # read the Redis user secret, and the network path to the cache
    internet: bool = False  # placed in subnets with a NAT route (else isolated)
    publishes_events: bool = False  # sqs:SendMessage on every event queue (the outbox relay)
    media_read_prefixes: tuple[str, ...] = ()  # s3:GetObject on these key prefixes of the media bucket
    media_write_prefixes: tuple[str, ...] = ()
    media_list_prefixes: tuple[str, ...] = ()  # s3:ListBucket below these prefixes: a missing key is NoSuchKey
    api: bool = False  # fronted by the tenant API's API Gateway (infra_cdk/api.py)
    admin_api: bool = False  # fronted by the admin API's own API Gateway (infra_cdk/admin_api.py)
    migrates: bool = False  # invoked by the schema-migration custom resource
    starts_workflow: bool = False  # states:StartExecution on the attempt state machine
    provider_credentials: bool = False  # reads the provider secret: calls providers or verifies their webhooks
    submits_jobs: bool = False  # gives providers a callback URL: the API's own (AIVEDIO_API_BASE_URL)
    archives_invoices: bool = False  # writes and reads the invoice archive (AIVEDIO_INVOICE_BUCKET, Object Lock)
    # Media jobs on Batch (infra_cdk/media.py; AIVEDIO_MEDIA_BATCH names the queues and definitions):
    submits_media_jobs: bool = False  # batch:SubmitJob on the media job queues and their job definitions only
    describes_media_jobs: bool = False  # batch:DescribeJobs (no resource-level permissions exist for it)
    parses_media: bool = False  # opens media with PyAV (aivedio.media.probe): the media layer too


PROFILES: dict[str, FunctionProfile] = {
    "api": FunctionProfile(
        "HTTP API behind API Gateway: admission, generations, wallet",
        memory_mb=1024, timeout_seconds=29, database=True, redis=True, api=True, provider_credentials=True,
        # Admission probes input media (aivedio.media.probe): https:// URLs need the internet,
        # s3:// inputs are read from the media bucket's uploads. Generations' outputs are presigned
        # GET URLs of the media bucket's outputs/ (aivedio.media.urls), signed with this role.
        internet=True, media_read_prefixes=("inputs/", "outputs/"), parses_media=True),
    "admin_api": FunctionProfile(
        "Admin API behind its own API Gateway: operators, tenants and keys, policies, capacity, reviews, "
        "refunds; the operations dashboard", memory_mb=1024, timeout_seconds=29, database=True, redis=True,
        admin_api=True,
        # Resolving a MANUAL_REVIEW asks the provider for the attempt's job first (aivedio.attempts.review).
        internet=True, provider_credentials=True),
    # The relay and the tick are continuous schedules (aivedio.events_routing): a run polls until
    # near its timeout, two schedule periods, so a new run starts while the last still polls
    # (infra_cdk/messaging.py checks it). Both wait for wake-ups on Redis between idle polls.
    "outbox_relay": FunctionProfile(
        "Publishes outbox events to their SQS queues, polling continuously", timeout_seconds=120, database=True,
        redis=True, publishes_events=True),
    "scheduler_tick": FunctionProfile(
        "Scheduling tick: lane, tenant by DRR, atomic claims, polling continuously", memory_mb=1024,
        timeout_seconds=120, database=True, redis=True),
    "scheduler_maintenance": FunctionProfile(
        "Aging, starvation detector, queue-index rebuild", timeout_seconds=120, database=True, redis=True),
    "queue_indexer": FunctionProfile(
        "Consumes TaskQueued: puts the tenant on its lane's ring", timeout_seconds=30, database=True, redis=True),
    "dispatch": FunctionProfile(
        "Consumes TaskDispatchRequested: starts the attempt workflow", timeout_seconds=30, starts_workflow=True),
    "attempt_step": FunctionProfile(
        "One step of the attempt workflow: submit, poll, resolve SUBMIT_UNKNOWN, cancel, finalize",
        timeout_seconds=60, database=True, internet=True, provider_credentials=True, submits_jobs=True),
    "attempt_recovery": FunctionProfile(
        "Lease scanner: restarts the workflow of attempts whose execution was lost", timeout_seconds=120,
        database=True, starts_workflow=True),
    "settlement": FunctionProfile(
        "Consumes TaskSucceeded/TaskFailed/TaskCancelled: settles credit at the locked price, records provider cost",
        timeout_seconds=60, database=True),
    "credit_expiry": FunctionProfile(
        "Subscription grants, credit-lot expiry sweep, retry of parked settlements", timeout_seconds=300, database=True),
    "wallet_check": FunctionProfile(
        "Wallet checks: snapshot vs ledger vs reservations vs lots; freezes and alerts on a mismatch",
        timeout_seconds=600, database=True),
    "maintenance": FunctionProfile(
        "The maintenance room's newer services, one EventBridge schedule each: expired reservations, stuck "
        "submits, unsettled terminals, outbox dead letters, parked webhooks, Redis index and counters, invoices",
        # It asks providers (lookups by key, invoices), so it has their credentials; a repair that
        # needs a workflow makes the attempt's lease expire, and the lease scanner starts it.
        # The media-jobs reconciler asks Batch about RUNNING media jobs past their lease (DescribeJobs)
        # and completes a finished one from its result.json, as media_events would have.
        timeout_seconds=300, database=True, redis=True, internet=True, provider_credentials=True,
        archives_invoices=True, describes_media_jobs=True, media_read_prefixes=("outputs/",),
        media_list_prefixes=("outputs/",)),
    # The media pipeline in AWS (infra_cdk/media.py): the dispatch schedule submits Batch jobs, the
    # Batch events' consumer completes them.
    "media_submit": FunctionProfile(
        "Media dispatch: claims media jobs whose worker slots fit, submits each to its class's Batch job queue",
        timeout_seconds=60, database=True, submits_media_jobs=True),
    "media_events": FunctionProfile(
        "Consumes Batch Job State Change events of the media job queues: completes each job from its result.json",
        timeout_seconds=60, database=True, media_read_prefixes=("outputs/",), media_list_prefixes=("outputs/",)),
    "idempotency_purge": FunctionProfile(
        "Deletes idempotency records past their TTL, in batches", timeout_seconds=300, database=True),
    "db_migrate": FunctionProfile(
        "Applies schema migrations on deploy (custom resource)", timeout_seconds=600, database=True, migrates=True),
}


def discover(directory: Path = FUNCTIONS_DIR) -> list[str]:
    """The function names: every directory under functions/ with a handler.py."""
    return sorted(p.parent.name for p in directory.glob("*/handler.py"))


def handler_path(name: str) -> str:
    return f"functions.{name}.handler.lambda_handler"


def functions_code() -> lambda_.Code:
    """The functions/ tree, with the repository root as asset root so handlers import as
    functions.<name>.handler (as locally). Nothing else of the repository goes in."""
    return lambda_.Code.from_asset(
        str(ROOT),
        # Glob patterns do not match dot-files with "*": ".*" keeps .git, .venv and the like out.
        exclude=["*", ".*", "!functions", "!functions/**", "**/__pycache__", "**/*.pyc"],
    )


def layer_code(mode: str, which: str = "core") -> lambda_.Code:
    """`build` (default): the layer `which` (core: build/layer, media: build/layer-media) from
    layers/build.py, the core's aivedio package refreshed from shared/ now, so a synth never ships a
    stale core. `stub`: an empty layer, for tests and for looking at templates without the
    download; not deployable."""
    if mode == "stub":
        stub = ROOT / "build" / ("layer-stub" if which == "core" else f"layer-{which}-stub") / "python"
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "README.txt").write_text(f"Stub {which} layer (-c layer=stub): synthesis only, not deployable.\n")
        return lambda_.Code.from_asset(str(stub.parent))
    if mode != "build":
        raise ValueError(f"-c layer={mode!r}: expected build or stub")
    layer_dir = layer_build.LAYER_DIR if which == "core" else layer_build.MEDIA_LAYER_DIR
    if not (layer_dir / "python").is_dir() or layer_build.stale(which):
        raise SystemExit(f"{layer_dir} is missing or its dependencies changed in pyproject.toml: run `make layer` "
                         "(python layers/build.py), or synthesize with -c layer=stub")
    if which == "core":
        layer_build.refresh_package()
    return lambda_.Code.from_asset(str(layer_dir), exclude=[".deps-stamp"])


class AppFunction(Construct):
    """One function, its role, log group and security group."""

    def __init__(self, scope: Construct, name: str, *, stage: StageConfig, profile: FunctionProfile,
                 code: lambda_.Code, layers: list[lambda_.ILayerVersion], vpc: ec2.IVpc,
                 environment: dict[str, str]) -> None:
        super().__init__(scope, name)
        self.name, self.profile = name, profile
        function_name = f"{stage.prefix}-{name.replace('_', '-')}"
        self.log_group = logs.LogGroup(self, "Logs", log_group_name=f"/aws/lambda/{function_name}",
                                       retention=stage.log_retention, removal_policy=stage.removal_policy)
        self.role = iam.Role(self, "Role", assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
                             description=f"{function_name}: only what {name} uses")
        # Logs to its own group only (no AWS managed policy).
        self.role.add_to_policy(iam.PolicyStatement(
            actions=["logs:CreateLogStream", "logs:PutLogEvents"], resources=[self.log_group.log_group_arn]))
        # A function in a VPC manages its ENIs; EC2 offers no resource-level permissions for these.
        self.role.add_to_policy(iam.PolicyStatement(
            actions=["ec2:CreateNetworkInterface", "ec2:DescribeNetworkInterfaces", "ec2:DeleteNetworkInterface",
                     "ec2:AssignPrivateIpAddresses", "ec2:UnassignPrivateIpAddresses"],
            resources=["*"]))
        self.sg = ec2.SecurityGroup(self, "Sg", vpc=vpc, allow_all_outbound=True,
                                    description=f"{function_name}: outbound only")
        env = {
            "POWERTOOLS_SERVICE_NAME": metrics_catalog.SERVICE,
            "POWERTOOLS_METRICS_NAMESPACE": metrics_catalog.NAMESPACE,
            "AIVEDIO_LOG_LEVEL": "INFO",
            "AIVEDIO_STAGE": stage.name,
            **environment,
        }
        self.function = lambda_.Function(
            self, "Function",
            function_name=function_name,
            description=profile.description,
            runtime=RUNTIME, architecture=ARCHITECTURE,
            handler=handler_path(name), code=code, layers=layers,
            role=self.role, log_group=self.log_group,
            memory_size=profile.memory_mb, timeout=Duration.seconds(profile.timeout_seconds),
            vpc=vpc, vpc_subnets=EGRESS if profile.internet else ISOLATED, security_groups=[self.sg],
            reserved_concurrent_executions=stage.reserved_concurrency.get(name),
            tracing=lambda_.Tracing.ACTIVE,
            environment=env,
        )
        suppress(self.role, ("AwsSolutions-IAM5", "Lambda ENI management in a VPC, X-Ray PutTraceSegments/"
                                                  "PutTelemetryRecords and (media functions) batch:DescribeJobs support "
                                                  "no resource-level permissions, so they take Resource '*'; every other "
                                                  "statement names its resources.",
                             ["Resource::*"]), children=True)
        suppress(self.function, ("AwsSolutions-L1", f"Pinned to python{layer_build.PYTHON_VERSION}, the version the "
                                                    "layers' binary wheels are built for (layers/build.py "
                                                    "PYTHON_VERSION); both move together."))

    def add_environment(self, key: str, value: str) -> None:
        self.function.add_environment(key, value)


class Functions(Construct):
    """All functions of the tree, by name."""

    def __init__(self, scope: Construct, cid: str, *, stage: StageConfig, vpc: ec2.IVpc, layer_mode: str,
                 environment: dict[str, str]) -> None:
        super().__init__(scope, cid)
        names = discover()
        missing = [n for n in names if n not in PROFILES]
        if missing:
            raise SystemExit(f"functions/{missing[0]}/handler.py has no profile: add it to PROFILES in "
                             "infra_cdk/functions.py (what it uses: database, redis, queues, buckets)")
        removal = RemovalPolicy.RETAIN if stage.retain else RemovalPolicy.DESTROY
        self.layer = lambda_.LayerVersion(
            self, "SharedLayer", code=layer_code(layer_mode),
            compatible_runtimes=[RUNTIME], compatible_architectures=[ARCHITECTURE],
            description="aivedio core (shared/aivedio) and its runtime dependencies but PyAV",
            removal_policy=removal,
        )
        self.media_layer = lambda_.LayerVersion(
            self, "MediaLayer", code=layer_code(layer_mode, "media"),
            compatible_runtimes=[RUNTIME], compatible_architectures=[ARCHITECTURE],
            description="PyAV and its FFmpeg, for the functions that open media (parses_media)",
            removal_policy=removal,
        )
        code = functions_code()
        self.by_name: dict[str, AppFunction] = {
            n: AppFunction(self, n, stage=stage, profile=PROFILES[n], code=code, vpc=vpc, environment=environment,
                           layers=[self.layer, *([self.media_layer] if PROFILES[n].parses_media else [])])
            for n in names
        }

    def __getitem__(self, name: str) -> AppFunction:
        return self.by_name[name]

    def connect_workflow(self, state_machine: sfn.IStateMachine | None) -> None:
        """Each function whose profile says `starts_workflow`: states:StartExecution on the attempt
        state machine only (no Describe, no Stop, no other state machine), and its ARN in
        AIVEDIO_ATTEMPT_STATE_MACHINE_ARN (aivedio.attempts.executions starts executions there)."""
        starters = [fn for fn in self if fn.profile.starts_workflow]
        if starters and state_machine is None:
            raise SystemExit(f"{starters[0].name} starts the attempt workflow, but no state machine was built "
                             "(infra_cdk/workflows.py)")
        for fn in starters:
            state_machine.grant_start_execution(fn.role)
            fn.add_environment(STATE_MACHINE_ENV, state_machine.state_machine_arn)

    def __iter__(self):
        return iter(self.by_name.values())

