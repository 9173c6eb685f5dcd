"""The platform's operational metrics: names, units and dimensions, in one table.

In Lambda they are Powertools EMF metrics in NAMESPACE (POWERTOOLS_METRICS_NAMESPACE), and every
function sets POWERTOOLS_SERVICE_NAME=SERVICE, so Powertools' default `service` dimension has one
value; locally the same names are kept by aivedio.observability.metrics and served as Prometheus
text on `GET /metrics` under `aivedio serve` (aivedio_tools.local.prometheus names each one
`aivedio_<snake_case>`, counters with `_total`). The CDK app builds its dashboard and alarms from
this table (infra_cdk/observability.py), so an emitter and the graph of what it emits cannot drift
apart by a typo. Every metric the code emits is a spec here, published with
`aivedio.observability.publish(SPEC, value, **dims)` (tests/integration/test_metrics_catalog.py
checks both directions); dimensions take only values from a small fixed set (never a tenant, task
or attempt id: each value is a CloudWatch metric of its own)."""
from __future__ import annotations

from dataclasses import dataclass

NAMESPACE = "AiVedio"
SERVICE = "aivedio"


COUNTER = "counter"  # a count of events: each publish adds its value
GAUGE = "gauge"  # a level: each publish sets it
HISTOGRAM = "histogram"  # a distribution: each publish is one observation (EMF values; Prometheus buckets)
WAIT_BUCKETS_SECONDS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0)

# The dimensions a spec may have: each takes values from a short fixed list (lane names, provider
# names, states, reason codes, ...).
BOUNDED_DIMENSIONS = frozenset({"lane", "provider", "reason", "state", "code", "service", "mode", "stage", "source",
                                "result", "how", "proof", "scope", "level", "via", "outcome", "event_type"})


@dataclass(frozen=True)
class MetricSpec:
    name: str
    unit: str  # a CloudWatch unit name
    dimensions: tuple[str, ...]  # besides `service`
    statistic: str  # how the dashboard and alarms aggregate it
    description: str
    kind: str = COUNTER
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds, in the spec's unit (Prometheus only)


QUEUE_DEPTH_UNITS = MetricSpec("QueueDepthUnits", "Count", ("lane",), "Maximum",
                               "cost units of QUEUED tasks per lane (gauge, by the scheduler tick)", GAUGE)
OLDEST_WAIT_SECONDS = MetricSpec("OldestWaitSeconds", "Seconds", ("lane",), "Maximum",
                                 "age of the oldest QUEUED task per lane (gauge, by the scheduler tick)", GAUGE)
PROVIDER_UTILISATION = MetricSpec("ProviderUtilisation", "Percent", ("provider",), "Average",
                                  "running attempts / max concurrency per provider (gauge)", GAUGE)
ADMISSION_REJECTIONS = MetricSpec("AdmissionRejections", "Count", ("code",), "Sum",
                                  "admission rejections by error code (counter, by the api)")
SUBMIT_UNKNOWN = MetricSpec("SubmitUnknown", "Count", (), "Sum",
                            "attempts that entered SUBMIT_UNKNOWN (counter, by the attempt workflow)")
UNRECONCILED_COST = MetricSpec("UnreconciledCost", "None", (), "Maximum",
                               "provider cost not yet matched to an invoice line, in USD (gauge, by the reconciler)",
                               GAUGE)
STARVATION_INTERVENTIONS = MetricSpec("StarvationInterventions", "Count", (), "Sum",
                                      "tasks the starvation detector promoted (counter, by scheduler maintenance)")
OUTBOX_BACKLOG = MetricSpec("OutboxBacklog", "Count", (), "Maximum",
                            "outbox events not yet published (gauge, by the outbox relay)", GAUGE)
RECONCILIATION_BREAKS = MetricSpec("ReconciliationBreaks", "Count", (), "Sum",
                                   "reconciliation mismatches found (counter, by the reconcilers)")
MAINTENANCE_REPAIRS = MetricSpec("MaintenanceRepairs", "Count", ("service",), "Sum",
                                 "things a maintenance service repaired in one run (counter, by aivedio.reconcile.room)")
# --- counters that were local only (issue #16): scheduler, attempts, webhooks, billing, outbox ---
ADMISSIONS_ACCEPTED = MetricSpec("AdmissionsAccepted", "Count", (), "Sum", "tasks admitted (counter, by the api)")
CLAIMS = MetricSpec("Claims", "Count", ("lane",), "Sum", "tasks the scheduler claimed (counter, by the scheduler tick)")
FIT_SCAN_SKIPS = MetricSpec("FitScanSkips", "Count", ("lane", "reason"), "Sum",
                            "queued tasks the fit scan passed over (counter, by the scheduler tick)")
