"""The dashboard and the alarms, from aivedio.metrics_catalog (what the platform emits as
Powertools EMF) and from the queues and functions this app creates.

Dashboard: queue depth in units per lane, oldest wait per lane, provider utilisation, admission
rejections by code, SUBMIT_UNKNOWN count, unreconciled cost, plus outbox backlog, queue and DLQ
depths, and function errors; then one graph for every other metric of the catalog, so nothing the
platform emits is missing from it (tests/infra checks this). Lanes come from aivedio.config.LANES;
providers, codes and the other dimensions are open sets, so their graphs use SEARCH expressions.

Alarms (to one SNS topic, encrypted with a key CloudWatch may use): starvation (a lane's oldest
wait over its max_wait_seconds), outbox backlog, every DLQ holding a message (its redrive path is
`aivedio admin queue redrive`, SQS StartMessageMoveTask back to the source queue), outbox dead
letters (FAILED rows, redriven with `aivedio admin outbox redrive`; and when the service that counts
them stops publishing), reconciliation breaks, errors of the scheduled functions (a failing tick or
relay halts the platform), and attempt workflow executions that fail or time out (a step raised:
the lease scanner restarts the attempt, but a step that keeps raising needs a look). The money-risk
signals page too: a task open in manual review, each degraded mode, a budget reaching the restrict
level (budget_restrict_pct, 90 % by default) and unreconciled provider cost above the stage's
threshold; the dashboard's first row shows their state.

The catalog's gauges and counters are emitted by the capabilities that own them (scheduler,
attempts, reconcilers); until they do, those graphs stay empty and those alarms stay in
INSUFFICIENT_DATA/OK (missing data is not breaching; the outbox dead letters' gauge, published on
every run of its service, is the exception)."""
from __future__ import annotations

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sqs as sqs
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from aivedio import events_routing
from aivedio import metrics_catalog as mc
from aivedio import degraded
from aivedio.config import LANES, BillingConfig, Limits, PlatformConfig
from aivedio.reconcile import outbox_dead_letters
from infra_cdk.functions import Functions
from infra_cdk.stages import StageConfig

PERIOD = Duration.minutes(1)
OUTBOX_BACKLOG_ALARM = Limits().outbox_backlog_reject_threshold // 10  # alarm long before admission rejects
OUTBOX_DEAD_LETTERS_RUNS = 2  # the alarm's period, in the service's runs: one lost invocation is not an alarm
BUDGET_SCOPES = ("TENANT", "PROJECT", "PROVIDER_ACCOUNT", "MODEL", "REGION", "GLOBAL")  # budget_account.scope_type


def metric(spec: mc.MetricSpec, *, label: str | None = None, **dims: str) -> cw.Metric:
    return cw.Metric(namespace=mc.NAMESPACE, metric_name=spec.name, statistic=spec.statistic, period=PERIOD,
                     dimensions_map={"service": mc.SERVICE, **dims}, label=label)


def search(spec: mc.MetricSpec, label: str) -> cw.MathExpression:
    dims = ",".join(["service", *spec.dimensions])
    return cw.MathExpression(
        expression=f"SEARCH('{{{mc.NAMESPACE},{dims}}} MetricName=\"{spec.name}\"', '{spec.statistic}', 60)",
        label=label, period=PERIOD, using_metrics={})


