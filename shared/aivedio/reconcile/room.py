"""The maintenance room (ch. 18.3.6, 18.16.6, 20.10): every repair the platform makes, in one list.

Each service is one module of aivedio.reconcile (or, for the older ones, the module that owns the
state it repairs), in the manner of River's internal/maintenance:
- its defaults at the top, as a `DEFAULTS = Defaults(...)`: how often it runs, its batch size, how
  many batches one run may take, and the age past which something counts as stuck. Each can be
  overridden in the config file under `[maintenance.<service name>]`; every duration is in platform
  seconds, so `time_scale` compresses it like every other timer (`Tuning.delta`);
- `run_once(platform) -> Report`: works in batches, each its own short transaction, until a batch
  comes back short (nothing more is due) or `max_batches` ran (`complete` is then False and the
  next run carries on). Two runs at once are safe: rows are taken FOR UPDATE SKIP LOCKED;
- one EventBridge schedule in AWS, one loop under `aivedio serve`: both come from SERVICES through
  aivedio.events_routing. New services run on the `maintenance` Lambda, which reads the service's
  name from the schedule's input; the older ones keep their own function;
- one test file that drives it alone, with a case that crosses a batch boundary.

SERVICES is also what `aivedio reconcile run|list` and the README's operations table read: a repair
that is not listed here does not exist."""
from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any

from aivedio.metrics_catalog import MAINTENANCE_REPAIRS
from aivedio.observability import logger, publish

MAINTENANCE_FUNCTION = "maintenance"  # functions/maintenance: runs the service its schedule names


