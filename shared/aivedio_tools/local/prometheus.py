"""`GET /metrics` under `aivedio serve`: what aivedio.observability.publish recorded in this
process, as Prometheus text (prometheus_client's exposition format).

Every spec of aivedio.metrics_catalog is one family, named `aivedio_<snake_case of the spec's
name>`, in base units: a Percent spec becomes a 0..1 `_ratio`, a counter ends in `_total`, and a
gauge is a gauge (its last value). The labels are the spec's dimensions. In AWS the same figures
go to CloudWatch as EMF instead; this module is local-only (aivedio_tools.local is left out of the
Lambda layer), and prometheus_client is a `local` extra, never a runtime dependency.

It answers only loopback clients: the local API port may be reachable from a LAN, the counters
are for the developer at the machine.

With `aivedio serve --api-workers N` the loops run in the main process and the API in N workers,
each with its own counters, and any worker may answer a scrape. So every process of the serve
writes its series to `<dir>/<pid>.json` about once a second (share()), and a scrape merges its
own live series with the others' files: counters and histograms are summed (a dead worker's file
stays, so a total never goes back), a gauge takes the value set last, whichever process set it,
as prometheus_client's own multiprocess mode does with files."""
from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import threading
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from aivedio import metrics_catalog as mc
from aivedio.observability import metrics

log = logging.getLogger(__name__)

PATH = "/metrics"
PREFIX = "aivedio_"
SHARE_SECONDS = 1.0
_share_dir: str | None = None


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


Key = tuple[str, tuple[tuple[str, str], ...]]


def _merged() -> tuple[dict[Key, float], dict[Key, list[float]]]:
    """This process's series and histograms, plus the other serve processes' shared files."""
    series, hists = metrics.series(), metrics.histograms()
    if _share_dir is None:
        return series, hists
    own = metrics.dump()
    stamps = {(n, tuple(map(tuple, d))): at for n, d, _, at in own["series"]}
    for f in Path(_share_dir).glob("*.json"):
        if f.stem == str(os.getpid()):
            continue
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue  # being replaced right now: its next write is read at the next scrape
        for n, d, value, at in doc.get("series", []):
            key = (n, tuple(map(tuple, d)))
            spec = mc.BY_NAME.get(n)
            if spec is None:
                continue
            if spec.kind == mc.GAUGE:
                if at is not None and (stamps.get(key) is None or at > stamps[key]):
                    series[key], stamps[key] = value, at
            else:
                series[key] = series.get(key, 0.0) + value
        for n, d, counts in doc.get("histograms", []):
            key = (n, tuple(map(tuple, d)))
            mine = hists.get(key)
            hists[key] = list(counts) if mine is None else [a + b for a, b in zip(mine, counts)]
    return series, hists


class _Collector:
    """Reads the recorded series at each scrape: nothing is kept twice."""

    def collect(self):
        series, hists = _merged()
        for spec in mc.ALL:
            labels = list(spec.dimensions)
            if spec.kind == mc.HISTOGRAM:
                family = HistogramMetricFamily(prometheus_name(spec), spec.description, labels=labels)
                for (name, dims), counts in hists.items():
                    if name == spec.name:
                        d = dict(dims)
                        cumulative, buckets = 0.0, []
                        for bound, n in zip([*map(str, spec.buckets), "+Inf"], counts[:-1]):
                            cumulative += n
                            buckets.append((bound, cumulative))
                        family.add_metric([d.get(k, "") for k in labels], buckets, counts[-1])
                yield family
                continue
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


def share(directory: str) -> None:
    """Write this process's series to `directory/<pid>.json` every SHARE_SECONDS, and merge the
    other processes' files into each scrape (see the module docstring)."""
    global _share_dir
    os.makedirs(directory, exist_ok=True)
    _share_dir = directory
    path = Path(directory) / f"{os.getpid()}.json"

    def write_forever() -> None:
        last = None
        while True:
            if not path.parent.is_dir():
                return  # the serve that made the directory stopped and removed it: nothing to share with
            doc = json.dumps(metrics.dump(), separators=(",", ":"))
            if doc != last:
                try:
                    tmp = path.with_suffix(".tmp")
                    tmp.write_text(doc)
                    os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one
                    last = doc
                except OSError as e:
                    log.warning("metrics not shared with the other serve processes: %s", e)
            threading.Event().wait(SHARE_SECONDS)

    threading.Thread(target=write_forever, name="metrics-share", daemon=True).start()


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


def _loopback_host(host: str | None) -> bool:
    """Whether a Host header names this machine's loopback (localhost, 127.x, [::1], any port). A
    page of another site that a browser here was made to send to 127.0.0.1 (DNS rebinding) still
    names that site."""
    if host is None:
        return True  # HTTP/1.0 without a Host: only a local tool sends that
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1:name.find("]")] if "]" in name else name
    else:
        name = name.rsplit(":", 1)[0] if name.count(":") == 1 else name
    return name == "localhost" or _loopback(name)


def metrics_response(path: str, client_ip: str | None = None,
                     host: str | None = None) -> tuple[int, list[tuple[str, str]], bytes] | None:
    """(status, headers, body) for `GET /metrics`; None for any other path (the API answers it).
    Served only to a loopback client that asked a loopback host."""
    if path != PATH:
        return None
    if not _loopback(client_ip) or not _loopback_host(host):
        return 403, [("Content-Type", "text/plain; charset=utf-8")], b"metrics are served to loopback clients only\n"
    return 200, [("Content-Type", CONTENT_TYPE_LATEST)], render()
