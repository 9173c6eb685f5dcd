"""Settings: the environment and the TOML config file of docs/configuration.md.

No other module reads os.environ. Everything the platform needs at start is validated here, so a
bad file or URL fails at once with one line naming the key, and nothing starts half-configured.
"""
from __future__ import annotations

import base64
import ipaddress
import json
import os
import re
import secrets
import time
import tomllib
from datetime import datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from aivedio.reconcile.room import SERVICES

LANES = ("ENTERPRISE_RESERVED", "PAID_SHARED", "STANDARD", "BEST_EFFORT", "EXPENSIVE", "RECOVERY")
SERVICE_CLASSES = ("ENTERPRISE_RESERVED", "PAID_SHARED", "STANDARD", "BEST_EFFORT")
RESOLUTIONS = ("480p", "720p", "1080p", "4k")
MODES = ("text_to_video", "image_to_video", "video_to_video", "extend")


class ConfigError(Exception):
    """A configuration problem, worded as one line that names the key or URL."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _credentials_absent(info: ValidationInfo) -> bool:
    """True when the config is loaded without provider credentials on purpose: a deployed function
    that never talks to a provider is not granted the provider secret (aivedio.cloud_config)."""
    return bool(info.context and info.context.get("provider_credentials") == "absent")


def random_webhook_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


class ProviderAccount(_Strict):
    account_id: str = Field(min_length=1)  # names the account in pool keys, invoice lines and the provider secret's accounts map
    # No default: an external provider's key comes from the config file locally and from Secrets
    # Manager in AWS; a built-in simulator's accounts get random keys (ProviderConfig).
    api_key: str | None = Field(default=None, min_length=1)
    region: str = "us"  # where the account runs jobs: part of its provider pool keys and a spend-budget scope (REGION)
    # Jobs the account may have queued or running at the provider at once (its slot pools).
    max_concurrency: int = Field(default=200, gt=0)


class SimulatorBehaviour(_Strict):
    """How a built-in provider simulator misbehaves (aivedio_tools.provider_sim). Rates are
    probabilities in [0, 1]; durations are platform seconds, which the simulator divides by
    time_scale. Every draw comes from `seed`, keyed by the idempotency key or job it concerns, so a
    run is reproducible whatever order concurrent requests arrive in."""

    seed: int = 7  # the seed of every random draw
    # A job waits queue_seconds in "queued", then runs latency_seconds in "running" (uniform draws).
    queue_seconds_min: float = Field(default=0.0, ge=0)
    queue_seconds_max: float = Field(default=1.0, ge=0)  # upper bound of a job's queued wait
    latency_seconds_min: float = Field(default=20.0, ge=0)  # lower bound of a job's running time
    latency_seconds_max: float = Field(default=60.0, ge=0)  # upper bound of a job's running time
    failure_rate: float = Field(default=0.02, ge=0, le=1)  # chance a job fails instead of succeeding
    failed_but_charged_rate: float = Field(default=0.0, ge=0, le=1)  # of the failed jobs, how many are charged
    credit_note_rate: float = Field(default=0.0, ge=0, le=1)  # of the failed-but-charged, how many are credited back
    # Submit misbehaviour, drawn for requests that create a job (a replay of a known key answers at once).
    accept_then_timeout_rate: float = Field(default=0.0, ge=0, le=1)  # job created, then no timely answer
    accept_then_timeout_mode: Literal["mixed", "delay", "drop"] = "mixed"  # delay past the timeout / reset
    accept_then_timeout_hold_seconds: float | None = Field(default=None, gt=0)  # real s; None: 1.5 x submit timeout
    server_error_rate: float = Field(default=0.0, ge=0, le=1)  # a 5xx; half of them after creating the job
    burst_429_rate: float = Field(default=0.0, ge=0, le=1)  # chance that a submit starts a 429 burst on its account
    burst_429_seconds: float = Field(default=5.0, ge=0)  # how long a burst lasts
    retry_after_seconds: int = Field(default=1, ge=0)  # Retry-After when an account is at max_concurrency
    # Webhooks: dropped, duplicated (same webhook-id), each copy delayed uniformly (so reordered).
    webhook_drop_rate: float = Field(default=0.0, ge=0, le=1)
    webhook_duplicate_rate: float = Field(default=0.0, ge=0, le=1)  # chance a webhook is sent twice
    webhook_delay_seconds_max: float = Field(default=0.0, ge=0)  # each webhook copy is delayed uniformly by up to this
    webhook_max_attempts: int = Field(default=5, gt=0)  # a copy the receiver refuses is retried with backoff
    # Invoices: a line may be listed twice (same line_id), or only on the next UTC day's invoice.
    invoice_duplicate_rate: float = Field(default=0.0, ge=0, le=1)
    invoice_late_rate: float = Field(default=0.0, ge=0, le=1)  # chance a line is billed on the next UTC day's invoice
    # Outputs: a succeeded job's MP4 matches its order (duration, resolution, audio) unless one of these
    # is drawn for the job (in this order, the first drawn wins); a prompt containing
    # "[sim:output=<kind>]" forces one for that job (kinds: truncated, empty, not_video,
    # wrong_duration, wrong_resolution, no_audio).
    output_truncated_rate: float = Field(default=0.0, ge=0, le=1)  # the MP4 cut in half
    output_empty_rate: float = Field(default=0.0, ge=0, le=1)  # zero bytes
    output_not_video_rate: float = Field(default=0.0, ge=0, le=1)  # an HTML page served as video/mp4
    output_wrong_duration_rate: float = Field(default=0.0, ge=0, le=1)  # half the ordered duration (or +3 s)
    output_wrong_resolution_rate: float = Field(default=0.0, ge=0, le=1)  # one resolution step off
    output_no_audio_rate: float = Field(default=0.0, ge=0, le=1)  # no audio track although audio was ordered
    # Charged for cancelling a running job (a queued one is free), a decimal string in `currency`.
    cancellation_fee: str = "0.0500"
    cost_per_second: str = "0.0500"  # charged per ordered second of a charged job, a decimal string in `currency`
    currency: str = "USD"  # ISO 4217 code of the simulator's usage amounts and invoice lines
    idempotency_window_seconds: int = Field(default=86400, gt=0)  # advertised at /v1/meta and honoured

    @field_validator("cancellation_fee", "cost_per_second")
    @classmethod
    def _amount(cls, v: str) -> str:
        try:
            d = Decimal(v)
        except InvalidOperation:
            raise ValueError(f"expected a decimal string, got {v!r}") from None
        if not d.is_finite() or d < 0:
            raise ValueError(f"expected a non-negative decimal string, got {v!r}")
        return v

    @model_validator(mode="after")
    def _ranges(self) -> "SimulatorBehaviour":
        if self.latency_seconds_max < self.latency_seconds_min:
            raise ValueError("latency_seconds_max must be >= latency_seconds_min")
        if self.queue_seconds_max < self.queue_seconds_min:
            raise ValueError("queue_seconds_max must be >= queue_seconds_min")
        return self


class ProviderConfig(_Strict):
    # The provider's name: in pool keys, spend budgets and attempts, and in its webhook path /v1/providers/<name>/callbacks.
    name: str = Field(min_length=1, pattern=r"^[a-z0-9][a-z0-9-]*$")
    base_url: str | None = None  # None: a built-in simulator is started for this provider
    # No default: required for an external provider; a built-in simulator gets a random one per
    # process (ProviderConfig._simulator_credentials), shared by the simulator and the receiver.
    webhook_secret: str | None = Field(default=None, validate_default=True)
    # Model codes it offers; only tasks for these are routed to it.
    models: list[str] = Field(default_factory=lambda: ["video-model-x"], min_length=1)
    # [[providers.accounts]]: the accounts jobs are submitted through, each with its own key and concurrency.
    accounts: list[ProviderAccount] = Field(default_factory=lambda: [ProviderAccount(account_id="account-01")], min_length=1,
                                            validate_default=True)
    submit_timeout_seconds: float = Field(default=10.0, gt=0)  # REAL seconds one request to the provider may take, end to end
    # The highest resolution it renders; higher orders are not routed to it.
    max_resolution: Literal["480p", "720p", "1080p", "4k"] = "4k"
    # The longest output it renders, in seconds of video; longer orders are not routed to it.
    max_duration_seconds: int = Field(default=60, gt=0)
    cost_per_second: str = "0.0500"  # expected provider cost, a decimal string in `currency`
    currency: str = "USD"  # ISO 4217 code of cost_per_second and its invoices; its spend is reserved against budgets in it
    # [providers.simulator]: how the built-in simulator misbehaves; used only without base_url.
    simulator: SimulatorBehaviour = Field(default_factory=SimulatorBehaviour)

    @model_validator(mode="before")
    @classmethod
    def _simulator_credentials(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("base_url") is not None:
            return data
        data = dict(data)
        if not data.get("webhook_secret"):
            data["webhook_secret"] = random_webhook_secret()
        accounts = data.get("accounts")
        if accounts is None:
            accounts = [{"account_id": "account-01"}]
        if isinstance(accounts, list):
            # A provider tells accounts apart by their key, so each simulated account gets its own.
            data["accounts"] = [
                {**a, "api_key": f"sim-{a.get('account_id', 'account')}-{secrets.token_urlsafe(12)}"}
                if isinstance(a, dict) and a.get("api_key") is None else
                a.model_copy(update={"api_key": f"sim-{a.account_id}-{secrets.token_urlsafe(12)}"})
                if isinstance(a, ProviderAccount) and a.api_key is None else a
                for a in accounts]
        return data

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v

    @field_validator("webhook_secret")
    @classmethod
    def _secret(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None and info.data.get("base_url") is not None and not _credentials_absent(info):
            raise ValueError("required for a provider with a base_url (in AWS: the provider secret in Secrets Manager)")
        return v

    @field_validator("accounts")
    @classmethod
    def _account_keys(cls, v: list[ProviderAccount], info: ValidationInfo) -> list[ProviderAccount]:
        if info.data.get("base_url") is not None and not _credentials_absent(info):
            for i, a in enumerate(v):
                if a.api_key is None:
                    raise ValueError(f"{i}.api_key: required for account {a.account_id!r} of a provider with a base_url "
                                     "(in AWS: the provider secret in Secrets Manager)")
        return v

    @property
    def has_credentials(self) -> bool:
        return self.webhook_secret is not None and all(a.api_key is not None for a in self.accounts)


class LaneConfig(_Strict):
    capacity_units: int = Field(ge=0)  # fairness units of the lane's tasks that may run at once (the lane:<lane> pool)
    # Units of this lane PAID_SHARED and STANDARD may borrow while it has nothing queued (only ENTERPRISE_RESERVED lends).
    borrowable_units: int = Field(default=0, ge=0)
    # Free units ENTERPRISE_RESERVED keeps back from lending; utilisation is measured against capacity minus these.
    min_headroom_units: int = Field(default=0, ge=0)
    # Queued fairness units above which admission answers REJECT_LANE_QUEUE_FULL.
    max_queue_units: int = Field(default=100_000, ge=0)
    admission_open: bool = True  # false: admission refuses the lane's new tasks (REJECT_RESOURCE_CLASS_DISABLED)
    # Platform seconds a task may wait QUEUED before the starvation detector promotes it to P1.
    max_wait_seconds: int = Field(default=1800, gt=0)


def _default_lanes() -> dict[str, LaneConfig]:
    return {
        "ENTERPRISE_RESERVED": LaneConfig(capacity_units=500, borrowable_units=200, min_headroom_units=50),
        "PAID_SHARED": LaneConfig(capacity_units=1200),
        "STANDARD": LaneConfig(capacity_units=600),
        "BEST_EFFORT": LaneConfig(capacity_units=200),
        "EXPENSIVE": LaneConfig(capacity_units=160, max_queue_units=4000),
        "RECOVERY": LaneConfig(capacity_units=100),
    }


class ModelPrice(_Strict):
    """Default price rules for one model, in credit units. Becomes price_book rules data."""

    base_amount: int = Field(default=20, ge=0)  # credits per task, before the multipliers
    per_second_amount: int = Field(default=10, ge=0)  # credits per ordered second of output, before the multipliers
    # Percent applied to base plus per-second credits, by resolution; the result is rounded up.
    resolution_multiplier_pct: dict[str, int] = Field(
        default_factory=lambda: {"480p": 60, "720p": 100, "1080p": 150, "4k": 400}
    )
    audio_surcharge_amount: int = Field(default=10, ge=0)  # credits added when audio is ordered, after the multipliers
    # Percent applied by generation mode, together with the resolution multiplier.
    mode_multiplier_pct: dict[str, int] = Field(
        default_factory=lambda: {"text_to_video": 100, "image_to_video": 100, "video_to_video": 150, "extend": 100}
    )
    # How a task quoted with it is charged on each outcome (aivedio.billing.policies; CODE or CODE@VERSION).
    charge_policy_code: str = "SUCCESS_ONLY"


class Timers(_Strict):
    """Durations in platform seconds; the clock divides them by time_scale."""

    scheduler_tick_seconds: float = Field(default=1.0, gt=0)  # between scheduler ticks (a wakeup runs one sooner)
    outbox_relay_seconds: float = Field(default=0.2, gt=0)  # how often the outbox relay looks for events while idle
    outbox_retry_base_seconds: float = Field(default=1.0, gt=0)  # doubles per failed delivery
    outbox_retry_max_seconds: float = Field(default=300.0, gt=0)  # cap on the doubled delivery retry delay
    # Not read at present: each maintenance service has its own interval ([maintenance.SERVICE]).
    reconciler_seconds: float = Field(default=30.0, gt=0)
    # An attempt's lease: unless renewed within this, attempt-recovery counts its execution lost.
    lease_seconds: float = Field(default=300.0, gt=0)
    # A QUEUED task moves up one priority band per step waited (never into P0).
    aging_step_seconds: float = Field(default=300.0, gt=0)
    # First status poll after a submit; also the base of a failing poll's backoff.
    poll_first_seconds: float = Field(default=10.0, gt=0)
    # Later polls come at a uniform draw between poll_min_seconds and poll_max_seconds.
    poll_min_seconds: float = Field(default=15.0, gt=0)
    poll_max_seconds: float = Field(default=30.0, gt=0)  # upper bound of later polls; they come closer near the task's deadline
    poll_error_backoff_max_seconds: float = Field(default=120.0, gt=0)  # a failing poll backs off to this
    unknown_first_check_seconds: float = Field(default=5.0, gt=0)  # SUBMIT_UNKNOWN: first lookup by key
    unknown_backoff_max_seconds: float = Field(default=60.0, gt=0)  # cap on the doubling wait between SUBMIT_UNKNOWN lookups
    unknown_safe_window_seconds: float = Field(default=3600.0, gt=0)  # then MANUAL_REVIEW, never a blind retry
    requeue_backoff_base_seconds: float = Field(default=2.0, gt=0)  # after a 429, doubled per attempt
    requeue_backoff_max_seconds: float = Field(default=120.0, gt=0)  # cap on the requeue backoff after a 429
    attempt_recovery_seconds: float = Field(default=15.0, gt=0)  # how often expired attempt leases are looked for
    # How long an admission answer is replayed for its Idempotency-Key (at least 24 h).
    idempotency_ttl_seconds: float = Field(default=86400.0, ge=86400.0)
    # How long a provider's webhook id is remembered against a redelivery (webhook_receipt), and a
    # parked webhook kept once applied; then the idempotency purge deletes them. Longer than any
    # provider's redelivery schedule (Standard Webhooks senders retry for days, not weeks).
    webhook_receipt_ttl_seconds: float = Field(default=30 * 86400.0, ge=86400.0)
    # How long an unfinished request holds its key before the next request with it takes over.
    idempotency_lock_seconds: float = Field(default=30.0, gt=0)
    # Window a lane's throughput (expected waits) is measured over; six of them for provider stats.
    throughput_window_seconds: float = Field(default=600.0, gt=0)


class Limits(_Strict):
    """Platform-wide limits; per-tenant ones live in tenant_scheduling_policy."""

    # Largest request body the tenant and admin APIs accept (413 above; also the WAF's limit).
    max_body_bytes: int = Field(default=64 * 1024, gt=0)
    max_inputs: int = Field(default=4, ge=0)  # input media per generation request
    max_input_bytes: int = Field(default=200 * 1024 * 1024, gt=0)  # bytes of one input the probe fetches before INPUT_TOO_LARGE
    # Longest input video or audio, in seconds of media (INPUT_TOO_LONG).
    max_input_duration_seconds: float = Field(default=120.0, gt=0)
    # Admission answers REJECT_PLATFORM_OVERLOADED while more outbox events than this are PENDING.
    outbox_backlog_reject_threshold: int = Field(default=50_000, gt=0)
    # Platform seconds: admission answers REJECT_PLATFORM_OVERLOADED while the oldest PENDING outbox
    # event is older than this (the bus is down or the relay stalled; ch. 18.18, 20.12.3).
    outbox_backlog_max_age_seconds: float = Field(default=900.0, gt=0)
    # REAL seconds an API request waits for a database connection before it answers 503 (well inside
    # API Gateway's 29 s): with PostgreSQL down the API fails closed, and fast.
    api_database_wait_seconds: float = Field(default=3.0, gt=0)
    # REAL seconds an API process remembers a key that authenticated (aivedio.auth): a revoked key
    # stops working in other processes within this; 0 reads PostgreSQL on every request.
    api_key_cache_seconds: float = Field(default=2.0, ge=0, le=30)
    outbox_max_attempts: int = Field(default=10, gt=0)  # then the event is FAILED, for an operator
    # Jobs of one model running at once over all providers (the model:<model> pool).
    model_global_running_cap: int = Field(default=800, gt=0)
    # The cost:platform pool: estimated cost of the work running at once, in cost units (1/100 of the provider currency).
    platform_cost_per_minute: int = Field(default=10_000, gt=0)
    pool_shards: int = Field(default=4, gt=0, le=64)  # rows each big pool's counter is split over, so no single row is a hot spot
    aimd_decrease_pct: int = Field(default=50, gt=0, lt=100)  # a 429 cuts an account's adaptive limit to this %
    aimd_increase_units: int = Field(default=1, gt=0)  # each accepted submit gives this much back
    aimd_min_units: int = Field(default=1, gt=0)  # the adaptive limit never goes below this
    aimd_cooldown_seconds: float = Field(default=5.0, ge=0)  # a burst of 429s cuts the limit once, not once per 429
    max_attempt_recoveries: int = Field(default=10, ge=1)  # lease-expiry restarts of one attempt, then MANUAL_REVIEW
    orphan_cancel: bool = True  # cancel provider jobs whose attempt was replaced (they may be billed)
    # Fetching input media at admission (aivedio.media.probe). These are REAL seconds, not divided by
    # time_scale: they bound network fetches inside one API invocation, not platform durations.
    input_fetch_deadline_seconds: float = Field(default=10.0, gt=0)  # one input: resolve, connect, redirects, last byte
    input_request_deadline_seconds: float = Field(default=20.0, gt=0)  # all inputs of one request together
    input_max_redirects: int = Field(default=3, ge=0, le=10)  # each hop is checked again like the first
    # Non-global hosts a probe may fetch from anyway: host names (matched against the URL's host) or IPs and
    # CIDRs (matched against the resolved address). For tests and local setups; empty in production.
    probe_allowed_private_hosts: list[str] = Field(default_factory=list)

    @field_validator("probe_allowed_private_hosts")
    @classmethod
    def _allowed_hosts(cls, v: list[str]) -> list[str]:
        out = []
        for entry in v:
            e = entry.strip().lower().rstrip(".")
            try:
                ipaddress.ip_network(e, strict=False)
            except ValueError:
                if not re.fullmatch(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*", e):
                    raise ValueError(f"{entry!r} is not a host name, an IP address or a CIDR") from None
            out.append(e)
        return out


class Pools(_Strict):
    """Worker pools by resource dimension (ch. 18.5.4): CPU units for transcodes, GPU units for renders."""

    # The worker:cpu pool: transcode CPU units of running tasks (1 to 6 by resolution).
    worker_cpu_units: int = Field(default=400, gt=0)
    worker_gpu_units: int = Field(default=32, gt=0)  # the worker:gpu pool: GPU units of running tasks (1 at 1080p, 2 at 4k)


class MediaLimits(_Strict):
    """What one media job may take (the worker enforces them; the SPEC carries them). Seconds are
    REAL seconds: they bound a process, not a platform duration."""

    max_bytes: int = Field(default=2 * 1024 ** 3, gt=0)  # the provider's file, fetched
    timeout_seconds: float = Field(default=900.0, gt=0)  # the whole job: fetch, probe, transcodes, store
    disk_quota_bytes: int = Field(default=8 * 1024 ** 3, gt=0)  # the job's temporary directory
    duration_tolerance_seconds: float = Field(default=1.0, ge=0)  # |probed - ordered| duration
    resolution_tolerance_ratio: float = Field(default=0.05, ge=0, lt=1)  # of the ordered height


class MediaConfig(_Strict):
    """[media]: the media pipeline (aivedio.media.pipeline, issue 17). A provider's success is
    fetched, checked and stored by a media worker before the task is SUCCEEDED; `enabled = false`
    keeps the old path (the provider's success is the task's, with the provider's URL)."""

    enabled: bool = True  # false: a provider's success is the task's, with the provider's URL (no media worker)
    max_tries: int = Field(default=3, ge=1)  # worker runs per output version; then MEDIA_INGEST_FAILED
    retry_base_seconds: float = Field(default=10.0, gt=0)  # platform seconds before a retry, doubled per try
    retry_max_seconds: float = Field(default=300.0, gt=0)  # cap on the doubled retry delay
    # Platform seconds a RUNNING job may go without a word before the media-jobs reconciler looks
    # at it: the worker's timeout (real seconds, scaled) plus this margin.
    lease_margin_seconds: float = Field(default=120.0, gt=0)
    dispatch_seconds: float = Field(default=1.0, gt=0)  # platform seconds between local dispatch loop runs
    dispatch_batch: int = Field(default=8, gt=0)  # jobs one dispatch may claim
    # Worker slots per media resource class (ch. 18.5.4): the pools worker:<class>, one shard each.
    cpu_proxy_units: int = Field(default=8, gt=0)
    gpu_render_units: int = Field(default=2, gt=0)  # slots of the gpu-render class (worker:gpu-render)
    gpu_highmem_units: int = Field(default=2, gt=0)  # slots of the gpu-highmem class (worker:gpu-highmem)
    limits: MediaLimits = Field(default_factory=MediaLimits)  # [media.limits]: what one media job may take
    # Locally served URLs (GET /v1/media/...): REAL seconds they stay valid, and the key that signs
    # them: random per process (no default secret), shared with the API worker processes through
    # the resolved config. In AWS outputs are presigned S3 URLs instead.
    url_ttl_seconds: int = Field(default=3600, gt=0)
    # The HMAC-SHA256 key that signs the local media URLs (random per process unless set).
    url_signing_key: str = Field(default_factory=lambda: secrets.token_urlsafe(32), min_length=16, repr=False)
    local_dir: Path | None = None  # where local workers store outputs; None: <AIVEDIO_HOME>/media
    worker_command: list[str] = Field(default_factory=list)  # empty: this Python and containers/gpu-render/worker.py
    # Media cost attributed to each task (media_cost_event, kinds TRANSCODE and STORAGE), in cost_currency:
    # per worker-slot unit and second of transcoding, and the stored outputs' whole storage life
    # (aivedio.media.storage_cost), booked when they are stored.
    cost_currency: str = "USD"
    # Cost per slot unit and second of worker time, a decimal string in cost_currency.
    transcode_cost_per_unit_second: str = Field(default="0.00005", pattern=r"^\d+(\.\d+)?$")
    # Cost per GB (2^30 bytes) and month in S3 Standard, where every output starts.
    storage_cost_per_gb_month: str = Field(default="0.023", pattern=r"^\d+(\.\d+)?$")
    # Cost per GB and month in S3 Standard-IA, where a retention class moves outputs after 30 days.
    storage_ia_cost_per_gb_month: str = Field(default="0.0125", pattern=r"^\d+(\.\d+)?$")
    # Cost per GB and month in S3 Glacier Instant Retrieval, where final outputs go after 180 days.
    storage_glacier_ir_cost_per_gb_month: str = Field(default="0.004", pattern=r"^\d+(\.\d+)?$")
    # How many months of storage a task is charged for when its retention class never expires its outputs.
    storage_horizon_months: int = Field(default=12, gt=0)
    # How far, in percent of the larger figure, the media bucket's billed storage for a month (its
    # TimedStorage lines in the Cost and Usage Report) may stray from what the platform expects
    # before the month is parked for finance as STORAGE_COST_MISMATCH.
    storage_check_tolerance_pct: int = Field(default=5, ge=0, le=100)


class SchedulerConfig(_Strict):
    base_quantum: int = Field(default=1, gt=0)  # ch. 18.6.3; quantum = base_quantum x weight
    batch_size: int = Field(default=8, gt=0)  # claims per tenant visit
    conservative_batch_size: int = Field(default=2, gt=0)  # when Redis is down
    fit_scan_depth: int = Field(default=8, gt=0)  # head tasks a visit may look at
    max_skips: int = Field(default=3, ge=0)  # then a big head task stops being skipped
    max_debt_correction_units: int = Field(default=8, ge=0)  # cap on one task's fairness-debt correction
    tick_budget_seconds: float = Field(default=20.0, gt=0)  # how long one tick may loop (real seconds)
    max_idle_visits: int = Field(default=64, gt=0)  # visits without a claim before a lane is left for this tick
    # The order in which a tick visits the lanes.
    lane_order: list[str] = Field(default_factory=lambda: ["RECOVERY", "ENTERPRISE_RESERVED", "PAID_SHARED", "STANDARD",
                                                           "EXPENSIVE", "BEST_EFFORT"])


class BillingConfig(_Strict):
    """Billing knobs (ch. 20.6.7, 20.9.4). Credits are integer units; budgets are provider money."""

    compensation_dual_approval_above: int = Field(default=1000, ge=0)  # credits; above it two distinct approvers
    refund_dual_approval_above: int = Field(default=1000, ge=0)  # credits; above it a second operator approves
    refund_daily_limit_per_operator: int = Field(default=10_000, gt=0)  # credits one operator refunds per UTC day
    credit_expiry_seconds: float = Field(default=60.0, gt=0)  # platform seconds between expiry sweeps (locally)
    expiry_batch: int = Field(default=500, gt=0)  # lots expired per sweep transaction
    wallet_check_seconds: float = Field(default=3600.0, gt=0)  # platform seconds between wallet checks (locally)
    budget_alert_pct: int = Field(default=70, gt=0, le=100)  # alert
    budget_restrict_pct: int = Field(default=90, gt=0, le=100)  # refuse costly and low-priority work
    budget_reject_pct: int = Field(default=100, gt=0, le=1000)  # refuse all new work
    budget_slope_window_seconds: float = Field(default=600.0, gt=0)  # abnormal-slope breaker window
    budget_slope_max_fraction: float = Field(default=0.25, gt=0, le=1)  # of the limit reserved in one window
    # Pricing unavailable (ch. 20.12.4): admission may price from the last price version it read, for this
    # many platform seconds after that read, and only for a task quoted at most this many credits.
    price_snapshot_max_age_seconds: float = Field(default=600.0, gt=0)
    price_snapshot_max_task_amount: int = Field(default=5_000, ge=0)  # credits: the largest quote priced from a snapshot
    # ISO 4217 codes media costs are accounted in; an imported cost line in any other is parked
    media_cost_currencies: list[str] = Field(default_factory=lambda: ["USD", "EUR", "GBP", "JPY", "CNY"], min_length=1)
    # Provider invoices (aivedio.spend.invoices, ch. 20.10), in invoice (UTC calendar) days: each run re-pulls this
    # many days before the oldest day not yet reconciled (late or amended lines); a charged attempt waits this long
    # for its line (PENDING_WITHIN_GRACE) before it is MISSING_EXTERNAL; amounts within the tolerance agree.
    invoice_overlap_days: int = Field(default=3, ge=0, le=31)
    # Days a charged attempt waits for its invoice line before it is MISSING_EXTERNAL.
    invoice_grace_days: int = Field(default=2, ge=0, le=31)
    invoice_amount_tolerance: str = Field(default="0.0001", pattern=r"^\d+(\.\d+)?$")  # a decimal string


class MaintenanceService(_Strict):
    """[maintenance.<service>]: overrides of one maintenance service's defaults (aivedio.reconcile.room
    lists the services and their defaults). Durations are platform seconds, scaled by time_scale."""

    # Platform seconds between local runs; in AWS the schedule's rate, rounded up to whole minutes.
    interval_seconds: float | None = Field(default=None, gt=0)
    batch_size: int | None = Field(default=None, gt=0)  # rows per transaction
    max_batches: int | None = Field(default=None, gt=0)  # transactions per run; the next run carries on
    age_seconds: float | None = Field(default=None, ge=0)  # how old something must be before the service acts on it
    # A service that asks a provider again does so at most this often per item.
    retry_seconds: float | None = Field(default=None, ge=0)


class PlatformConfig(_Strict):
    # How much faster than real time platform durations pass: the Clock divides them by this (1: real time).
    time_scale: float = Field(default=1.0, gt=0)
    # [[providers]]: the AI video providers jobs are routed to.
    providers: list[ProviderConfig] = Field(default_factory=lambda: [ProviderConfig(name="provider-a")], min_length=1)
    # [lanes.NAME]: each lane's capacity and limits; a lane the file leaves out keeps its defaults.
    lanes: dict[str, LaneConfig] = Field(default_factory=_default_lanes)
    # [prices.MODEL]: the first price version's rules per model; a model not listed gets the defaults.
    prices: dict[str, ModelPrice] = Field(default_factory=dict)
    timers: Timers = Field(default_factory=Timers)  # [timers]: durations of the platform's loops and waits, in platform seconds
    limits: Limits = Field(default_factory=Limits)  # [limits]: platform-wide limits
    pools: Pools = Field(default_factory=Pools)  # [pools]: capacities of the shared worker pools
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)  # [scheduler]: the fair scheduler's tuning
    billing: BillingConfig = Field(default_factory=BillingConfig)  # [billing]: customer credit and provider spend
    media: MediaConfig = Field(default_factory=MediaConfig)  # [media]: the media pipeline
    # [maintenance.SERVICE]: overrides of one maintenance service's defaults.
    maintenance: dict[str, MaintenanceService] = Field(default_factory=dict)

    @field_validator("maintenance")
    @classmethod
    def _maintenance(cls, v: dict[str, MaintenanceService]) -> dict[str, MaintenanceService]:
        names = {s.name for s in SERVICES}
        unknown = sorted(set(v) - names)
        if unknown:
            raise ValueError(f"no maintenance service {unknown[0]!r}; services are {', '.join(sorted(names))}")
        return v

    @field_validator("lanes")
    @classmethod
    def _lanes(cls, v: dict[str, LaneConfig]) -> dict[str, LaneConfig]:
        unknown = sorted(set(v) - set(LANES))
        if unknown:
            raise ValueError(f"unknown lane {unknown[0]!r}; lanes are {', '.join(LANES)}")
        merged = _default_lanes()
        merged.update(v)  # a file may configure some lanes; the rest keep their defaults
        return merged

    @model_validator(mode="after")
    def _unique_providers(self) -> "PlatformConfig":
        names = [p.name for p in self.providers]
        if len(names) != len(set(names)):
            raise ValueError("providers: duplicate provider name")
        return self

    @property
    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for p in self.providers:
            for m in p.models:
                seen.setdefault(m, None)
        return list(seen)

    def price_for(self, model: str) -> ModelPrice:
        return self.prices.get(model, ModelPrice())

    def provider(self, name: str) -> ProviderConfig | None:
        return next((p for p in self.providers if p.name == name), None)


