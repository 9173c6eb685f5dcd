"""What the benchmarks share: a scratch database of their own, tenant policies and capacities that
never bind (so a benchmark measures its path, not its refusals), and a percentile."""
from __future__ import annotations

import uuid
from contextlib import contextmanager

import psycopg
from psycopg import sql

from aivedio.db.migrate import migrate
from aivedio_tools.bench.pgbench import with_database

# Tenants whose limits never bind, so the benchmark measures the admission path, not its rejections.
OPEN_LIMITS = dict(max_queued_tasks=1_000_000, max_queued_units=10_000_000, max_cost_per_minute=10**12, max_cost_per_day=10**12,
                   max_user_queued_tasks=1_000_000, max_user_queued_units=10_000_000, user_submit_rate_per_minute=10**7,
                   tenant_submit_rate_per_minute=10**7, max_wait_seconds=10**6)
# The scheduler's and the latency benchmark's scratch databases, and each run's Redis keys
# ({SCHEDULER_REDIS_PREFIX}{hex}:...).
SCHEDULER_DATABASE_PREFIX = "aivedio_bench_sched_"
SCHEDULER_REDIS_PREFIX = "benchsched"
CAP = 10**9  # capacities that never bind (pool capacity columns are bigint; config fields are ints)


@contextmanager
def scratch_database(admin_url: str, prefix: str = "aivedio_bench_"):
    """A migrated database of its own, dropped afterwards."""
    name = f"{prefix}{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url, autocommit=True) as c:
        c.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    url = with_database(admin_url, name)
    try:
        migrate(url)
        yield url
    finally:
        with psycopg.connect(admin_url, autocommit=True) as c:
            c.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]
