"""`GET /metrics` under `aivedio serve`: what aivedio.observability.publish recorded in this
process, as Prometheus text (prometheus_client's exposition format).

Every spec of aivedio.metrics_catalog is one family, named `aivedio_<snake_case of the spec's
name>`, in base units: a Percent spec becomes a 0..1 `_ratio`, a counter ends in `_total`, and a
gauge is a gauge (its last value). The labels are the spec's dimensions. In AWS the same figures
go to CloudWatch as EMF instead; this module is local-only (aivedio.local is left out of the
Lambda layer), and prometheus_client is a `local` extra, never a runtime dependency.

It answers only loopback clients: the local API port may be reachable from a LAN, the counters
are for the developer at the machine."""
from __future__ import annotations

import ipaddress
import re

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from aivedio import metrics_catalog as mc
from aivedio.observability import metrics

PATH = "/metrics"
PREFIX = "aivedio_"


def prometheus_name(spec: mc.MetricSpec) -> str:
    """The family name, without the `_total` prometheus_client adds to a counter's sample."""
    name = PREFIX + re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", spec.name).lower()
    if spec.unit == "Percent" and not name.endswith("_ratio"):
        name += "_ratio"
    elif spec.unit == "Seconds" and not name.endswith("_seconds"):
        name += "_seconds"
    return name


def _scale(spec: mc.MetricSpec) -> float:
    return 0.01 if spec.unit == "Percent" else 1.0


class _Collector:
    """Reads metrics.series() at each scrape: nothing is kept twice."""

    def collect(self):
        series = metrics.series()
        for spec in mc.ALL:
            labels = list(spec.dimensions)
            family = (GaugeMetricFamily if spec.kind == mc.GAUGE else CounterMetricFamily)(
                prometheus_name(spec), spec.description, labels=labels)
            seen = False
            for (name, dims), value in series.items():
                if name == spec.name:
                    d = dict(dims)
                    family.add_metric([d.get(k, "") for k in labels], value * _scale(spec))
                    seen = True
            if not seen and not labels and spec.kind == mc.COUNTER:
                family.add_metric([], 0.0)  # a counter nothing incremented yet is a 0, not missing
            yield family


def render() -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry)


def _loopback(client_ip: str | None) -> bool:
    if client_ip is None:
        return True
    try:
        return ipaddress.ip_address(client_ip.split("%")[0]).is_loopback
    except ValueError:
        return False


def metrics_response(path: str, client_ip: str | None = None) -> tuple[int, list[tuple[str, str]], bytes] | None:
    """(status, headers, body) for `GET /metrics`; None for any other path (the API answers it)."""
    if path != PATH:
        return None
    if not _loopback(client_ip):
        return 403, [("Content-Type", "text/plain; charset=utf-8")], b"metrics are served to loopback clients only\n"
    return 200, [("Content-Type", CONTENT_TYPE_LATEST)], render()
