"""State: Aurora PostgreSQL Serverless v2 behind RDS Proxy, ElastiCache Redis (TLS + RBAC user),
the media bucket (lifecycle per retention class) and the invoice archive (versioning + Object
Lock), plus the schema migration that runs on every deploy whose migrations changed.

Credentials: the database secret (Secrets Manager, rotated every 30 days) is read only by the
proxy; functions authenticate to the proxy with IAM (`rds-db:connect`), so no function holds a
database password. The Redis user's password is a Secrets Manager secret the functions that use
Redis may read (aivedio.cloud_credentials)."""
from __future__ import annotations

import json

from aws_cdk import CustomResource, Duration, RemovalPolicy, Tags
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_elasticache as elasticache
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_rds as rds
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_secretsmanager as secretsmanager
from aws_cdk import custom_resources as cr
from cdk_nag import RegexAppliesTo
from constructs import Construct

from aivedio.db.migrate import schema_fingerprint
from aivedio.media.retention import RETENTION_CLASSES, TAG
from aivedio.spend.media_costs import BUCKET_SCOPE, COST_SCOPE_TAG
from infra_cdk.nag import suppress
from infra_cdk.network import ISOLATED
from infra_cdk.stages import StageConfig

DB_NAME = "aivedio"
DB_USER = "aivedio_admin"
DB_PORT = 5433  # the cluster's port; clients talk to the proxy, which always listens on 5432
PROXY_PORT = 5432
REDIS_PORT = 6379
REDIS_USER = "aivedio"
REDIS_KEY_PREFIX = "av"  # Settings.redis_prefix; the Redis user may touch only these keys


class Database(Construct):
    def __init__(self, scope: Construct, cid: str, *, stage: StageConfig, vpc: ec2.IVpc) -> None:
        super().__init__(scope, cid)
        cluster_id = f"{stage.prefix}-aurora"
        # Created here, not by RDS, so it has a retention period (RDS would create it without one).
        postgres_log = logs.LogGroup(self, "PostgresLog", log_group_name=f"/aws/rds/cluster/{cluster_id}/postgresql",
                                     retention=stage.log_retention, removal_policy=stage.removal_policy)
        self.sg = ec2.SecurityGroup(self, "ClusterSg", vpc=vpc, allow_all_outbound=False,
                                    description="Aurora: PostgreSQL from the RDS Proxy and the rotation function")
        self.cluster = rds.DatabaseCluster(
            self, "Cluster",
            cluster_identifier=cluster_id,
            engine=rds.DatabaseClusterEngine.aurora_postgres(version=rds.AuroraPostgresEngineVersion.VER_16_13),
            credentials=rds.Credentials.from_generated_secret(DB_USER, secret_name=f"{stage.prefix}/aurora"),
            default_database_name=DB_NAME,
            port=DB_PORT,
            writer=rds.ClusterInstance.serverless_v2("writer"),
            readers=[rds.ClusterInstance.serverless_v2(f"reader{i + 1}", scale_with_writer=True)
                     for i in range(stage.aurora_readers)],
            serverless_v2_min_capacity=stage.aurora_min_acu,
            serverless_v2_max_capacity=stage.aurora_max_acu,
            vpc=vpc, vpc_subnets=ISOLATED, security_groups=[self.sg],
            storage_encrypted=True,
            iam_authentication=True,
            deletion_protection=stage.deletion_protection,
            removal_policy=RemovalPolicy.SNAPSHOT if stage.retain else RemovalPolicy.DESTROY,
            backup=rds.BackupProps(retention=Duration.days(stage.backup_days)),
            cloudwatch_logs_exports=["postgresql"],
            copy_tags_to_snapshot=True,
        )
        self.cluster.node.add_dependency(postgres_log)  # else RDS may create the group first, without retention
        assert self.cluster.secret is not None
        self.secret = self.cluster.secret
        self.cluster.add_rotation_single_user(automatically_after=Duration.days(30))

        self.proxy_sg = ec2.SecurityGroup(self, "ProxySg", vpc=vpc, allow_all_outbound=False,
                                          description="RDS Proxy: PostgreSQL from the functions that use the database")
        self.proxy = self.cluster.add_proxy(
            "Proxy",
            db_proxy_name=f"{stage.prefix}-proxy",
            secrets=[self.secret],
            vpc=vpc, vpc_subnets=ISOLATED, security_groups=[self.proxy_sg],
            iam_auth=True,
            require_tls=True,
            borrow_timeout=Duration.seconds(30),
            max_connections_percent=90,
        )
        self.proxy_sg.add_egress_rule(self.sg, ec2.Port.tcp(DB_PORT), "proxy to Aurora")
        self.sg.add_ingress_rule(self.proxy_sg, ec2.Port.tcp(DB_PORT), "Aurora from the proxy")
        self.proxy_connections = ec2.Connections(security_groups=[self.proxy_sg],
                                                 default_port=ec2.Port.tcp(PROXY_PORT))

        if not stage.deletion_protection:
            suppress(self.cluster, ("AwsSolutions-RDS10", "dev only: deletion protection is off so a dev stack can be "
                                                          "torn down; prod sets deletion_protection=True."))

    def url(self) -> str:
        """AIVEDIO_DATABASE_URL of the functions: the proxy, the user, no password (IAM)."""
        return f"postgresql://{DB_USER}@{self.proxy.endpoint}:{PROXY_PORT}/{DB_NAME}?sslmode=require"

    def grant_connect(self, grantee: iam.IGrantable) -> None:
        self.proxy.grant_connect(grantee, DB_USER)