def _error_line(source: str, err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "(root)"
    return f"{source}: key '{key}': {first['msg']}"


def load_config(path: str | Path | None) -> PlatformConfig:
    """Parse and validate the TOML config; None means every default."""
    if path is None:
        return PlatformConfig()
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {p}: not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p}: not valid TOML: {e}") from None
    return parse_config(data, source=f"config file {p}")


def parse_config(data: dict[str, Any], source: str = "config") -> PlatformConfig:
    try:
        return PlatformConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_error_line(source, e)) from None


LOCAL_API_BASE_URL = "http://127.0.0.1:8080"


class Settings(_Strict):
    """Where state lives. URLs of None mean: start the embedded server under home."""

    database_url: str | None = None  # the PostgreSQL URL (AIVEDIO_DATABASE_URL); unset: an embedded server under home, locally
    redis_url: str | None = None  # the Redis URL, of one server or any node of a cluster (found out on connecting); unset: an embedded server under home; "none": no Redis (conservative mode)
    home: Path = Path(".aivedio")  # local state (AIVEDIO_HOME): the embedded servers' data, media, invoices and reports
    config_file: Path | None = None  # the TOML config file (AIVEDIO_CONFIG, or a command's --config); unset: every default
    redis_prefix: str = "av"  # prefix of every Redis key (AIVEDIO_REDIS_PREFIX), so platforms sharing a server never collide
    log_level: str = "INFO"  # a logging level name (AIVEDIO_LOG_LEVEL); recorded here, not applied by any logger at present
    # Where providers send webhooks: the API's own URL. None (a deployed function the stack gave no
    # URL): submits carry no callback_url and polling alone follows the job.
    api_base_url: str | None = LOCAL_API_BASE_URL
    event_queue_urls: dict[str, str] = Field(default_factory=dict)  # event_type (or "*") -> SQS queue URL
    # In AWS the environment carries no password (aivedio.cloud_credentials): the database URL names
    # the RDS Proxy and its user, and each connection signs a fresh IAM token; the Redis password is
    # read once from Secrets Manager at start.
    database_iam_auth: bool = False
    # The Secrets Manager secret with the Redis username and password (AIVEDIO_REDIS_SECRET_ARN).
    redis_secret_arn: str | None = None
    # AWS: attempt workflows run as executions of this Step Functions state machine. Unset: the
    # local workflow runner of this process runs them (aivedio_tools.local.workflow_runner).
    attempt_state_machine_arn: str | None = None
    # The platform media bucket: s3:// inputs are read only from its inputs/<tenant id>/ prefix. Unset:
    # s3:// inputs are refused (aivedio.media.probe).
    media_bucket: str | None = None
    # The invoice archive (aivedio.spend.invoice_archive): raw provider invoices and the reconciliation
    # reports, content-addressed and never overwritten. Unset: a directory under home (.aivedio/invoices).
    invoice_bucket: str | None = None
    # AWS (aivedio.cloud_config): the platform config is the TOML document in this SSM parameter, read
    # once per cold start (the provider credentials come from AIVEDIO_PROVIDER_SECRET_ARN).
    config_parameter: str | None = None
    # The provider credentials' Secrets Manager secret (AIVEDIO_PROVIDER_SECRET_ARN); unset: the SSM config loads without them.
    provider_secret_arn: str | None = None
    in_lambda: bool = False  # AWS_LAMBDA_FUNCTION_NAME is set: nothing local may be assumed

    @property
    def redis_disabled(self) -> bool:
        return (self.redis_url or "").lower() == "none"