class Observability(Construct):
    def __init__(self, scope: Construct, cid: str, *, stage: StageConfig, functions: Functions,
                 queues: dict[str, sqs.IQueue], dlqs: dict[str, sqs.IQueue],
                 state_machine: sfn.IStateMachine | None = None) -> None:
        super().__init__(scope, cid)
        key = kms.Key(self, "AlarmTopicKey", enable_key_rotation=True, removal_policy=stage.removal_policy,
                      description=f"{stage.prefix} alarm topic")
        key.add_to_resource_policy(iam.PolicyStatement(
            principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
            actions=["kms:Decrypt", "kms:GenerateDataKey*"], resources=["*"]))
        self.topic = sns.Topic(self, "Alarms", topic_name=f"{stage.prefix}-alarms", master_key=key, enforce_ssl=True)
        action = cw_actions.SnsAction(self.topic)
        self.alarms: list[cw.Alarm] = []

        def alarm(cid: str, m: cw.IMetric, *, threshold: float, periods: int, description: str,
                  missing: cw.TreatMissingData = cw.TreatMissingData.NOT_BREACHING) -> cw.Alarm:
            a = cw.Alarm(self, cid, alarm_name=f"{stage.prefix}-{cid}", metric=m, threshold=threshold,
                         evaluation_periods=periods,
                         comparison_operator=cw.ComparisonOperator.GREATER_THAN_THRESHOLD,
                         treat_missing_data=missing, alarm_description=description)
            a.add_alarm_action(action)
            a.add_ok_action(action)
            self.alarms.append(a)
            return a

        lanes = PlatformConfig().lanes
        for lane in LANES:
            alarm(f"starvation-{lane.lower().replace('_', '-')}", metric(mc.OLDEST_WAIT_SECONDS, lane=lane),
                  threshold=lanes[lane].max_wait_seconds, periods=3,
                  description=f"{lane}: the oldest queued task waited over max_wait_seconds for 3 minutes")
        alarm("outbox-backlog", metric(mc.OUTBOX_BACKLOG), threshold=OUTBOX_BACKLOG_ALARM, periods=5,
              description=f"more than {OUTBOX_BACKLOG_ALARM} unpublished outbox events for 5 minutes "
                          f"(admission rejects at {Limits().outbox_backlog_reject_threshold})")
        alarm("reconciliation-breaks", metric(mc.RECONCILIATION_BREAKS), threshold=0, periods=1,
              description="a reconciler found a mismatch")
        for consumer, dlq in dlqs.items():
            alarm(f"dlq-{consumer.replace('_', '-')}",
                  dlq.metric_approximate_number_of_messages_visible(period=PERIOD, statistic="Maximum"),
                  threshold=0, periods=1, description=f"{consumer}: messages in its dead-letter queue; after a fix, "
                                                      f"`aivedio admin queue redrive --queue {stage.prefix}-{consumer}`")
        # The outbox's own dead letters: events the relay gave up on. The outbox-dead-letters service
        # publishes the gauge on every run, 0 included, so a window of two of its runs without a
        # datapoint means it is not running: missing data breaches, and a stopped service is seen.
        every = events_routing.schedule(outbox_dead_letters.NAME).aws_every_minutes
        alarm("outbox-dead-letters",
              metric(mc.OUTBOX_DEAD_LETTERS).with_(period=Duration.minutes(OUTBOX_DEAD_LETTERS_RUNS * every)),
              threshold=0, periods=1, missing=cw.TreatMissingData.BREACHING,
              description=f"outbox events FAILED after outbox_max_attempts deliveries (see `aivedio admin outbox list`, "
                          f"then `aivedio admin outbox redrive`), or no datapoint for {OUTBOX_DEAD_LETTERS_RUNS * every} "
                          f"minutes: the {outbox_dead_letters.NAME} service is not running")
        scheduled = {s.function for s in events_routing.SCHEDULES}
        for fn in functions:
            if fn.name in scheduled:
                alarm(f"errors-{fn.name.replace('_', '-')}",
                      fn.function.metric_errors(period=Duration.minutes(5), statistic="Sum"),
                      threshold=0, periods=2, description=f"{fn.name} failing for 10 minutes")
        self.money_risk = self._money_risk_alarms(stage, alarm)
        if state_machine is not None:
            workflow_failures = cw.MathExpression(
                expression="failed + timedout", label="failed or timed out", period=Duration.minutes(5),
                using_metrics={"failed": state_machine.metric_failed(period=Duration.minutes(5), statistic="Sum"),
                               "timedout": state_machine.metric_timed_out(period=Duration.minutes(5), statistic="Sum")})
            alarm("attempt-workflow-failures", workflow_failures, threshold=0, periods=1,
                  description="attempt workflow executions failed or timed out (the Fail state Abandoned: a "
                              "step raised after its retries); the lease scanner restarts those attempts")

        self.dashboard = cw.Dashboard(self, "Dashboard", dashboard_name=f"{stage.prefix}-operations",
                                      default_interval=Duration.hours(3))
        self.dashboard.add_widgets(cw.AlarmStatusWidget(
            title="Money at risk: manual review, degraded modes, budgets, unreconciled cost", width=24, height=4,
            alarms=self.money_risk))
        by_lane = lambda spec: [metric(spec, lane=lane, label=lane) for lane in LANES]  # noqa: E731
        self.dashboard.add_widgets(
            cw.GraphWidget(title="Queue depth (units) per lane", left=by_lane(mc.QUEUE_DEPTH_UNITS), width=12, stacked=True),
            cw.GraphWidget(title="Oldest wait (s) per lane", left=by_lane(mc.OLDEST_WAIT_SECONDS), width=12),
        )
        self.dashboard.add_widgets(
            cw.GraphWidget(title="Provider utilisation (%)", left=[search(mc.PROVIDER_UTILISATION, "")], width=8,
                           left_y_axis=cw.YAxisProps(min=0, max=100)),
            cw.GraphWidget(title="Admission rejections by code", left=[search(mc.ADMISSION_REJECTIONS, "")], width=8,
                           stacked=True),
            cw.SingleValueWidget(title="SUBMIT_UNKNOWN (last hour)", width=4, metrics=[cw.Metric(
                namespace=mc.NAMESPACE, metric_name=mc.SUBMIT_UNKNOWN.name, statistic="Sum", period=Duration.hours(1),
                dimensions_map={"service": mc.SERVICE})]),
            cw.SingleValueWidget(title="Unreconciled cost (USD)", width=4, metrics=[metric(mc.UNRECONCILED_COST)]),
        )
        self.dashboard.add_widgets(
            cw.GraphWidget(title="Outbox backlog / dead letters", left=[metric(mc.OUTBOX_BACKLOG, label="backlog")], width=8,
                           right=[metric(mc.OUTBOX_DEAD_LETTERS, label="dead letters")],
                           left_annotations=[cw.HorizontalAnnotation(value=OUTBOX_BACKLOG_ALARM, label="alarm")]),
            cw.GraphWidget(title="Event queues: visible / oldest (s)", width=8,
                           left=[q.metric_approximate_number_of_messages_visible(period=PERIOD, label=n) for n, q in queues.items()],
                           right=[q.metric_approximate_age_of_oldest_message(period=PERIOD, label=n) for n, q in queues.items()]),
            cw.GraphWidget(title="Dead-letter queues", width=8,
                           left=[q.metric_approximate_number_of_messages_visible(period=PERIOD, label=n) for n, q in dlqs.items()]),
        )
        self.dashboard.add_widgets(
            cw.GraphWidget(title="Function errors", width=12,
                           left=[fn.function.metric_errors(period=Duration.minutes(5), label=fn.name) for fn in functions]),
            cw.GraphWidget(title="Starvation interventions, reconciliation breaks", width=12,
                           left=[metric(mc.STARVATION_INTERVENTIONS), metric(mc.RECONCILIATION_BREAKS)]),
        )
        self._catalog_widgets(by_lane)
        if state_machine is not None:
            five = Duration.minutes(5)
            self.dashboard.add_widgets(cw.GraphWidget(
                title="Attempt workflow executions", width=24,
                left=[state_machine.metric_started(period=five, statistic="Sum", label="started"),
                      state_machine.metric_succeeded(period=five, statistic="Sum", label="succeeded"),
                      state_machine.metric_failed(period=five, statistic="Sum", label="failed"),
                      state_machine.metric_timed_out(period=five, statistic="Sum", label="timed out")]))

    @staticmethod
    def _money_risk_alarms(stage: StageConfig, alarm) -> list[cw.Alarm]:
        """The signals that money or a tenant's work is at risk, each paging the topic."""
        # These are gauges published by schedules (a minute apart that drift) or on a change only, so a
        # period without a datapoint keeps the alarm as it was rather than reading as "all clear".
        keep = cw.TreatMissingData.IGNORE
        made = [alarm("manual-review-open", metric(mc.MANUAL_REVIEW_OPEN), threshold=0, periods=1, missing=keep,
                      description="tasks wait in MANUAL_REVIEW (their job may run, and be billed, unseen): "
                                  "`aivedio admin review list`, then `aivedio admin review resolve`")]
        for mode in degraded.MODES:
            made.append(alarm(f"degraded-{mode.replace('_', '-')}", metric(mc.DEGRADED_MODE, mode=mode), threshold=0,
                              periods=1, missing=keep, description=f"degraded mode {mode} is active (see /healthz and "
                                                     f"docs/operations.md, degraded modes)"))
        restrict = BillingConfig().budget_restrict_pct
        five = Duration.minutes(5)
        at_restrict = {f"s{i}": metric(mc.BUDGET_ALERTS, scope=scope, level=str(restrict)).with_(period=five)
                       for i, scope in enumerate(BUDGET_SCOPES)}
        made.append(alarm(f"budget-at-{restrict}pct", cw.MathExpression(
            expression=" + ".join(f"FILL({k}, 0)" for k in at_restrict), label=f"budgets reaching {restrict} %",
            period=five, using_metrics=at_restrict), threshold=0, periods=1,
            description=f"a budget reached {restrict} % of its limit: costly and low-priority work of its scope "
                        f"now waits (`aivedio admin budget status`)"))
        # The invoice service publishes it once an hour: one two-hour period always holds a datapoint.
        made.append(alarm("unreconciled-cost", metric(mc.UNRECONCILED_COST).with_(period=Duration.hours(2)),
                          threshold=stage.unreconciled_cost_alarm_usd, periods=1, missing=keep,
                          description=f"provider cost not matched to an invoice line above "
                                      f"{stage.unreconciled_cost_alarm_usd} USD for an hour: the daily reconciliation "
                                      f"is behind or found breaks (`aivedio reconcile invoices --provider P --date D`)"))
        return made

    # Graphed in the rows above; every other catalog metric gets a graph of its own below.
    FEATURED = frozenset(spec.name for spec in (
        mc.QUEUE_DEPTH_UNITS, mc.OLDEST_WAIT_SECONDS, mc.PROVIDER_UTILISATION, mc.ADMISSION_REJECTIONS, mc.SUBMIT_UNKNOWN,
        mc.UNRECONCILED_COST, mc.OUTBOX_BACKLOG, mc.OUTBOX_DEAD_LETTERS, mc.STARVATION_INTERVENTIONS,
        mc.RECONCILIATION_BREAKS))

    def _catalog_widgets(self, by_lane) -> None:
        widgets: list[cw.IWidget] = []
        for spec in mc.ALL:
            if spec.name in self.FEATURED:
                continue
            if spec.dimensions == ("lane",):
                left = by_lane(spec)
            elif spec.dimensions:
                left = [search(spec, "")]
            else:
                left = [metric(spec, label=spec.name)]
            widgets.append(cw.GraphWidget(title=f"{spec.name} ({spec.statistic})", left=left, width=6, height=5))
        for i in range(0, len(widgets), 4):
            self.dashboard.add_widgets(*widgets[i:i + 4])
