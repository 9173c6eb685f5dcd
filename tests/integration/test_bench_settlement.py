"""A smoke test of the settlement benchmark (`aivedio bench --only settlement`) at a tiny size, on the
real PostgreSQL: the report's shape, and that what it reports settled is in the database (one SETTLE
per settled task, every wallet equal to its ledger). Never the timings."""
from __future__ import annotations

import psycopg
import pytest

from aivedio_tools.bench.settlement import DATABASE_PREFIX, bench_settlement
from tests.conftest import admin_url

pytestmark = pytest.mark.timeout(300)


def _scratch() -> set[str]:
    with psycopg.connect(admin_url(), autocommit=True) as c:
        return {r[0] for r in c.execute("select datname from pg_database where starts_with(datname, %s)", (DATABASE_PREFIX,))}


def test_settlements_per_second_with_two_worker_processes():
    before = _scratch()
    r = bench_settlement(admin_url(), workers=2, seconds=1.0, tenants=4, tasks=400)
    assert r["workers"] == 2 and r["tasks_seeded"] == 400 and r["failed"] == 0
    assert r["settled"] > 0 and r["settlements_per_second"] > 0
    db = r["checked_in_db"]
    assert db["settles"] == db["finalized"] == db["cost_events"] == db["expected"] == r["settled"] + 2 * r["batch"]
    assert db["wallets_off_ledger"] == 0
    assert _scratch() <= before, "the scratch database was left behind"
