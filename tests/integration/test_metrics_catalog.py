"""One metrics path (issue #16): every metric is a spec of aivedio.metrics_catalog emitted through
aivedio.observability.publish, and `GET /metrics` under `aivedio serve` serves the same figures as
Prometheus text."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aivedio import metrics_catalog as mc
from aivedio_tools.local import prometheus
from aivedio_tools.local.http_server import LambdaHttpServer
from aivedio.observability import metrics, publish
from aivedio.scheduling.resources import ensure_platform_pools
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import new_tenant
from tests.scheduler_support import UNCAPPED, submit

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("shared/aivedio", "functions") for p in (ROOT / d).rglob("*.py")]
SPEC_NAMES = {name for name, v in vars(mc).items() if isinstance(v, mc.MetricSpec)}


def _publish_calls():
    """(path, line, first argument's source) of every `publish(...)` call outside the outbox's own
    publish functions, which take events, not specs."""
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "publish":
                yield path.relative_to(ROOT), node.lineno, ast.unparse(node.args[0]) if node.args else ""


def test_the_catalog_is_whole_and_its_dimensions_are_bounded():
    assert set(mc.ALL) == {v for v in vars(mc).values() if isinstance(v, mc.MetricSpec)}, "a spec missing from ALL"
    assert len({s.name for s in mc.ALL}) == len(mc.ALL)
    for spec in mc.ALL:
        assert set(spec.dimensions) <= mc.BOUNDED_DIMENSIONS, spec
        assert spec.kind in (mc.COUNTER, mc.GAUGE, mc.HISTOGRAM), spec
        assert spec.kind != mc.COUNTER or spec.statistic == "Sum", spec  # a counter graphs as its sum
        assert (spec.kind == mc.HISTOGRAM) == bool(spec.buckets), spec
        assert list(spec.buckets) == sorted(set(spec.buckets)), spec


def test_every_publish_call_names_a_catalog_spec_and_no_other_path_is_left():
    calls = list(_publish_calls())
    assert len(calls) > 30
    stray = [c for c in calls if c[2] not in SPEC_NAMES and not c[2].startswith("mc.")]
    assert not stray, stray
    left = [f"{p.relative_to(ROOT)}:{n}" for p in SOURCES if p.name != "observability.py"
            for n, line in enumerate(p.read_text().splitlines(), 1) if "metrics.add(" in line]
    assert not left, left


def test_every_publish_call_passes_its_specs_dimensions():
    wrong = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "publish" \
                    and node.args and ast.unparse(node.args[0]).removeprefix("mc.") in SPEC_NAMES:
                spec = getattr(mc, ast.unparse(node.args[0]).removeprefix("mc."))
                if {k.arg for k in node.keywords} != set(spec.dimensions):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not wrong, wrong


def test_every_catalog_spec_is_emitted_somewhere():
    emitted = {arg.removeprefix("mc.") for _, _, arg in _publish_calls()}
    unused = [name for name in SPEC_NAMES if name not in emitted]
    assert not unused, f"catalog specs no code publishes: {unused}"


def test_publish_drops_dimensions_the_spec_does_not_have_and_says_so(caplog):
    from aivedio.observability import metrics

    before = metrics.snapshot()
    publish(mc.CLAIMS)  # lane missing: a different CloudWatch metric than the dashboard's
    publish(mc.SUBMIT_UNKNOWN, reason="timeout")
    assert metrics.snapshot() == before  # nothing recorded under a name no graph reads
    assert sum("metric dropped: wrong dimensions" in r.getMessage() for r in caplog.records) == 2


def test_a_new_spec_reaches_cloudwatch_as_emf(monkeypatch, capsys):
    monkeypatch.setenv("AWS_LAMBDA_FUNCTION_NAME", "aivedio-dev-scheduler_tick")
    publish(mc.CLAIMS, 3, lane="PAID_SHARED")
    [line] = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    doc = json.loads(line)
    [directive] = doc["_aws"]["CloudWatchMetrics"]
    assert directive["Namespace"] == mc.NAMESPACE and directive["Metrics"][0]["Name"] == "Claims"
    assert doc["Claims"] == [3.0] and doc["lane"] == "PAID_SHARED" and doc["service"] == mc.SERVICE


def test_prometheus_names_follow_the_conventions():
    assert prometheus.prometheus_name(mc.CLAIMS) == "aivedio_claims"  # the sample is aivedio_claims_total
    assert prometheus.prometheus_name(mc.OLDEST_WAIT_SECONDS) == "aivedio_oldest_wait_seconds"
    assert prometheus.prometheus_name(mc.PROVIDER_UTILISATION) == "aivedio_provider_utilisation_ratio"
    assert prometheus.prometheus_name(mc.SUBMIT_UNKNOWN_RESOLVED) == "aivedio_submit_unknown_resolved"
    assert prometheus.metrics_response("/v1/tasks") is None
    assert prometheus.metrics_response("/metrics", "192.168.1.20")[0] == 403
    # A loopback client asking for another site's name: a page rebound to 127.0.0.1 (DNS rebinding).
    for host in ("evil.example", "evil.example:8080", "127.0.0.1.evil.example", "[2001:db8::1]:80"):
        assert prometheus.metrics_response("/metrics", "127.0.0.1", host)[0] == 403, host
    for host in ("localhost:8080", "127.0.0.1:8080", "[::1]:8080", "LOCALHOST", None):
        assert prometheus.metrics_response("/metrics", "127.0.0.1", host)[0] == 200, host


def _scrape(url: str) -> dict[str, dict]:
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _value(families, family: str, sample: str, **labels) -> float:
    return sum(s.value for s in families[family].samples if s.name == sample and s.labels == labels)


def test_work_moves_the_counters_served_on_metrics(platform):
    def api(event, context):  # never reached: /metrics is answered before the handler
        raise AssertionError(event["path"])

    server = LambdaHttpServer(("127.0.0.1", 0), api)
    server.start()
    try:
        before = _scrape(server.url)
        with platform.db.connection() as conn:
            ensure_platform_pools(conn, platform.config)
        t = new_tenant(platform, **UNCAPPED)
        submit(platform, t.tenant_id, t.user_id, n=3)
        assert Scheduler(platform).tick(5.0).claims == 3
        publish(mc.PROVIDER_UTILISATION, 50.0, provider="provider-x")
        publish(mc.PROVIDER_UTILISATION, 25.0, provider="provider-x")
        after = _scrape(server.url)
    finally:
        server.stop()
    assert before["aivedio_claims"].type == "counter" and after["aivedio_queue_depth_units"].type == "gauge"
    claims = [_value(f, "aivedio_claims", "aivedio_claims_total", lane="PAID_SHARED") for f in (before, after)]
    assert claims[1] - claims[0] == 3
    admitted = [_value(f, "aivedio_admissions_accepted", "aivedio_admissions_accepted_total") for f in (before, after)]
    assert admitted[1] - admitted[0] == 3
    # a gauge is its last value, in base units (a ratio, not percent)
    assert _value(after, "aivedio_provider_utilisation_ratio", "aivedio_provider_utilisation_ratio",
                  provider="provider-x") == 0.25
    assert metrics.snapshot()["Claims|lane=PAID_SHARED"] >= 3  # the local snapshot keeps its keys
    # each claim is one observation of the queue-wait histogram, in cumulative buckets
    waits = [_value(f, "aivedio_queue_wait_seconds", "aivedio_queue_wait_seconds_count", lane="PAID_SHARED")
             for f in (before, after)]
    assert waits[1] - waits[0] == 3
    assert after["aivedio_queue_wait_seconds"].type == "histogram"
    inf = _value(after, "aivedio_queue_wait_seconds", "aivedio_queue_wait_seconds_bucket", lane="PAID_SHARED", le="+Inf")
    assert inf == waits[1]
    # the tick's gauges: queued tasks and units, units in use and utilisation per lane
    assert "aivedio_queue_depth_tasks" in after and "aivedio_lane_utilisation_ratio" in after


def test_a_scrape_merges_every_serve_process(tmp_path, monkeypatch):
    """Under `serve --api-workers N` any worker answers /metrics: it adds the other processes'
    counters and histograms to its own and takes each gauge's latest value."""
    other = {"series": [["Claims", [["lane", "STANDARD"]], 5.0, None],
                        ["QueueDepthTasks", [["lane", "STANDARD"]], 7.0, 4102444800.0]],  # set "later" than ours
             "histograms": [["QueueWaitSeconds", [["lane", "STANDARD"]], [1.0] + [0.0] * 11 + [0.5]]]}
    (tmp_path / "999999.json").write_text(json.dumps(other))
    (tmp_path / "999998.json").write_text("{not json")  # one being replaced right now is skipped
    monkeypatch.setattr(prometheus, "_share_dir", str(tmp_path))
    base = {f.name: f for f in text_string_to_metric_families(prometheus.render().decode())}
    publish(mc.CLAIMS, 2, lane="STANDARD")
    publish(mc.QUEUE_DEPTH_TASKS, 3, lane="STANDARD")
    merged = {f.name: f for f in text_string_to_metric_families(prometheus.render().decode())}
    assert _value(merged, "aivedio_claims", "aivedio_claims_total", lane="STANDARD") == \
        _value(base, "aivedio_claims", "aivedio_claims_total", lane="STANDARD") + 2
    assert _value(base, "aivedio_claims", "aivedio_claims_total", lane="STANDARD") >= 5  # the other file's 5
    assert _value(merged, "aivedio_queue_depth_tasks", "aivedio_queue_depth_tasks", lane="STANDARD") == 7
    assert _value(merged, "aivedio_queue_wait_seconds", "aivedio_queue_wait_seconds_bucket", lane="STANDARD",
                  le="1.0") >= 1
