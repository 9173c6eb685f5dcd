"""Two stacks per stage:

- `AiVedio-<stage>-Data`: what holds state and changes rarely: the network, Aurora + RDS Proxy,
  Redis, the buckets. Deployed first, retained in prod.
- `AiVedio-<stage>-App`: what can be replaced at will: the layer and functions, the schema
  migration, queues and schedules, the tenant and admin APIs, workflows, Batch, dashboard and alarms.

The app stack reads the data stack's values through CloudFormation exports (CDK wires them).
Security-group rules between the two are created from the app side (`allow_to`), so the data
stack never depends on the app stack."""
from __future__ import annotations

from aws_cdk import Annotations, Stack, Tags
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from cdk_nag import RegexAppliesTo
from constructs import Construct

from aivedio.attempts.workflow import STEP_FUNCTION_PLACEHOLDER, definition_json
from infra_cdk.admin_api import AdminApi
from infra_cdk.api import Api
from infra_cdk.data import PROXY_PORT, Buckets, Database, Redis, SchemaMigration
from infra_cdk.functions import AppFunction, Functions
from infra_cdk.media import Media, list_statement
from infra_cdk.messaging import Messaging
from infra_cdk.network import Network
from infra_cdk.nag import suppress
from infra_cdk.observability import Observability
from infra_cdk.platform_config import PlatformConfigParameter, ProviderCredentials
from infra_cdk.stages import StageConfig
from infra_cdk.workflows import Workflows


# Tags CloudFormation rejects on these types (CDK's tag aspect would still add them).
UNTAGGABLE = ["AWS::RDS::DBProxyTargetGroup"]


def tag(scope: Construct, key: str, value: str) -> None:
    Tags.of(scope).add(key, value, exclude_resource_types=UNTAGGABLE)


def grant_media(fn: AppFunction, bucket: s3.IBucket) -> None:
    """Object reads and writes under the profile's key prefixes only (no List, no bucket-wide)."""
    p = fn.profile
    reads = [bucket.arn_for_objects(f"{prefix}*") for prefix in p.media_read_prefixes]
    writes = [bucket.arn_for_objects(f"{prefix}*") for prefix in p.media_write_prefixes]
    if reads:
        fn.role.add_to_policy(iam.PolicyStatement(actions=["s3:GetObject"], resources=reads))
    if writes:
        fn.role.add_to_policy(iam.PolicyStatement(actions=["s3:PutObject", "s3:PutObjectTagging"], resources=writes))
    for prefix in p.media_list_prefixes:
        fn.role.add_to_policy(list_statement(bucket, prefix))
    if reads or writes:
        fn.add_environment("AIVEDIO_MEDIA_BUCKET", bucket.bucket_name)
        suppress(fn.role, ("AwsSolutions-IAM5", f"{fn.name} reaches media objects under its key prefixes only "
                                                f"({', '.join(p.media_read_prefixes + p.media_write_prefixes)}); object "
                                                "keys below a prefix are not known in advance.",
                           [RegexAppliesTo(regex=r"/^Resource::<.*Media.*\.Arn>\/.*\*$/g")]), children=True)


def grant_invoice_archive(fn: AppFunction, bucket: s3.IBucket) -> None:
    """The invoice reconciler archives each raw invoice under a content-addressed key, written once
    (a conditional put, under Object Lock) and read back to compare: Put and Get on objects, no List,
    no Delete."""
    if not fn.profile.archives_invoices:
        return
    fn.role.add_to_policy(iam.PolicyStatement(actions=["s3:PutObject", "s3:GetObject"],
                                              resources=[bucket.arn_for_objects("*")]))
    fn.add_environment("AIVEDIO_INVOICE_BUCKET", bucket.bucket_name)
    suppress(fn.role, ("AwsSolutions-IAM5", f"{fn.name} archives invoices under content-addressed keys "
                                            "(<provider>/<date>/<sha256>.json) not known in advance; no List or Delete.",
                       [RegexAppliesTo(regex=r"/^Resource::<.*Invoice.*\.Arn>\/\*$/g")]), children=True)


class DataStack(Stack):
    def __init__(self, scope: Construct, cid: str, *, stage: StageConfig, **kwargs) -> None:
        super().__init__(scope, cid, description=f"AiVedio {stage.name}: network and state", **kwargs)
        tag(self, "aivedio:stage", stage.name)
        self.network = Network(self, "Network", stage=stage)
        self.database = Database(self, "Database", stage=stage, vpc=self.network.vpc)
        self.redis = Redis(self, "Redis", stage=stage, vpc=self.network.vpc)
        self.buckets = Buckets(self, "Buckets", stage=stage)
        self.provider_credentials = ProviderCredentials(self, "ProviderCredentials", stage=stage)


