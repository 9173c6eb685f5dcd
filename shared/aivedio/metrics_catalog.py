"""The platform's operational metrics: names, units and dimensions, in one table.

In Lambda they are Powertools EMF metrics in NAMESPACE (POWERTOOLS_METRICS_NAMESPACE), and every
function sets POWERTOOLS_SERVICE_NAME=SERVICE, so Powertools' default `service` dimension has one
value; locally the same names are counted by aivedio.observability.metrics. The CDK app builds its
dashboard and alarms from this table (infra_cdk/observability.py), so an emitter and the graph of
what it emits cannot drift apart by a typo."""
from __future__ import annotations

from dataclasses import dataclass

NAMESPACE = "AiVedio"
SERVICE = "aivedio"


@dataclass(frozen=True)
class MetricSpec:
    name: str
    unit: str  # a CloudWatch unit name
    dimensions: tuple[str, ...]  # besides `service`
    statistic: str  # how the dashboard and alarms aggregate it
    description: str


QUEUE_DEPTH_UNITS = MetricSpec("QueueDepthUnits", "Count", ("lane",), "Maximum",
                               "cost units of QUEUED tasks per lane (gauge, by the scheduler tick)")
OLDEST_WAIT_SECONDS = MetricSpec("OldestWaitSeconds", "Seconds", ("lane",), "Maximum",
                                 "age of the oldest QUEUED task per lane (gauge, by the scheduler tick)")
PROVIDER_UTILISATION = MetricSpec("ProviderUtilisation", "Percent", ("provider",), "Average",
                                  "running attempts / max concurrency per provider (gauge)")
ADMISSION_REJECTIONS = MetricSpec("AdmissionRejections", "Count", ("code",), "Sum",
                                  "admission rejections by error code (counter, by the api)")
SUBMIT_UNKNOWN = MetricSpec("SubmitUnknown", "Count", (), "Sum",
                            "attempts that entered SUBMIT_UNKNOWN (counter, by the attempt workflow)")
UNRECONCILED_COST = MetricSpec("UnreconciledCost", "None", (), "Maximum",
                               "provider cost not yet matched to an invoice line, in USD (gauge, by the reconciler)")
STARVATION_INTERVENTIONS = MetricSpec("StarvationInterventions", "Count", (), "Sum",
                                      "tasks the starvation detector promoted (counter, by scheduler maintenance)")
OUTBOX_BACKLOG = MetricSpec("OutboxBacklog", "Count", (), "Maximum",
                            "outbox events not yet published (gauge, by the outbox relay)")
RECONCILIATION_BREAKS = MetricSpec("ReconciliationBreaks", "Count", (), "Sum",
                                   "reconciliation mismatches found (counter, by the reconcilers)")
MAINTENANCE_REPAIRS = MetricSpec("MaintenanceRepairs", "Count", ("service",), "Sum",
                                 "things a maintenance service repaired in one run (counter, by aivedio.reconcile.room)")
# --- outbox and settlement repairs ---
OUTBOX_DEAD_LETTERS = MetricSpec("OutboxDeadLetters", "Count", (), "Maximum",
                                 "outbox events FAILED after outbox_max_attempts deliveries, waiting for "
                                 "`aivedio admin outbox redrive` (gauge, by the outbox-dead-letters service)")
# --- manual review and stuck submits ---
MANUAL_REVIEW_OPEN = MetricSpec("ManualReviewOpen", "Count", (), "Maximum",
                                "tasks in MANUAL_REVIEW, waiting for `aivedio admin review resolve` or a lookup that "
                                "adopts their job (gauge, by the stuck-submits service each run)")
# --- degraded modes ---
DEGRADED_MODE = MetricSpec("DegradedMode", "Count", ("mode",), "Maximum",
                           "1 while a degraded mode of aivedio.degraded is active (database, redis, outbox_backlog, "
                           "provider_breaker, pricing, capacity_counters), 0 when it ends (gauge, by /healthz, the "
                           "redis-index service and the code that notices the fault)")
# --- invoices ---

ALL: tuple[MetricSpec, ...] = (QUEUE_DEPTH_UNITS, OLDEST_WAIT_SECONDS, PROVIDER_UTILISATION, ADMISSION_REJECTIONS,
                               SUBMIT_UNKNOWN, UNRECONCILED_COST, STARVATION_INTERVENTIONS, OUTBOX_BACKLOG,
                               RECONCILIATION_BREAKS, MAINTENANCE_REPAIRS,
                               # --- further metrics, by capability ---
                               MANUAL_REVIEW_OPEN,
                               DEGRADED_MODE,
                               OUTBOX_DEAD_LETTERS,
                               )
