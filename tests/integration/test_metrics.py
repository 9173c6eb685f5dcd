"""The dashboard's metrics (aivedio.metrics_catalog) are emitted: as EMF documents in Lambda, and
counted locally; the scheduler's gauges read what PostgreSQL holds."""
from __future__ import annotations

import json

from aivedio.metrics_catalog import NAMESPACE, SUBMIT_UNKNOWN
from aivedio.observability import metrics, publish
from aivedio.scheduling.gauges import publish_gauges, read_gauges
from aivedio.scheduling.resources import ensure_platform_pools
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import new_tenant
from tests.scheduler_support import UNCAPPED, submit


def test_publish_writes_emf_in_lambda_only(monkeypatch, capsys):
    monkeypatch.delenv("AWS_LAMBDA_FUNCTION_NAME", raising=False)
    publish(SUBMIT_UNKNOWN)
    assert "_aws" not in capsys.readouterr().out
    monkeypatch.setenv("AWS_LAMBDA_FUNCTION_NAME", "aivedio-dev-attempt_step")
    publish(SUBMIT_UNKNOWN, 2)
    [line] = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    doc = json.loads(line)
    [directive] = doc["_aws"]["CloudWatchMetrics"]
    assert directive["Namespace"] == NAMESPACE and directive["Metrics"][0]["Name"] == "SubmitUnknown"
    assert doc["SubmitUnknown"] == [2.0] and directive["Metrics"][0]["Unit"] == "Count"
    assert doc["service"] == "aivedio"


def test_gauges_read_queue_depth_oldest_wait_and_provider_utilisation(platform):
    with platform.db.connection() as conn:
        ensure_platform_pools(conn, platform.config)
    t = new_tenant(platform, **UNCAPPED)
    submit(platform, t.tenant_id, t.user_id, n=3)
    before = read_gauges(platform)
    lane = before["lanes"]["PAID_SHARED"]
    assert lane["queued_units"] == 3 and lane["queued_tasks"] == 3 and lane["oldest_wait_seconds"] >= 0
    assert lane["running_units"] == 0 and before["reserved_credits"] > 0  # admission reserved the quotes
    assert before["providers"]["provider-a"]["running"] == 0
    assert Scheduler(platform).tick(5.0).claims == 3
    after = publish_gauges(platform, force=True)
    safe = platform.config.lanes["PAID_SHARED"].capacity_units - platform.config.lanes["PAID_SHARED"].min_headroom_units
    assert after["lanes"]["PAID_SHARED"] == {"queued_tasks": 0, "queued_units": 0, "oldest_wait_seconds": 0.0,
                                             "running_units": 3, "borrowed_units": 0,
                                             "utilisation_percent": round(100.0 * 3 / safe, 1)}
    assert after["reserved_credits"] == before["reserved_credits"]  # held until settlement
    assert after["providers"]["provider-a"]["running"] == 3 and after["providers"]["provider-a"]["percent"] > 0
    assert metrics.snapshot()["QueueDepthUnits|lane=PAID_SHARED"] >= 0