class AppStack(Stack):
    def __init__(self, scope: Construct, cid: str, *, stage: StageConfig, data: DataStack, layer_mode: str,
                 render_image: str | None, **kwargs) -> None:
        super().__init__(scope, cid, description=f"AiVedio {stage.name}: functions, API, messaging, workflows, media", **kwargs)
        tag(self, "aivedio:stage", stage.name)
        self.add_stack_dependency(data) if hasattr(self, "add_stack_dependency") else self.add_dependency(data)
        vpc = data.network.vpc
        self.platform_config = PlatformConfigParameter(self, "PlatformConfig", stage=stage)
        self.functions = Functions(self, "Functions", stage=stage, vpc=vpc, layer_mode=layer_mode, environment={
            "AIVEDIO_CONFIG_PARAMETER": self.platform_config.parameter.parameter_name})
        credentials = data.provider_credentials.secret
        for fn in self.functions:
            p = fn.profile
            self.platform_config.parameter.grant_read(fn.role)
            if p.provider_credentials:
                credentials.grant_read(fn.role)
                fn.add_environment("AIVEDIO_PROVIDER_SECRET_ARN", credentials.secret_arn)
            # allow_to below also asks for egress rules, which an allow-all-outbound group does not need.
            Annotations.of(fn.sg).acknowledge_warning("@aws-cdk/aws-ec2:ipv4IgnoreEgressRule",
                                                      "functions' security groups allow all outbound traffic")
            if p.database:
                data.database.grant_connect(fn.role)
                fn.add_environment("AIVEDIO_DATABASE_URL", data.database.url())
                fn.add_environment("AIVEDIO_DATABASE_IAM_AUTH", "1")
                fn.function.connections.allow_to(data.database.proxy_connections, ec2.Port.tcp(PROXY_PORT),
                                                 f"{fn.name} to the RDS Proxy")
            if p.redis:
                data.redis.secret.grant_read(fn.role)
                fn.add_environment("AIVEDIO_REDIS_URL", data.redis.url())
                fn.add_environment("AIVEDIO_REDIS_SECRET_ARN", data.redis.secret.secret_arn)
                fn.function.connections.allow_to(data.redis.connections, data.redis.connections.default_port,
                                                 f"{fn.name} to Redis")
            else:
                fn.add_environment("AIVEDIO_REDIS_URL", "none")  # conservative mode: no Redis reachable
            grant_media(fn, data.buckets.media)
            grant_invoice_archive(fn, data.buckets.invoices)

        migrators = [fn for fn in self.functions if fn.profile.migrates]
        if migrators:
            migration = SchemaMigration(self, "SchemaMigration", migrate_fn=migrators[0].function,
                                        log_retention=stage.log_retention, removal_policy=stage.removal_policy)
            for fn in self.functions:
                if not fn.profile.migrates:
                    fn.function.node.add_dependency(migration.resource)  # new code runs on the new schema

        self.messaging = Messaging(self, "Messaging", stage=stage, functions=self.functions)
        apis = [fn for fn in self.functions if fn.profile.api]
        self.api = Api(self, "Api", stage=stage, fn=apis[0]) if apis else None
        admins = [fn for fn in self.functions if fn.profile.admin_api]
        if admins and self.api is None:
            raise SystemExit(f"{admins[0].name} serves the admin API, which shares the tenant API's WAF: no function serves the API")
        self.admin_api = AdminApi(self, "AdminApi", stage=stage, fn=admins[0], web_acl=self.api.web_acl,
                                  cloud_watch_account=self.api.api.node.try_find_child("Account")) if admins else None
        for fn in self.functions:
            if fn.profile.submits_jobs:  # providers send webhooks to the API's callback route
                if self.api is None:
                    raise SystemExit(f"{fn.name} submits jobs with a callback URL, but no function serves the API")
                fn.add_environment("AIVEDIO_API_BASE_URL", self.api.api.url)
        # The attempt workflow, from the one definition the local runner also executes; its Tasks
        # invoke attempt_step. Same stack as the functions, so no cross-stack reference cycle.
        self.workflows = Workflows(self, "Workflows", stage=stage, functions=self.functions,
                                   definition=definition_json(),
                                   substitutions={STEP_FUNCTION_PLACEHOLDER: "attempt_step"})
        self.functions.connect_workflow(self.workflows.state_machine)
        self.media = Media(self, "Media", stage=stage, vpc=vpc, media_bucket=data.buckets.media, render_image=render_image)
        self.media.connect(self.functions, self.messaging.queues)
        self.observability = Observability(self, "Observability", stage=stage, functions=self.functions,
                                           queues=self.messaging.queues, dlqs=self.messaging.dlqs,
                                           state_machine=self.workflows.state_machine)