@dataclass(frozen=True)
class Defaults:
    """A service's tuning. Durations are platform seconds (the config's unit)."""

    interval_seconds: float  # between local runs; in AWS the schedule's rate, rounded up to minutes
    batch_size: int = 500  # rows per transaction
    max_batches: int = 20  # per run; the next run carries on
    age_seconds: float = 0.0  # how old something must be before this service acts on it
    retry_seconds: float = 0.0  # a service that asks a provider again: not more often than this, per item

    @property
    def aws_every_minutes(self) -> int:
        return max(1, int(-(-self.interval_seconds // 60)))  # EventBridge rates are whole minutes


@dataclass(frozen=True)
class Tuning:
    """A service's Defaults with the config's overrides applied, and the platform clock to scale them."""

    defaults: Defaults
    time_scale: float

    def __getattr__(self, name: str) -> Any:
        return getattr(self.defaults, name)

    def delta(self, platform_seconds: float) -> timedelta:
        return timedelta(seconds=platform_seconds / self.time_scale)

    @property
    def age(self) -> timedelta:
        return self.delta(self.defaults.age_seconds)

    @property
    def retry(self) -> timedelta:
        return self.delta(self.defaults.retry_seconds)


@dataclass
class Report:
    """What one run did. `examined` counts what the service looked at, `repaired` what it changed,
    `details` anything the service wants to say (counts by outcome, ids of what needs a person)."""

    service: str
    examined: int = 0
    repaired: int = 0
    batches: int = 0
    complete: bool = True
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def count(self, key: str, n: int = 1) -> None:
        self.details[key] = self.details.get(key, 0) + n


def in_batches(report: Report, tuning: Tuning, batch: Callable[[int], tuple[int, int]]) -> Report:
    """Run `batch(limit) -> (examined, repaired)` until it examines fewer than `limit` rows, or
    max_batches ran. Each call is expected to be its own transaction."""
    report.complete = False
    for _ in range(tuning.max_batches):
        examined, repaired = batch(tuning.batch_size)
        report.batches += 1
        report.examined += examined
        report.repaired += repaired
        if examined < tuning.batch_size:
            report.complete = True
            break
    return report


@dataclass(frozen=True)
class Service:
    name: str  # the schedule's name; the key of [maintenance.<name>] in the config file
    module: str  # defines DEFAULTS and run_once(platform) -> Report
    repairs: str  # one line for the operations table: what it finds and what it does
    never: str  # what it never does (the operations table's last column)
    function: str = MAINTENANCE_FUNCTION  # the Lambda that runs it in AWS (functions/<function>)
    # The older services keep the config key they had (timers or billing) for their local interval.
    legacy_interval: Callable[[Any], float] | None = None

    def load(self):
        return importlib.import_module(self.module)

    @property
    def defaults(self) -> Defaults:
        return self.load().DEFAULTS

    def interval_seconds(self, config) -> float:
        """Platform seconds between local runs: [maintenance.<name>] interval_seconds, else the
        legacy key, else the module's default."""
        own = config.maintenance.get(self.name)
        if own is not None and own.interval_seconds is not None:
            return own.interval_seconds
        if self.legacy_interval is not None:
            return self.legacy_interval(config)
        return self.defaults.interval_seconds

    @property
    def payload(self) -> dict[str, str] | None:
        """The schedule's input: the maintenance Lambda runs the service it names."""
        return {"service": self.name} if self.function == MAINTENANCE_FUNCTION else None


SERVICES: tuple[Service, ...] = (
    Service("attempt-recovery", "aivedio.reconcile.attempt_recovery",
            "live attempts whose lease expired (a lost execution): takes the lease by CAS and starts a new execution, "
            "which resumes from PostgreSQL; after max_attempt_recoveries, MANUAL_REVIEW",
            "resend a submit: a maybe-sent submit is only looked up by its key", function="attempt_recovery",
            legacy_interval=lambda c: c.timers.attempt_recovery_seconds),
    Service("scheduler-maintenance", "aivedio.reconcile.scheduler_upkeep",
            "aging (one band per aging step), the starvation detector (a task past its lane's max wait is promoted "
            "to P1, logged and recorded in scheduler_intervention), and the queue-index (ring) rebuild",
            "preempt a running task, or promote into P0", function="scheduler_maintenance",
            legacy_interval=lambda c: c.timers.aging_step_seconds / 4),
    Service("credit-expiry", "aivedio.reconcile.credit_upkeep",
            "subscription grants, EXPIRE of credit lots past their expiry, and a retry of settlements parked "
            "because their task was not known yet", "expire reserved credit: only a lot's available part",
            function="credit_expiry", legacy_interval=lambda c: c.billing.credit_expiry_seconds),
    Service("wallet-check", "aivedio.reconcile.wallet_check",
            "each wallet's snapshot against its ledger, reservations and lots; a mismatch freezes the wallet's "
            "risky operations and is recorded in wallet_discrepancy", "change a balance: repair is "
            "`aivedio admin wallet rebuild`, by appended adjustments", function="wallet_check",
            legacy_interval=lambda c: c.billing.wallet_check_seconds),
    Service("idempotency-purge", "aivedio.reconcile.idempotency_purge",
            "deletes idempotency records past their TTL, and webhook receipts and applied parked webhooks past "
            "timers.webhook_receipt_ttl_seconds", "touch a live record, free a spent key (its task keeps it), or drop a "
            "webhook still parked",
            function="idempotency_purge"),
    # --- reservations, outbox dead letters, unsettled terminals (reconcile/expired_reservations.py, ...) ---
    Service("expired-reservations", "aivedio.reconcile.expired_reservations",
            "capacity still held by a final attempt whose task is terminal or has moved on, and credit still reserved "
            "by a terminal task that is settled (ch. 20.7.9): released through the workflow's own CAS releases, each logged",
            "release on lease expiry alone, or anything of an attempt that may be live at the provider (SUBMITTED, RUNNING, "
            "SUBMIT_UNKNOWN, DISPATCHING once sent, MANUAL_REVIEW: attempt-recovery looks those up), or the credit of an "
            "unsettled task"),
    Service("unsettled-terminals", "aivedio.reconcile.unsettled_terminals",
            "terminal tasks whose charge is not finalized 10 minutes after they finished (a FAILED outbox row, a message "
            "lost or in the DLQ): settled with the same idempotent settlement, from the task's terminal outbox row or, "
            "without one, from the task and its attempt",
            "guess a stage the facts do not say, or settle a task again (a settled one is a REPLAY)"),
    Service("outbox-dead-letters", "aivedio.reconcile.outbox_dead_letters",
            "counts FAILED outbox events: the OutboxDeadLetters gauge (alarmed above 0, and when it stops coming) "
            "and an ALERT log line",
            "redrive them itself (a poison event would loop): `aivedio admin outbox redrive` does, audited"),
    # --- stuck submits, MANUAL_REVIEW lookups, parked webhooks, orphan jobs (reconcile/stuck_submits.py, ...) ---
    Service("stuck-submits", "aivedio.reconcile.stuck_submits",
            "attempts in MANUAL_REVIEW whose submit stayed unknown (SUBMIT_UNKNOWN_UNRESOLVED): looked up by their "
            "idempotency key every 15 minutes; a job found is adopted as `admin review resolve --action adopt` does, an "
            "absence proven inside the provider's window is requeued; publishes ManualReviewOpen",
            "requeue without proof of absence, or resend a submit"),
    Service("parked-webhooks", "aivedio.reconcile.parked_webhooks",
            "webhooks parked for a job no attempt knew: applied once (by webhook-id) when the job is mapped, and "
            "matched to attempts in review by lookups of their keys (then adopted)",
            "drop a parked webhook: unmapped past a week it stays parked and its job an orphan for invoice reconciliation"),
    Service("orphan-jobs", "aivedio.reconcile.orphan_jobs",
            "provider jobs of replaced or abandoned attempts (and a second job for one key): a running one is cancelled, "
            "a finished one's cost recorded as a provider_cost_event of its attempt, the orphan marked resolved; an "
            "abandoned attempt whose job id was never known is looked up by its key until the job is found or its "
            "absence proven; a provider gone from the config is left for a person",
            "delete an orphan, call a job absent while any account failed to answer, or cancel a job a webhook named "
            "before any attempt knew it (UNMAPPED)"),
    # --- Redis index and capacity counters (reconcile/redis_index.py, reconcile/capacity_counters.py) ---
    Service("redis-index", "aivedio.reconcile.redis_index",
            "each lane's Redis ring against PostgreSQL's tenants with QUEUED tasks: a lane without its index_built marker "
            "(Redis back empty, or stale) is rebuilt, missing tenants added, tenants with nothing queued (or that the ring's "
            "list and set disagree about) taken out and put back if queued; publishes the DegradedMode gauges",
            "touch DRR deficits or paused turns (PostgreSQL's), or write to Redis while it is down"),
    Service("capacity-counters", "aivedio.reconcile.capacity_counters",
            "each resource_pool_shard counter against the sum of its ACTIVE reservations: a mismatch is an ALERT and the "
            "capacity_counters degraded mode (conservative scheduling) until the counter, under its row lock, is reset "
            "to the reservations, with an audit_log row (system:capacity-counters, old and new)",
            "change a reservation: the reservations are the facts and the counter follows them"),
    # --- media jobs (reconcile/media_jobs.py) ---
    Service("media-jobs", "aivedio.reconcile.media_jobs",
            "RUNNING media jobs past their lease (a worker killed, a Batch event lost, a dispatcher that died before the "
            "start): the worker is asked about (the local pid, or Batch DescribeJobs); a finished Batch job's result is "
            "applied, a lost or hung worker (killed) is retried with the same output version through the fenced completion, "
            "and the task ends MEDIA_INGEST_FAILED once the job's tries are spent",
            "retry a job whose worker still runs within its lease, kill a process that is not the job's worker, or make a "
            "second output version"),
    # --- provider invoices (reconcile/invoices.py) ---
    Service("invoice-reconcile", "aivedio.spend.invoices",
            "each provider's invoice for yesterday (UTC) and a re-pulled overlap window, archived content-addressed, "
            "matched by charge id, job id and idempotency key against the platform's cost events: every discrepancy an "
            "item with evidence; only the fixes of ch. 20.10.5, each an appended cost event (source INVOICE); a day "
            "with a failed, malformed or empty-where-charged source, or broken continuity, is INCOMPLETE; JSON and HTML "
            "reports; publishes UnreconciledCost",
            "accept a fuzzy candidate, update or delete a cost event, overwrite an archived document, call a day COMPLETE "
            "that a source failed, or change a closed month (later corrections land in the next one)"),
    # --- hot wallets (reconcile/allowance_return.py) ---
    Service("allowance-return", "aivedio.reconcile.allowance_return",
            "the spend allowances of partitioned wallets' admission slots (ch. 20.11.4): every one given back to its "
            "wallet, one RELEASE (reason ALLOWANCE_RETURN) to the very lots per wallet, so none is stranded and the "
            "expiry sweep sees the lots' credit; slots refill from the wallet when they next admit",
            "move a task's reservation, or credit between wallets"),
)


def service(name: str) -> Service:
    for s in SERVICES:
        if s.name == name:
            return s
    raise KeyError(f"no maintenance service {name!r}; services are {', '.join(s.name for s in SERVICES)}")


def tuning(platform, name: str) -> Tuning:
    """The service's defaults with [maintenance.<name>] from the config file applied."""
    base = service(name).defaults
    overrides = platform.config.maintenance.get(name)
    if overrides is not None:
        base = replace(base, **overrides.model_dump(exclude_none=True))
    return Tuning(base, platform.clock.time_scale)


def run(platform, name: str) -> Report:
    """Run one service once (the maintenance Lambda, `aivedio reconcile run`). Logs what it did."""
    s = service(name)
    t0 = time.monotonic()
    result = s.load().run_once(platform)
    report: Report = result if isinstance(result, Report) else result.as_report()
    took_ms = round((time.monotonic() - t0) * 1000, 1)
    if report.repaired or not report.complete:
        # `service` is the logger's own key (the platform's name): the room's service is `maintenance`.
        logger.info("maintenance run", extra={"maintenance": name, **{k: v for k, v in report.as_dict().items() if k != "service"},
                                              "took_ms": took_ms})
    if report.repaired:
        publish(MAINTENANCE_REPAIRS, report.repaired, service=name)
    return report

