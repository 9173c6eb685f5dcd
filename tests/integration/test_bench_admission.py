"""A smoke test of the admission benchmarks (`aivedio bench --only admission`) at tiny sizes, on the
real PostgreSQL and Redis: the report's shape (in_process, http through the API workers, the
backends' CPU beside pgbench's, hot_wallet, the profile, each ratio a median with its spread), and
the self-check of every run, never the timings."""
from __future__ import annotations

import psycopg
import pytest

from aivedio_tools.bench.admission import DATABASE_PREFIX, bench_admission
from aivedio_tools.bench.rounds import alternate, spread
from tests.conftest import admin_url

pytestmark = pytest.mark.timeout(600)
SERIAL_LOCK = 0x41_56_42_41_44  # "AVBAD"


def _scratch() -> set[str]:
    with psycopg.connect(admin_url(), autocommit=True) as c:
        return {r[0] for r in c.execute("select datname from pg_database where starts_with(datname, %s)", (DATABASE_PREFIX,))}


def _is_spread(s: dict, rounds: int) -> None:
    assert set(s) == {"median", "min", "max", "values"} and len(s["values"]) == rounds
    assert s["median"] is not None and s["min"] <= s["median"] <= s["max"]


def test_the_admission_section(redis_url, monkeypatch):
    from aivedio import caching
    from aivedio.admission import service

    # The profile counts the statements of admissions; a per-process cache expiring among its 20 (a
    # loaded machine, the ANALYZE before them) would add its reload's. Long TTLs here: exact counts.
    monkeypatch.setattr(service, "POLICY_CACHE_SECONDS", 600.0)
    monkeypatch.setattr(caching, "CACHE_SECONDS", 600.0)
    # The leftover check compares every scratch database of this benchmark: runs of this test on
    # parallel workers must not overlap (each holds this advisory lock for its whole run).
    with psycopg.connect(admin_url(), autocommit=True) as lock:
        lock.execute("select pg_advisory_lock(%s)", (SERIAL_LOCK,))
        before = _scratch()
        r = bench_admission(admin_url(), redis_url, workers=2, clients=2, seconds=1.0, rounds=2, tenants=3, users=3,
                            pgbench_scale=1, profile_admissions=20)
        assert _scratch() <= before, "a scratch database was left behind"
    assert r["rounds"] == 2 and r["self_check"]["ok"] and r["self_check"]["failed"] == []
    assert r["self_check"]["runs"] == 2 + 2 + 2 * 2  # in process, http, hot and spread, per round
    for section, name in (("in_process", "ratio_vs_pgbench"), ("http", "ratio_vs_pgbench"), ("hot_wallet", "ratio_to_spread")):
        s = r[section]
        _is_spread(s["ratio_spread"], 2)
        assert s[name] == s["ratio_spread"]["median"] > 0
        assert len(s["rounds"]) == 2
    ip = r["in_process"]["rounds"][0]
    assert ip["admission"]["accepted"] > 0 and ip["admission"]["statuses"] == {"202": ip["admission"]["accepted"]}
    assert ip["pgbench"]["tps"] > 0 and ip["pgbench"]["transactions"] > 0
    http = r["http"]
    assert http["api_workers"] == 2 and http["half_load"]["p50_ms"] <= http["half_load"]["p99_ms"]
    assert set(http["rounds"][0]["admission"]["sustained"]["statuses"]) == {"202"}
    # The backends' CPU: both figures, or a note saying why not.
    if "pg_cpu_note" not in r:
        assert r["pg_cpu_ms_per_admission"] > 0 and r["pg_cpu_ms_per_tpcb_txn"] > 0 and r["pg_cpu_ratio"] > 0
    assert r["hot_wallet"]["hot_accepted_per_second"]["median"] > 0
    assert r["hot_wallet"]["hot_paths"]["slot"] > 0  # the hot wallet is partitioned: its users admit through slots
    prof = r["profile"]
    assert prof["pg_round_trips"] == 1 and prof["pg_statements"] == 1 and prof["redis_round_trips"] == 1


def test_rounds_alternate_and_report_the_median_with_its_spread():
    order: list[str] = []
    figures = iter([10.0, 30.0, 20.0])
    got = alternate(lambda i: order.append(f"bench{i}") or {"v": next(figures)}, lambda i: order.append(f"base{i}") or {"v": 10.0},
                    rounds=3, figure=lambda r: r["v"], baseline_figure=lambda r: r["v"])
    assert order == ["bench0", "base0", "bench1", "base1", "bench2", "base2"]
    assert got["ratio"] == {"median": 2.0, "min": 1.0, "max": 3.0, "values": [1.0, 3.0, 2.0]}
    assert spread([None, 2.0]) == {"median": 2.0, "min": 2.0, "max": 2.0, "values": [None, 2.0]}
