"""Per-stage sizes, retention and removal policies: `-c stage=dev|prod` picks one (`dev,prod`
synthesizes both, which CI and the infra tests do)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from aws_cdk import RemovalPolicy
from aws_cdk import aws_logs as logs

ROOT = Path(__file__).resolve().parents[1]  # the repository
UNRESERVED_MINIMUM = 100  # concurrency Lambda never lets an account reserve


@dataclass(frozen=True)
class StageConfig:
    name: str
    # network
    max_azs: int
    nat_gateways: int
    flow_log_all_traffic: bool
    # Aurora PostgreSQL Serverless v2
    aurora_min_acu: float
    aurora_max_acu: float
    aurora_readers: int
    backup_days: int
    deletion_protection: bool
    # Redis: "serverless" (ElastiCache Serverless) or "replication-group"
    redis_mode: str
    redis_node_type: str
    redis_replicas: int
    redis_snapshot_days: int
    redis_max_data_gb: int
    redis_max_ecpu_per_second: int
    # storage and logs
    removal_policy: RemovalPolicy
    log_retention: logs.RetentionDays
    access_log_days: int
    invoice_lock_mode: str  # "GOVERNANCE" (removable by a privileged user) or "COMPLIANCE"
    invoice_lock_days: int
    queue_retention_days: int
    unrouted_retention_days: int
    # API
    api_rate_limit: int  # requests per second, stage-wide
    api_burst_limit: int
    api_quota_per_day: int
    waf_rate_limit_per_ip: int  # requests per 5 minutes per client IP
    # the admin API's own stage (infra_cdk/admin_api.py): a few operators and their dashboards
    admin_api_rate_limit: int = 20
    # alarms: provider cost not yet matched to an invoice line above this pages (the UnreconciledCost gauge)
    unreconciled_cost_alarm_usd: int = 100
    admin_api_burst_limit: int = 40
    # functions: reserved concurrency. `api` is capped so a flood of requests cannot take the
    # concurrency the admitted work needs: attempt_step and settlement have their own reservation,
    # and everything unreserved (the reconcilers, consumers) shares what is left of the account's
    # quota, of which Lambda always keeps UNRESERVED_MINIMUM unreserved. `admin_api` has its own so
    # operators can act while tenants flood the account's unreserved pool.
    reserved_concurrency: dict[str, int] = field(default_factory=dict)
    account_concurrency: int = 1000  # the account's Lambda concurrency quota in the region (default quota)
    consumer_max_concurrency: int = 5  # SQS event source scaling cap per consumer
    # media: Batch max vCPUs per media resource class (infra_cdk/media.py MEDIA_CLASSES)
    batch_max_vcpus: dict[str, int] = field(default_factory=dict)
    batch_spot: bool = False

    def __post_init__(self) -> None:
        reserved = sum(self.reserved_concurrency.values())
        if reserved + UNRESERVED_MINIMUM > self.account_concurrency:
            raise ValueError(f"stage {self.name}: {reserved} reserved concurrency leaves less than Lambda's "
                             f"{UNRESERVED_MINIMUM} unreserved of the account's {self.account_concurrency}")

    @property
    def prefix(self) -> str:
        return f"aivedio-{self.name}"

    @property
    def retain(self) -> bool:
        return self.removal_policy == RemovalPolicy.RETAIN


STAGES: dict[str, StageConfig] = {
    "dev": StageConfig(
        name="dev", max_azs=2, nat_gateways=1, flow_log_all_traffic=False,
        aurora_min_acu=0.5, aurora_max_acu=4, aurora_readers=0, backup_days=1, deletion_protection=False,
        redis_mode="serverless", redis_node_type="", redis_replicas=0, redis_snapshot_days=0,
        redis_max_data_gb=1, redis_max_ecpu_per_second=5000,
        removal_policy=RemovalPolicy.DESTROY, log_retention=logs.RetentionDays.TWO_WEEKS, access_log_days=30,
        invoice_lock_mode="GOVERNANCE", invoice_lock_days=1, queue_retention_days=4, unrouted_retention_days=1,
        api_rate_limit=50, api_burst_limit=100, api_quota_per_day=200_000, waf_rate_limit_per_ip=2000,
        reserved_concurrency={"api": 20, "attempt_step": 20, "settlement": 5, "scheduler_tick": 2,
                              "scheduler_maintenance": 1, "outbox_relay": 2, "db_migrate": 1, "admin_api": 3},
        consumer_max_concurrency=2,
        batch_max_vcpus={"cpu-proxy": 32, "gpu-render": 16, "gpu-highmem": 16}, batch_spot=True,
    ),
    "prod": StageConfig(
        name="prod", max_azs=3, nat_gateways=2, flow_log_all_traffic=True,
        aurora_min_acu=2, aurora_max_acu=64, aurora_readers=1, backup_days=14, deletion_protection=True,
        redis_mode="replication-group", redis_node_type="cache.r7g.large", redis_replicas=2, redis_snapshot_days=7,
        redis_max_data_gb=0, redis_max_ecpu_per_second=0,
        removal_policy=RemovalPolicy.RETAIN, log_retention=logs.RetentionDays.ONE_YEAR, access_log_days=365,
        invoice_lock_mode="COMPLIANCE", invoice_lock_days=3653, queue_retention_days=14, unrouted_retention_days=4,
        api_rate_limit=500, api_burst_limit=1000, api_quota_per_day=20_000_000, waf_rate_limit_per_ip=20_000,
        reserved_concurrency={"api": 300, "attempt_step": 400, "settlement": 50, "scheduler_tick": 4,
                              "scheduler_maintenance": 1, "outbox_relay": 2, "db_migrate": 1, "admin_api": 10},
        consumer_max_concurrency=10,
        batch_max_vcpus={"cpu-proxy": 512, "gpu-render": 256, "gpu-highmem": 128}, batch_spot=False,
    ),
}


def stage_names(value: str | None) -> list[str]:
    names = [n.strip() for n in (value or "dev").split(",") if n.strip()]
    unknown = [n for n in names if n not in STAGES]
    if unknown or not names:
        raise ValueError(f"-c stage={value!r}: stages are {', '.join(STAGES)} (comma-separated for several)")
    return names