TASKS_FINISHED = MetricSpec("TasksFinished", "Count", ("state", "stage"), "Sum",
                            "tasks that reached a terminal state (counter, by the attempt workflow)")
ATTEMPTS_REQUEUED = MetricSpec("AttemptsRequeued", "Count", ("reason",), "Sum",
                               "attempts given up and their task queued again (counter, by the attempt workflow)")
ATTEMPTS_RECOVERED = MetricSpec("AttemptsRecovered", "Count", ("state",), "Sum",
                                "attempts picked up again after their worker was lost (counter, by recovery)")
STALE_WRITES_REFUSED = MetricSpec("StaleWritesRefused", "Count", ("source",), "Sum",
                                  "writes refused because the attempt's fence had moved on (counter)")
SUBMIT_UNKNOWN_RESOLVED = MetricSpec("SubmitUnknownResolved", "Count", ("how",), "Sum",
                                     "SUBMIT_UNKNOWN attempts resolved by a lookup: the job found or absent (counter)")
MANUAL_REVIEWS = MetricSpec("ManualReviews", "Count", ("reason",), "Sum",
                            "attempts sent to MANUAL_REVIEW (counter, by the attempt workflow)")
REVIEW_ADOPTED = MetricSpec("ReviewAdopted", "Count", ("source",), "Sum",
                            "reviewed tasks whose provider job was adopted (counter)")
REVIEW_REQUEUED = MetricSpec("ReviewRequeued", "Count", ("proof",), "Sum",
                             "reviewed tasks queued again on a proof of absence (counter)")
REVIEW_FAILED = MetricSpec("ReviewFailed", "Count", (), "Sum", "reviewed tasks failed by an operator (counter)")
WEBHOOKS_RECEIVED = MetricSpec("WebhooksReceived", "Count", ("provider", "result"), "Sum",
                               "provider webhooks accepted, by what they did (counter, by the api)")
WEBHOOKS_REFUSED = MetricSpec("WebhooksRefused", "Count", ("provider", "reason"), "Sum",
                              "provider webhooks refused: bad signature, unknown job, ... (counter, by the api)")
PROVIDER_LIMIT_DECREASED = MetricSpec("ProviderLimitDecreased", "Count", ("provider",), "Sum",
                                      "AIMD decreases of a provider's concurrency limit (counter)")
BUDGET_ALERTS = MetricSpec("BudgetAlerts", "Count", ("scope", "level"), "Sum",
                           "budgets that crossed an alert level, in percent (counter)")
BUDGET_REFUSALS = MetricSpec("BudgetRefusals", "Count", ("scope", "reason"), "Sum",
                             "admissions refused by a budget (counter, by the api)")
SUBSCRIPTION_CREDITS_GRANTED = MetricSpec("SubscriptionCreditsGranted", "Count", (), "Sum",
                                          "credits granted by subscription renewals (counter)")
CREDITS_EXPIRED = MetricSpec("CreditsExpired", "Count", (), "Sum", "credits that expired (counter)")
CREDIT_EXPIRY_FAILURES = MetricSpec("CreditExpiryFailures", "Count", (), "Sum",
                                    "credit grants whose expiry failed and is retried (counter)")
BILLING_PARKED = MetricSpec("BillingParked", "Count", ("reason",), "Sum",
                            "billing events parked for an operator (counter)")
SETTLEMENTS = MetricSpec("Settlements", "Count", ("outcome",), "Sum",
                         "settlement events handled, by outcome (counter, by the settlement consumer)")
SETTLEMENT_REPLAYS = MetricSpec("SettlementReplays", "Count", ("via",), "Sum",
                                "redelivered settlement events answered from what was already settled (counter)")
SETTLEMENT_ABSORBED_CREDITS = MetricSpec("SettlementAbsorbedCredits", "Count", (), "Sum",
                                         "credits the platform absorbed over a reservation (counter)")
REFUNDS = MetricSpec("Refunds", "Count", ("state",), "Sum",
                     "refund requests by step: awaiting_approval, pending, approved, applied, daily_limit_refused "
                     "(counter)")
COMPENSATIONS_APPLIED = MetricSpec("CompensationsApplied", "Count", (), "Sum", "compensation credits applied (counter)")
OUTBOX_PUBLISHED = MetricSpec("OutboxPublished", "Count", (), "Sum", "outbox events published (counter, by the relay)")
OUTBOX_DELIVERY_ERRORS = MetricSpec("OutboxDeliveryErrors", "Count", (), "Sum",
                                    "outbox deliveries that failed and will be retried (counter, by the relay)")
OUTBOX_FAILED = MetricSpec("OutboxFailed", "Count", ("event_type",), "Sum",
                           "outbox events marked FAILED after their last delivery (counter, by the relay)")

