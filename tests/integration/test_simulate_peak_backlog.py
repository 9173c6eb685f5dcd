"""`aivedio simulate --scenario peak-backlog` (issue 19 item 5): ch. 18.17's capacity example through
the real admission, the real scheduler and the simulated provider, at 1/5 of its counts, against
Little's law. The run is the one the CLI makes (`run_scenario` with the scenario's defaults: DRR
only) and takes about a minute on two cores, so the tests that read it are marked slow; the
arithmetic and the check's edges are tested without a database."""
from __future__ import annotations

import io
import json

import pytest

from aivedio_tools.simulate import build, run_scenario
from aivedio_tools.simulate.checks import against_prediction
from aivedio_tools.cli.simulate import _summary
from aivedio_tools.simulate.scenarios import littles_law
from tests.conftest import admin_url


def test_littles_law_gives_the_books_figures_at_full_size():
    """18.17.1-18.17.3: 8 x 150 = 1,200 in flight; 1,500 / 150 = 10/s; (12 - 10) x 300 = 600 tasks;
    600 / (10 - 8) = 300 s."""
    p = littles_law(steady_rate=8, peak_rate=12, peak_seconds=300, mean_runtime=150, safe_slots=2000 * 0.75)
    assert p["steady_in_flight"] == 1200
    assert p["safe_throughput_per_second"] == 10
    assert p["recovery_headroom_per_second"] == 2
    assert p["backlog_tasks"] == 600
    assert p["drain_seconds"] == 300
    assert (p["steady_slot_utilisation"], p["peak_slot_utilisation"]) == (0.8, 1.0)
    # 18.17.3's warning: a steady rate at the safe throughput never drains the backlog.
    assert littles_law(10, 12, 300, 150, 1500)["drain_seconds"] is None
    assert littles_law(8, 9, 300, 150, 1500)["backlog_tasks"] == 0  # a peak under capacity queues nothing


def test_the_scenario_keeps_the_ratios_at_its_scale():
    sc = build("peak-backlog")
    k = sc.parameters["scale"]
    pred, full = sc.focus["prediction"], sc.focus["prediction_full_scale"]
    assert (full["backlog_tasks"], full["drain_seconds"]) == (600, 300)
    assert pred["backlog_tasks"] == full["backlog_tasks"] / k
    assert pred["drain_seconds"] == full["drain_seconds"]
    assert sc.parameters["provider_slots"] == 1500 // k
    assert sc.policies == ("drr",)
    assert len(sc.runtime_draws) == len(sc.arrivals)


def test_the_check_wants_every_figure_within_the_tolerance():
    pred = {"backlog_tasks": 120, "drain_seconds": 300}
    assert against_prediction({"backlog_tasks": 100, "drain_seconds": 240}, pred, 0.25)["ok"]
    miss = against_prediction({"backlog_tasks": 100, "drain_seconds": 200}, pred, 0.25)
    assert not miss["ok"] and miss["figures"]["drain_seconds"]["error"] == pytest.approx(1 / 3, abs=1e-3)
    # Not drained within the run: a miss, not a pass.
    assert not against_prediction({"backlog_tasks": 120, "drain_seconds": None}, pred, 0.25)["ok"]


@pytest.fixture(scope="module")
def doc(redis_url):
    return run_scenario("peak-backlog", admin_url=admin_url(), redis_url=redis_url)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_backlog_builds_and_drains_as_littles_law_predicts(doc):
    assert set(doc["runs"]) == {"drr"}
    run = doc["runs"]["drr"]
    fo = run["focus"]
    m, pred, tol = fo["measured"], fo["prediction"], doc["parameters"]["tolerance"]
    assert tol == 0.25
    assert abs(m["peak_backlog_tasks"] - pred["backlog_tasks"]) <= tol * pred["backlog_tasks"], m
    assert m["drain_seconds"] is not None
    assert abs(m["drain_seconds"] - pred["drain_seconds"]) <= tol * pred["drain_seconds"], m
    assert fo["check"]["ok"], fo["check"]
    target = next(t for t in doc["targets"] if t["name"] == "backlog_and_drain_match_littles_law[drr]")
    assert target["met"] is True
    # The backlog peaks near the end of the peak and nothing queues at steady state.
    assert m["steady_level"] == 0
    assert fo["phases"]["peak_start"] < m["peak_backlog_at"] <= fo["phases"]["peak_end"] + 30
    # The slots the book assumes full are full while work is queued, and steady in-flight is L = lambda x W.
    assert m["slot_utilisation_while_backlogged"] >= 0.99
    assert m["slot_utilisation_during_peak"] >= 0.95
    assert m["steady_in_flight_mean"] == pytest.approx(pred["steady_in_flight"], rel=0.05)
    assert m["in_flight_max"] == fo["provider_slots"]
    failed = {k: v for k, v in run["invariants"].items() if not v["ok"]}
    assert not failed, failed
    assert all(t["met"] for t in doc["targets"]), doc["targets"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_report_carries_the_backlog_series_and_reads_as_text(doc, monkeypatch):
    fo = doc["runs"]["drr"]["focus"]
    s = fo["backlog_series"]
    assert s["sample_seconds"] == doc["parameters"]["sample_seconds"]
    assert len(s["t"]) == len(s["queued"]) == len(s["in_flight"]) > 100
    assert max(s["queued"]) <= fo["measured"]["peak_backlog_tasks"]
    assert s["queued"][0] == 0 and s["queued"][-1] == 0
    json.loads(json.dumps(doc, default=str))  # what --json prints
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    _summary(doc)
    text = out.getvalue()
    assert "Little's law (ch. 18.17)" in text and "600 at full size" in text
    assert "drain after the peak: 300 s" in text
