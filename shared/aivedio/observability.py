"""Structured logs (Powertools Logger, to stderr) and metrics (Powertools EMF in Lambda; the same
figures are kept in-process locally so /healthz and reports can read them)."""
from __future__ import annotations

import os
import sys
import threading
import time
from collections import defaultdict

from aws_lambda_powertools import Logger

from aivedio.metrics_catalog import NAMESPACE, SERVICE, MetricSpec

logger = Logger(service="aivedio", logger_handler=__import__("logging").StreamHandler(sys.stderr))


class LocalMetrics:
    """Counters readable locally; in Lambda the handlers also publish them as EMF."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[str, float] = defaultdict(float)

    def add(self, name: str, value: float = 1.0, **dims: str) -> None:
        key = name + "".join(f"|{k}={v}" for k, v in sorted(dims.items()))
        with self._lock:
            self.counters[key] += value

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.counters)


metrics = LocalMetrics()


def in_lambda() -> bool:
    return "AWS_LAMBDA_FUNCTION_NAME" in os.environ  # set by the Lambda runtime, never locally


def publish(spec: MetricSpec, value: float = 1.0, **dimensions: str) -> None:
    """One operational metric of aivedio.metrics_catalog: counted locally, and in Lambda also
    written as a Powertools EMF document (one per call, flushed at once), which CloudWatch turns
    into the metric the dashboard and alarms read."""
    metrics.add(spec.name, value, **dimensions)
    if not in_lambda():
        return
    from aws_lambda_powertools.metrics import single_metric

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
