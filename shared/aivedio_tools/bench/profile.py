"""Where one admission's time goes: admit() called sequentially in this process, with every
PostgreSQL message traced (libpq's trace) and every Redis command counted and timed.

- statements: the simple-protocol queries and extended-protocol executes sent (BEGIN and COMMIT
  counted apart, as `transaction_commands`);
- round trips: each burst of messages to the server followed by its answers (a pipeline's batch is
  one);
- pg_wait_ms / redis_wait_ms: time spent waiting on the server (network and its work), and
  python_ms: the rest of admit()'s wall time.
The figures are per admission, averaged over `n` admissions of one tenant, after a warm-up."""
from __future__ import annotations

import os
import statistics
import tempfile
import time
import uuid
from contextlib import contextmanager

import psycopg

from aivedio.admin.tenants import create_tenant
from aivedio.admission.models import GenerationRequest
from aivedio.admission.service import admit
from aivedio.auth import Caller
from aivedio.config import PlatformConfig, Settings
from aivedio.context import build_platform
from aivedio_tools.bench.scratch import OPEN_LIMITS

BODY = {"model": "video-model-x", "mode": "text_to_video", "prompt": "bench", "duration_seconds": 5, "resolution": "720p"}


def count_trace(text: str) -> dict:
    """Statements, transaction commands and round trips in a libpq trace."""
    statements = tx_commands = round_trips = 0
    last = None
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) < 3:
            continue
        direction, kind = parts[0], parts[2]
        if direction == "F":
            if kind == "Query":
                q = parts[3].strip().strip('"').upper() if len(parts) > 3 else ""
                if q in ("BEGIN", "COMMIT", "ROLLBACK") or q.startswith(("SAVEPOINT", "RELEASE")):
                    tx_commands += 1
                else:
                    statements += 1
            elif kind == "Execute":
                statements += 1
        if direction == "B" and last == "F":
            round_trips += 1
        if direction in ("F", "B"):
            last = direction
    return {"statements": statements, "transaction_commands": tx_commands, "round_trips": round_trips}


@contextmanager
def _timed_waits(acc: dict):
    """Time every psycopg wait on the server (class-level, for this profile only)."""
    original = psycopg.Connection.wait

    def wait(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return original(self, *a, **k)
        finally:
            acc["pg"] += time.perf_counter() - t0

    psycopg.Connection.wait = wait
    try:
        yield
    finally:
        psycopg.Connection.wait = original


def profile_admission(db_url: str, redis_url: str | None, *, n: int = 200, warmup: int = 20) -> dict:
    """Per-admission statements, round trips and time split, on the scratch database `db_url`."""
    settings = Settings(database_url=db_url, redis_url=redis_url or "none", redis_prefix=f"prof{uuid.uuid4().hex[:6]}")
    p = build_platform(settings, PlatformConfig(), pool_size=1)  # one connection: every statement is traced
    try:
        t = create_tenant(p, name=f"profile-{uuid.uuid4().hex[:6]}", service_class="PAID_SHARED", weight=1, credits=10**9,
                          policy_overrides=OPEN_LIMITS, trusted=True)

        caller = Caller(t.tenant_id, t.user_id, "OWNER", None)
        req = GenerationRequest(**BODY)
        for i in range(warmup):
            admit(p, caller, req, BODY, f"warm-{i}")
        with p.db.connection() as conn:
            conn.execute("analyze")  # plans for the tables as they are now, not as the empty template was
        redis_calls = {"n": 0, "s": 0.0}
        if p.cache is not None:
            original_cmd = p.cache.r.execute_command

            def counted(*a, **k):
                t0 = time.perf_counter()
                try:
                    return original_cmd(*a, **k)
                finally:
                    redis_calls["n"] += 1
                    redis_calls["s"] += time.perf_counter() - t0

            p.cache.r.execute_command = counted
        fd, path = tempfile.mkstemp(prefix="aivedio-trace-")
        waits = {"pg": 0.0}
        walls: list[float] = []
        with p.db.connection() as conn:
            conn.pgconn.trace(fd)
            conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE)
        try:
            with _timed_waits(waits):
                for i in range(n):
                    t0 = time.perf_counter()
                    got = admit(p, caller, req, BODY, f"prof-{i}")
                    walls.append(time.perf_counter() - t0)
                    assert got.status == 202 and not got.replayed
        finally:
            with p.db.connection() as conn:
                conn.pgconn.untrace()
            os.close(fd)
        with open(path) as f:
            counts = count_trace(f.read())
        os.unlink(path)
        wall = sum(walls)
        per = {k: round(v / n, 2) for k, v in counts.items()}
        return {
            "admissions": n,
            "pg_statements": per["statements"],
            "pg_transaction_commands": per["transaction_commands"],
            "pg_round_trips": per["round_trips"],
            "redis_round_trips": round(redis_calls["n"] / n, 2),
            "latency_ms_mean": round(wall / n * 1000, 3),
            "latency_ms_p50": round(statistics.median(walls) * 1000, 3),
            "pg_wait_ms": round(waits["pg"] / n * 1000, 3),
            "redis_wait_ms": round(redis_calls["s"] / n * 1000, 3),
            "python_ms": round((wall - waits["pg"] - redis_calls["s"]) / n * 1000, 3),
        }
    finally:
        if p.cache is not None:
            p.cache.delete_prefix()
        p.close()