# --- outbox and settlement repairs ---
OUTBOX_DEAD_LETTERS = MetricSpec("OutboxDeadLetters", "Count", (), "Maximum",
                                 "outbox events FAILED after outbox_max_attempts deliveries, waiting for "
                                 "`aivedio admin outbox redrive` (gauge, by the outbox-dead-letters service)", GAUGE)
# --- manual review and stuck submits ---
MANUAL_REVIEW_OPEN = MetricSpec("ManualReviewOpen", "Count", (), "Maximum",
                                "tasks in MANUAL_REVIEW, waiting for `aivedio admin review resolve` or a lookup that "
                                "adopts their job (gauge, by the stuck-submits service each run)", GAUGE)
# --- degraded modes ---
DEGRADED_MODE = MetricSpec("DegradedMode", "Count", ("mode",), "Maximum",
                           "1 while a degraded mode of aivedio.degraded is active (database, redis, outbox_backlog, "
                           "provider_breaker, pricing, capacity_counters), 0 when it ends (gauge, by /healthz, the "
                           "redis-index service and the code that notices the fault)", GAUGE)
# --- invoices ---
RECONCILIATION_OPEN_ITEMS = MetricSpec("ReconciliationOpenItems", "Count", (), "Maximum",
                                       "invoice reconciliation items still OPEN, all providers (gauge, by the "
                                       "invoice-reconcile service each run)", GAUGE)
# --- lanes and credits, read by the scheduler tick with the other gauges (aivedio.scheduling.gauges) ---
QUEUE_DEPTH_TASKS = MetricSpec("QueueDepthTasks", "Count", ("lane",), "Maximum",
                               "QUEUED tasks per lane (gauge, by the scheduler tick)", GAUGE)
RUNNING_UNITS = MetricSpec("RunningUnits", "Count", ("lane",), "Maximum",
                           "cost units in use of the lane's own capacity, by its work and by borrowers (gauge)", GAUGE)
BORROWED_UNITS = MetricSpec("BorrowedUnits", "Count", ("lane",), "Maximum",
                            "units the lane's work runs on capacity borrowed from another lane (gauge)", GAUGE)
LANE_UTILISATION = MetricSpec("LaneUtilisation", "Percent", ("lane",), "Average",
                              "running units / safe capacity (capacity less the headroom kept free) per lane (gauge)",
                              GAUGE)
RESERVED_CREDITS_IN_FLIGHT = MetricSpec("ReservedCreditsInFlight", "Count", (), "Maximum",
                                        "credits held by ACTIVE credit reservations, all wallets (gauge)", GAUGE)
QUEUE_WAIT_SECONDS = MetricSpec("QueueWaitSeconds", "Seconds", ("lane",), "p99",
                                "platform seconds from admission to claim, one observation per claimed task "
                                "(histogram, by the scheduler tick)", HISTOGRAM, WAIT_BUCKETS_SECONDS)

ALL: tuple[MetricSpec, ...] = (QUEUE_DEPTH_UNITS, OLDEST_WAIT_SECONDS, PROVIDER_UTILISATION, ADMISSION_REJECTIONS,
                               SUBMIT_UNKNOWN, UNRECONCILED_COST, STARVATION_INTERVENTIONS, OUTBOX_BACKLOG,
                               RECONCILIATION_BREAKS, MAINTENANCE_REPAIRS,
                               ADMISSIONS_ACCEPTED, CLAIMS, FIT_SCAN_SKIPS, TASKS_FINISHED, ATTEMPTS_REQUEUED,
                               ATTEMPTS_RECOVERED, STALE_WRITES_REFUSED, SUBMIT_UNKNOWN_RESOLVED, MANUAL_REVIEWS,
                               REVIEW_ADOPTED, REVIEW_REQUEUED, REVIEW_FAILED, WEBHOOKS_RECEIVED, WEBHOOKS_REFUSED,
                               PROVIDER_LIMIT_DECREASED, BUDGET_ALERTS, BUDGET_REFUSALS, SUBSCRIPTION_CREDITS_GRANTED,
                               CREDITS_EXPIRED, CREDIT_EXPIRY_FAILURES, BILLING_PARKED, SETTLEMENTS, SETTLEMENT_REPLAYS,
                               SETTLEMENT_ABSORBED_CREDITS, REFUNDS, COMPENSATIONS_APPLIED, OUTBOX_PUBLISHED,
                               OUTBOX_DELIVERY_ERRORS, OUTBOX_FAILED,
                               # --- further metrics, by capability ---
                               MANUAL_REVIEW_OPEN,
                               DEGRADED_MODE,
                               OUTBOX_DEAD_LETTERS,
                               RECONCILIATION_OPEN_ITEMS, QUEUE_DEPTH_TASKS, RUNNING_UNITS, BORROWED_UNITS,
                               LANE_UTILISATION, RESERVED_CREDITS_IN_FLIGHT, QUEUE_WAIT_SECONDS,
                               )
BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in ALL}