def settings_from_env(environ: dict[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ

    def get(name: str) -> str | None:
        v = env.get(name)
        return v if v not in (None, "") else None

    in_lambda = get("AWS_LAMBDA_FUNCTION_NAME") is not None
    db = get("AIVEDIO_DATABASE_URL")
    if db is not None and not db.startswith(("postgresql://", "postgres://")):
        raise ConfigError(f"AIVEDIO_DATABASE_URL: expected a postgresql:// URL, got {db!r}")
    rd = get("AIVEDIO_REDIS_URL")
    if rd is not None and rd.lower() != "none" and not rd.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"AIVEDIO_REDIS_URL: expected redis://, rediss://, unix:// or 'none', got {rd!r}")
    queues_raw = get("AIVEDIO_EVENT_QUEUES")
    try:
        queues = json.loads(queues_raw) if queues_raw else {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"AIVEDIO_EVENT_QUEUES: not valid JSON: {e}") from None
    if not isinstance(queues, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in queues.items()):
        raise ConfigError("AIVEDIO_EVENT_QUEUES: expected a JSON object of event_type to queue URL")
    return Settings(
        event_queue_urls=queues,
        database_url=db,
        redis_url=rd,
        home=Path(get("AIVEDIO_HOME") or ".aivedio"),
        config_file=Path(c) if (c := get("AIVEDIO_CONFIG")) else None,
        redis_prefix=get("AIVEDIO_REDIS_PREFIX") or "av",
        log_level=get("AIVEDIO_LOG_LEVEL") or "INFO",
        api_base_url=get("AIVEDIO_API_BASE_URL") or (None if in_lambda else LOCAL_API_BASE_URL),
        config_parameter=get("AIVEDIO_CONFIG_PARAMETER"),
        provider_secret_arn=get("AIVEDIO_PROVIDER_SECRET_ARN"),
        in_lambda=in_lambda,
        database_iam_auth=_flag("AIVEDIO_DATABASE_IAM_AUTH", get("AIVEDIO_DATABASE_IAM_AUTH")),
        redis_secret_arn=get("AIVEDIO_REDIS_SECRET_ARN"),
        attempt_state_machine_arn=get("AIVEDIO_ATTEMPT_STATE_MACHINE_ARN"),
        media_bucket=get("AIVEDIO_MEDIA_BUCKET"),
        invoice_bucket=get("AIVEDIO_INVOICE_BUCKET"),
    )


def child_environment(**extra: str) -> dict[str, str]:
    """The environment of a child process this platform starts (a local media worker): this
    process's own without the platform's settings (AIVEDIO_*: database URLs, secrets, which a worker
    has no business with), plus `extra`. Here because no other module reads os.environ."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("AIVEDIO_")}, **extra}


def environment_value(name: str) -> str | None:
    """One variable of this process's environment, for a check that a child will have it."""
    return os.environ.get(name) or None


def _flag(name: str, value: str | None) -> bool:
    if value is None:
        return False
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}: expected 1/true/yes/on or 0/false/no/off, got {value!r}")