class Redis(Construct):
    """ElastiCache for Redis OSS 7 with TLS and an RBAC user whose password lives in Secrets
    Manager: ElastiCache Serverless for dev, a Multi-AZ replication group for prod.

    Note for the cache module: ElastiCache Serverless runs in cluster mode, so a Lua script or a
    transaction whose keys hash to different slots fails with CROSSSLOT there; keys one script
    touches must share a hash tag (e.g. `av:{ring:LANE}:list`). The replication group runs with
    cluster mode disabled."""

    def __init__(self, scope: Construct, cid: str, *, stage: StageConfig, vpc: ec2.IVpc) -> None:
        super().__init__(scope, cid)
        self.sg = ec2.SecurityGroup(self, "Sg", vpc=vpc, allow_all_outbound=False,
                                    description="Redis: TLS from the functions that use it")
        self.connections = ec2.Connections(security_groups=[self.sg], default_port=ec2.Port.tcp_range(REDIS_PORT, REDIS_PORT + 1))
        self.secret = secretsmanager.Secret(
            self, "UserSecret",
            secret_name=f"{stage.prefix}/redis",
            description="ElastiCache RBAC user of the platform (username, password)",
            generate_secret_string=secretsmanager.SecretStringGenerator(
                secret_string_template=json.dumps({"username": REDIS_USER}),
                generate_string_key="password", exclude_punctuation=True, password_length=40),
            removal_policy=stage.removal_policy,
        )
        suppress(self.secret, ("AwsSolutions-SMG4", "ElastiCache RBAC passwords have no managed rotation function; the "
                                                    "secret is rotated by redeploying with a new generated value, and only "
                                                    "functions that use Redis may read it."))
        engine = "redis"
        default_user = elasticache.CfnUser(
            self, "DefaultUser", engine=engine, user_id=f"{stage.prefix}-default", user_name="default",
            access_string="off -@all", authentication_mode={"Type": "no-password-required"})
        app_user = elasticache.CfnUser(
            self, "AppUser", engine=engine, user_id=f"{stage.prefix}-app", user_name=REDIS_USER,
            access_string=f"on ~{REDIS_KEY_PREFIX}:* &* +@all -@dangerous",
            authentication_mode={"Type": "password",
                                 "Passwords": [self.secret.secret_value_from_json("password").unsafe_unwrap()]})
        group = elasticache.CfnUserGroup(self, "Users", engine=engine, user_group_id=f"{stage.prefix}-users",
                                         user_ids=[default_user.user_id, app_user.user_id])
        group.add_resource_dependency(default_user)
        group.add_resource_dependency(app_user)
        subnet_ids = vpc.select_subnets(subnet_type=ec2.SubnetType.PRIVATE_ISOLATED).subnet_ids

        if stage.redis_mode == "serverless":
            cache = elasticache.CfnServerlessCache(
                self, "Cache", engine=engine, serverless_cache_name=f"{stage.prefix}-redis", major_engine_version="7",
                security_group_ids=[self.sg.security_group_id], subnet_ids=subnet_ids, user_group_id=group.user_group_id,
                cache_usage_limits=elasticache.CfnServerlessCache.CacheUsageLimitsProperty(
                    data_storage=elasticache.CfnServerlessCache.DataStorageProperty(unit="GB", maximum=stage.redis_max_data_gb),
                    ecpu_per_second=elasticache.CfnServerlessCache.ECPUPerSecondProperty(maximum=stage.redis_max_ecpu_per_second)),
                snapshot_retention_limit=stage.redis_snapshot_days or None,
            )
            cache.add_resource_dependency(group)
            self.host, self.port = cache.attr_endpoint_address, cache.attr_endpoint_port
        elif stage.redis_mode == "replication-group":
            subnets = elasticache.CfnSubnetGroup(self, "Subnets", description=f"{stage.prefix} Redis",
                                                 subnet_ids=subnet_ids, cache_subnet_group_name=f"{stage.prefix}-redis")
            cache = elasticache.CfnReplicationGroup(
                self, "Cache", replication_group_id=f"{stage.prefix}-redis",
                replication_group_description=f"{stage.prefix} Redis (cluster mode disabled, Multi-AZ)",
                engine=engine, engine_version="7.1", cache_node_type=stage.redis_node_type,
                num_node_groups=1, replicas_per_node_group=stage.redis_replicas,
                automatic_failover_enabled=True, multi_az_enabled=True,
                transit_encryption_enabled=True, transit_encryption_mode="required", at_rest_encryption_enabled=True,
                user_group_ids=[group.user_group_id], cache_subnet_group_name=subnets.cache_subnet_group_name,
                security_group_ids=[self.sg.security_group_id], port=REDIS_PORT,
                snapshot_retention_limit=stage.redis_snapshot_days, auto_minor_version_upgrade=True,
            )
            cache.add_resource_dependency(subnets)
            cache.add_resource_dependency(group)
            self.host, self.port = cache.attr_primary_end_point_address, cache.attr_primary_end_point_port
            suppress(cache,
                     ("AwsSolutions-AEC5", "The port is the default 6379; the group is reachable only from the "
                                           "functions' security groups in isolated subnets, and every client needs TLS "
                                           "and an RBAC password, so a different port adds nothing."),
                     ("AwsSolutions-AEC6", "Authentication is RBAC (a user group whose user password is in Secrets "
                                           "Manager), which replaces the single AUTH token this rule looks for."))
        else:
            raise ValueError(f"redis_mode {stage.redis_mode!r}")

    def url(self) -> str:
        """AIVEDIO_REDIS_URL without credentials; AIVEDIO_REDIS_SECRET_ARN supplies them."""
        return f"rediss://{self.host}:{self.port}/0"


