"""A smoke test of the scheduler benchmarks (`aivedio bench --only scheduler`): each benchmark
function at tiny sizes, on the real PostgreSQL and Redis. It checks the report's shape and that the
claims it reports happened in the database, never the timings (the latency benchmark: that its
figures exist and are sane, never how small they are)."""
from __future__ import annotations

import psycopg
import pytest
import redis

from aivedio_tools.bench.latency import pair_freed_slots, queue_was_deep
from psycopg.rows import dict_row

from aivedio_tools.bench.scheduler import bench_claims, bench_pick_cost, bench_queue_depth, seed_tasks, seed_tenants
from aivedio_tools.bench.scratch import SCHEDULER_DATABASE_PREFIX as DATABASE_PREFIX
from aivedio_tools.bench.scratch import SCHEDULER_REDIS_PREFIX as REDIS_PREFIX
from tests.conftest import admin_url, create_test_database, drop_test_database

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


def test_latency_on_the_local_runtime(redis_url, no_leftovers):
    from aivedio_tools.bench.latency import bench_latency

    r = bench_latency(admin_url(), redis_url, seconds=4.0, rate=10.0, clients=2, bound_slots=2, tenants=2)
    adm, freed = r["admission_to_submit"], r["freed_slot_to_next_submit"]
    for figure in (adm, freed, freed["from_release"]):
        assert figure["samples"] > 0
        assert 0 < figure["p50_ms"] <= figure["p99_ms"] <= figure["max_ms"]
    assert adm["accepted"] == adm["samples"] > 0 and adm["never_submitted"] == 0
    assert adm["statuses"] == {"202": adm["accepted"]} and freed["statuses"] == {"202": freed["accepted"]}
    # The bound account was the binding limit: full, never over, with work left queued.
    assert freed["account_peak"] == freed["bound_slots"] == 2
    assert freed["queued_at_end"] > 0 and freed["samples"] < freed["jobs_created"]
    assert set(adm["stages_p50_ms"]) == {"queued_event_relayed", "claimed", "dispatch_event_relayed", "submit_started",
                                         "provider_created"}
    assert r["loop_intervals_seconds"]["outbox-relay"] > 0 and r["loop_intervals_seconds"]["scheduler-tick"] > 0


def test_freed_slots_are_paired_first_freed_first_filled():
    # Two slots freed at 1.0 and 1.2 s, filled at 1.1 and 1.5 s; the first fill (0.0, 0.1) has no freed slot.
    assert pair_freed_slots([1.0, 1.2], [0.0, 0.1, 1.1, 1.5]) == pytest.approx([100.0, 300.0])
    # A slot freed while nothing was queued gives no sample, and the pairing goes on.
    assert pair_freed_slots([1.0, 1.2], [0.0, 0.1, 1.1, 1.5], lambda t: t > 1.1) == pytest.approx([300.0])
    deep = queue_was_deep(admitted=[0.0, 0.1, 0.2, 0.3], created=[0.05, 0.15], margin=1)
    assert not deep(0.1) and deep(0.3)


QUEUE_COUNTS = """
select 'user' as kind, tenant_id::text || '/' || user_id::text || '/' || queue_class as k, queued_tasks, queued_units
  from task_queue_usage where queued_tasks <> 0
union all
select 'shard', tenant_id::text || '/' || queue_class || '/' || shard, queued_tasks, queued_units
  from tenant_queue_usage where queued_tasks <> 0
order by 1, 2"""


def test_a_bulk_seed_counts_its_tasks_as_the_row_trigger_does():
    """The scheduler bench seeds a million tasks with their queue counters written once (the row
    trigger off for that insert): the counters must come out as the trigger keeps them."""
    counts = {}
    for bulk in (False, True):
        url = create_test_database(f"bench_seed_{int(bulk)}")
        try:
            with psycopg.connect(url, autocommit=True, row_factory=dict_row) as c:
                with c.transaction():
                    seed_tenants(c, 5)
                assert seed_tasks(c, 30, bulk=bulk) == 150
                assert seed_tasks(c, 2, key="again", bulk=bulk) == 10  # onto counters that exist already
                counts[bulk] = [(r["kind"], r["k"].split("/", 1)[1] if r["kind"] == "shard" else None, r["queued_tasks"],
                                 r["queued_units"]) for r in c.execute(QUEUE_COUNTS).fetchall()]
                trigger = c.execute("""select tgenabled from pg_trigger
                                        where tgname = 'generation_task_queue_usage_insert'""").fetchone()
                assert trigger["tgenabled"] == "O"  # switched back on
                assert sum(q for kind, _, q, _ in counts[bulk] if kind == "user") == 160
        finally:
            drop_test_database(url)
    # Tenants differ between the two databases: compare the counts per user and per shard of a lane.
    assert sorted(x[2:] for x in counts[True]) == sorted(x[2:] for x in counts[False])