class Clock:
    """The one clock. Timestamps are wall-clock UTC; platform durations are divided by time_scale,
    so with time_scale=60 a configured 5-minute aging step passes in 5 real seconds."""

    def __init__(self, time_scale: float = 1.0):
        if time_scale <= 0:
            raise ConfigError("time_scale: must be > 0")
        self.time_scale = time_scale

    def now(self) -> datetime:
        return datetime.now(timezone.utc)

    def monotonic(self) -> float:
        return time.monotonic()

    def real_seconds(self, platform_seconds: float) -> float:
        return platform_seconds / self.time_scale

    def delta(self, platform_seconds: float) -> timedelta:
        return timedelta(seconds=self.real_seconds(platform_seconds))

    def after(self, platform_seconds: float) -> datetime:
        return self.now() + self.delta(platform_seconds)

    def sleep(self, platform_seconds: float) -> None:
        time.sleep(self.real_seconds(platform_seconds))


class ManualClock(Clock):
    """A clock tests move by hand, for exact boundary timestamps."""

    def __init__(self, start: datetime, time_scale: float = 1.0):
        super().__init__(time_scale)
        self._now = start
        self._mono = 0.0

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return self._mono

    def advance(self, platform_seconds: float) -> None:
        self._now += self.delta(platform_seconds)
        self._mono += self.real_seconds(platform_seconds)

    def sleep(self, platform_seconds: float) -> None:
        self.advance(platform_seconds)
