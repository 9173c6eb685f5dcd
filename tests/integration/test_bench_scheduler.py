"""A smoke test of the scheduler benchmarks (`aivedio bench --only scheduler`): each benchmark
function at tiny sizes, on the real PostgreSQL and Redis. It checks the report's shape and that the
claims it reports happened in the database, never the timings."""
from __future__ import annotations

import psycopg
import pytest
import redis

from aivedio.bench.scheduler import DATABASE_PREFIX, REDIS_PREFIX, bench_claims, bench_pick_cost, bench_queue_depth
from tests.conftest import admin_url

# The leftover check compares every scratch database of these benchmarks, so the tests must not
# overlap one another on parallel workers: each holds this advisory lock for its whole run.
SERIAL_LOCK = 0x41_56_42_53_43  # "AVBSC"


def _leftovers(redis_url: str) -> tuple[set[str], set[str]]:
    with psycopg.connect(admin_url(), autocommit=True) as c:
        dbs = {r[0] for r in c.execute("select datname from pg_database where starts_with(datname, %s)", (DATABASE_PREFIX,))}
    r = redis.Redis.from_url(redis_url)
    try:
        keys = set(r.scan_iter(match=f"{REDIS_PREFIX}*", count=1000))
    finally:
        r.close()
    return dbs, keys


@pytest.fixture
def no_leftovers(redis_url):
    """Scratch databases and Redis keys are dropped when a benchmark ends."""
    with psycopg.connect(admin_url(), autocommit=True) as lock:
        lock.execute("select pg_advisory_lock(%s)", (SERIAL_LOCK,))
        before_dbs, before_keys = _leftovers(redis_url)
        yield
        dbs, keys = _leftovers(redis_url)
        assert dbs <= before_dbs, "a scratch database was left behind"
        assert keys <= before_keys, "Redis keys were left behind"


def test_claims_per_second_with_several_scheduler_processes(redis_url, no_leftovers):
    r = bench_claims(admin_url(), redis_url, workers=2, seconds=1.0, tenants=4, tasks_per_tenant=300, warm=0.3)
    assert r["workers"] == 2 and len(r["per_worker"]) == 2
    assert r["claims"] > 0 and r["visits"] > 0 and r["claims_per_second"] > 0
    assert set(r["cpu_per_claim"]) == {"scheduler_process_ms", "postgres_backend_ms"}
    # Every claim a worker reported is an attempt in the database, with its reservations and its event.
    assert r["measured_in_db"]["attempts"] == r["claims"]
    after = r["db_after"]
    assert after["attempts"] == after["dispatching"] == after["dispatch_events"] >= r["claims"]
    assert after["reservations"] >= after["attempts"]
    assert after["queued"] == 4 * 300 - after["attempts"]
    assert r["measured_in_db"]["deadlocks"] == 0


def test_pick_cost(redis_url, no_leftovers):
    r = bench_pick_cost(admin_url(), redis_url, sizes=(2, 5), picks=6, warm=2)
    assert set(r["sizes"]) == {"2", "5"} and r["ring"] == "redis"
    for n, s in r["sizes"].items():
        assert s["picks"] == 6 and 0 < s["median_us"] <= s["p90_us"]
        # One claim per pick (warm-up included), and each claimed task was replaced: one queued task per tenant.
        assert s["db"]["attempts"] == s["db"]["dispatching"] == 8
        assert s["db"]["queued"] == int(n)
    assert set(r["ratios"]) == {"median_5_vs_2", "p90_5_vs_2"}


def test_pick_cost_on_the_postgresql_ring(no_leftovers):
    r = bench_pick_cost(admin_url(), None, sizes=(3,), picks=4, warm=1)
    assert r["ring"] == "postgresql" and r["sizes"]["3"]["db"]["attempts"] == 5


def test_claim_rate_against_queue_depth(redis_url, no_leftovers):
    r = bench_queue_depth(admin_url(), redis_url, tenants=4, small=200, large=800, claims=8, budget=0.05)
    assert r["small"]["queued"] == 200 and r["large"]["queued"] == 800
    for k in ("small", "large"):
        assert r[k]["claims"] >= 8 and r[k]["claims_per_second"] > 0
        assert r[k]["measured_in_db"]["attempts"] == r[k]["claims"]
        assert r[k]["db_after"]["dispatching"] == r[k]["db_after"]["attempts"]
    assert r["ratio_large_vs_small"] > 0