class Buckets(Construct):
    def __init__(self, scope: Construct, cid: str, *, stage: StageConfig) -> None:
        super().__init__(scope, cid)
        dev = not stage.retain
        self.access_logs = s3.Bucket(
            self, "AccessLogs", encryption=s3.BucketEncryption.S3_MANAGED, enforce_ssl=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL, object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            lifecycle_rules=[s3.LifecycleRule(id="expire", expiration=Duration.days(stage.access_log_days))],
            removal_policy=stage.removal_policy, auto_delete_objects=dev,
        )

        rules = [s3.LifecycleRule(id="abort-incomplete-uploads", abort_incomplete_multipart_upload_after=Duration.days(1))]
        for rc in RETENTION_CLASSES:
            transitions = []
            if rc.infrequent_access_after_days:
                transitions.append(s3.Transition(storage_class=s3.StorageClass.INFREQUENT_ACCESS,
                                                 transition_after=Duration.days(rc.infrequent_access_after_days)))
            if rc.glacier_ir_after_days:
                transitions.append(s3.Transition(storage_class=s3.StorageClass.GLACIER_INSTANT_RETRIEVAL,
                                                 transition_after=Duration.days(rc.glacier_ir_after_days)))
            rules.append(s3.LifecycleRule(
                id=f"retention-{rc.name}", tag_filters={TAG: rc.name},
                expiration=Duration.days(rc.expire_after_days) if rc.expire_after_days else None,
                transitions=transitions or None))
        self.media = s3.Bucket(
            self, "Media", encryption=s3.BucketEncryption.S3_MANAGED, enforce_ssl=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL, object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            lifecycle_rules=rules, server_access_logs_bucket=self.access_logs, server_access_logs_prefix="media/",
            removal_policy=stage.removal_policy, auto_delete_objects=dev,
        )
        # Cost allocation reads a bucket's tags, never an object's: the Cost and Usage Report's lines
        # of this bucket's storage carry this tag (activated as a cost allocation tag), and
        # aivedio.spend.media_costs keeps them for the monthly check of aivedio.media.storage_cost.
        Tags.of(self.media).add(COST_SCOPE_TAG, BUCKET_SCOPE)

        lock = (s3.ObjectLockRetention.compliance if stage.invoice_lock_mode == "COMPLIANCE"
                else s3.ObjectLockRetention.governance)(Duration.days(stage.invoice_lock_days))
        # Always retained: locked object versions cannot be deleted before their retention ends,
        # so CloudFormation could not empty the bucket anyway.
        self.invoices = s3.Bucket(
            self, "InvoiceArchive", encryption=s3.BucketEncryption.S3_MANAGED, enforce_ssl=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL, object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            versioned=True, object_lock_enabled=True, object_lock_default_retention=lock,
            lifecycle_rules=[s3.LifecycleRule(id="tier", transitions=[s3.Transition(
                storage_class=s3.StorageClass.GLACIER_INSTANT_RETRIEVAL, transition_after=Duration.days(90))])],
            server_access_logs_bucket=self.access_logs, server_access_logs_prefix="invoices/",
            removal_policy=RemovalPolicy.RETAIN,
        )


