"""Structured logs (Powertools Logger, to stderr) and metrics (Powertools EMF in Lambda; the same
figures are kept in-process locally so /healthz, reports and `GET /metrics` under `aivedio serve`
can read them)."""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import defaultdict

from aws_lambda_powertools import Logger
from aws_lambda_powertools.metrics import single_metric

from aivedio.metrics_catalog import GAUGE, HISTOGRAM, NAMESPACE, SERVICE, MetricSpec

logger = Logger(service="aivedio", logger_handler=__import__("logging").StreamHandler(sys.stderr))


Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class LocalMetrics:
    """What publish() recorded in this process, for /healthz, reports, tests and the local
    Prometheus endpoint (aivedio_tools.local.prometheus). `snapshot()` keys are the spec's name plus its
    sorted dimensions ("Claims|lane=PAID_SHARED") and sum every value published (for a gauge, the
    sum of what each run set); `series()` keeps, per spec and dimensions, a counter's total and a
    gauge's last value; `histograms()` a histogram's bucket counts, sum and count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[str, float] = defaultdict(float)
        self._series: Series = {}
        self._set_at: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}  # a gauge's last set (epoch s)
        self._hist: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = {}  # [per bucket..., +Inf, sum]

    def record(self, spec: MetricSpec, value: float, dims: dict[str, str]) -> None:
        items = tuple(sorted((k, str(v)) for k, v in dims.items()))
        key = spec.name + "".join(f"|{k}={v}" for k, v in items)
        with self._lock:
            self.counters[key] += value
            if spec.kind == HISTOGRAM:
                h = self._hist.setdefault((spec.name, items), [0.0] * (len(spec.buckets) + 2))
                h[next((i for i, b in enumerate(spec.buckets) if value <= b), len(spec.buckets))] += 1
                h[-1] += value
                return
            prev = self._series.get((spec.name, items), 0.0)
            self._series[(spec.name, items)] = value if spec.kind == GAUGE else prev + value
            if spec.kind == GAUGE:
                self._set_at[(spec.name, items)] = time.time()

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counters)

    def series(self) -> Series:
        """{(spec name, ((dimension, value), ...)): a counter's total or a gauge's last value}."""
        with self._lock:
            return dict(self._series)

    def histograms(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]:
        """{(spec name, dims): [count per bucket (not cumulative)..., count above the last, sum]}."""
        with self._lock:
            return {k: list(v) for k, v in self._hist.items()}

    def dump(self) -> dict:
        """This process's series as JSON, for a process that merges several (aivedio_tools.local.prometheus)."""
        with self._lock:
            return {"series": [[n, list(map(list, d)), v, self._set_at.get((n, d))] for (n, d), v in self._series.items()],
                    "histograms": [[n, list(map(list, d)), list(v)] for (n, d), v in self._hist.items()]}


metrics = LocalMetrics()


def in_lambda() -> bool:
    return "AWS_LAMBDA_FUNCTION_NAME" in os.environ  # set by the Lambda runtime, never locally


def publish(spec: MetricSpec, value: float = 1.0, **dimensions: str) -> None:
    """The one way to emit a metric: a spec of aivedio.metrics_catalog, recorded locally, and in
    Lambda also written as a Powertools EMF document (one per call, flushed at once), which
    CloudWatch turns into the metric the dashboard and alarms read. The dimensions must be the
    spec's own: another set would be another CloudWatch metric, one no graph or alarm reads. A call
    with the wrong set is a bug (tests/integration/test_metrics_catalog.py finds it statically); at
    run time it is logged and dropped, never raised, since a metric must not fail the work it counts."""
    if set(dimensions) != set(spec.dimensions):
        logger.error("metric dropped: wrong dimensions", extra={"metric": spec.name, "expected": list(spec.dimensions),
                                                               "got": sorted(dimensions)})
        return
    dimensions = {k: str(v) for k, v in dimensions.items()}
    metrics.record(spec, value, dimensions)
    if not in_lambda():
        return

    with single_metric(name=spec.name, unit=spec.unit, value=value, namespace=NAMESPACE,
                       default_dimensions={"service": SERVICE, **dimensions}):
        pass


_last_run: dict[str, float] = {}
_last_lock = threading.Lock()


def due(name: str, every_seconds: float) -> bool:
    """True at most once per every_seconds (real) per process: for gauges that cost a query."""
    now = time.monotonic()
    with _last_lock:
        if now - _last_run.get(name, -every_seconds - 1) < every_seconds:
            return False
        _last_run[name] = now
        return True
