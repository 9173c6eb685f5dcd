"""Structured logs (Powertools Logger, to stderr) and metrics (Powertools EMF in Lambda; the same
figures are kept in-process locally so /healthz and reports can read them)."""
from __future__ import annotations

import sys
import threading
from collections import defaultdict

from aws_lambda_powertools import Logger

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