class SchemaMigration(Construct):
    """Invokes the db_migrate function on deploy through the custom-resource provider framework.
    Its `SchemaFingerprint` property is the migrations' checksum, so an Update (and a migration
    run) happens exactly when a migration file is added or changed."""

    def __init__(self, scope: Construct, cid: str, *, migrate_fn: lambda_.IFunction, log_retention: logs.RetentionDays,
                 removal_policy: RemovalPolicy) -> None:
        super().__init__(scope, cid)
        provider_logs = logs.LogGroup(self, "ProviderLogs", retention=log_retention, removal_policy=removal_policy)
        self.provider = cr.Provider(self, "Provider", on_event_handler=migrate_fn, log_group=provider_logs,
                                    provider_function_name=None)
        self.resource = CustomResource(self, "Resource", service_token=self.provider.service_token,
                                       resource_type="Custom::AiVedioSchemaMigration",
                                       properties={"SchemaFingerprint": schema_fingerprint()})
        suppress(self.provider, ("AwsSolutions-IAM4", "The provider framework's function (CDK-owned) uses the AWS "
                                                      "managed AWSLambdaBasicExecutionRole for its own logs only.",
                                 ["Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole"]),
                 ("AwsSolutions-IAM5", "The provider framework may invoke any version of the one migration function "
                                       "(<arn>:*); that wildcard is CDK's and names a single function.",
                  [RegexAppliesTo(regex=r"/^Resource::<.*dbmigrate.*\.Arn>:\*$/g")]),
                 children=True)
