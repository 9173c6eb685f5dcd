"""The bench's summary reads each section's figures and targets where the section states them."""
from __future__ import annotations

from aivedio_tools.bench.summary import summarise


def test_every_stated_target_is_summarised_met_or_missed():
    report = {
        "admission": {"targets": {"in_process_ratio_vs_pgbench": 0.3, "http_ratio_vs_pgbench": 0.2, "half_load_p99_ms": 15.0,
                                  "pg_cpu_ratio_max": 2.5, "hot_wallet_ratio_to_spread": 0.8},
                      "in_process": {"ratio_vs_pgbench": 0.25}, "http": {"ratio_vs_pgbench": 0.21, "half_load": {"p99_ms": 20.9}},
                      "pg_cpu_ratio": 3.7, "hot_wallet": {"ratio_to_spread": 0.93}},
        "settlement": {"ratio_vs_pgbench": 0.6, "target_ratio": 0.5},
        "scheduler": {"claims": {"ratio_vs_pgbench": 0.4, "target_ratio": 0.5},
                      "pick": {"ratios": {"median_1000_vs_10": 1.2, "p90_1000_vs_10": 1.7}, "target_ratio_max": 1.5},
                      "depth": {"ratio_large_vs_small": 0.9, "target_ratio_min": 0.8}},
    }
    s = summarise(report)
    got = {r["figure"]: r["met"] for r in s["figures"]}
    assert got == {"admission.in_process.ratio_vs_pgbench": False, "admission.http.ratio_vs_pgbench": True,
                   "admission.http.half_load.p99_ms": False, "admission.pg_cpu_ratio": False,
                   "admission.hot_wallet.ratio_to_spread": True, "settlement.ratio_vs_pgbench": True,
                   "scheduler.claims.ratio_vs_pgbench": False, "scheduler.pick.ratios.median_1000_vs_10": True,
                   "scheduler.pick.ratios.p90_1000_vs_10": False, "scheduler.depth.ratio_large_vs_small": True}
    assert (s["met"], s["missed"], s["unmeasured"]) == (5, 5, 0)


def test_a_section_not_run_or_a_figure_not_measured_is_said_so():
    s = summarise({"admission": {"targets": {"in_process_ratio_vs_pgbench": 0.3}, "in_process": {}}})
    assert [r["met"] for r in s["figures"]] == [None] * 5 and s["unmeasured"] == 5
    assert summarise({})["figures"] == []
