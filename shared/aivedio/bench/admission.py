"""Admissions per second through the real HTTP path: several API processes (as Lambda runs several
instances), each the real `api` handler behind the local API Gateway adapter, on a scratch database
of the same PostgreSQL server that pgbench measures."""
from __future__ import annotations

import multiprocessing as mp
import uuid
from contextlib import contextmanager

import psycopg
from psycopg import sql

from aivedio.bench.http_load import run_load
from aivedio.bench.pgbench import with_database
from aivedio.bench.workers import join_or_kill
from aivedio.config import PlatformConfig, Settings

BODY = {"model": "video-model-x", "mode": "text_to_video", "prompt": "bench", "duration_seconds": 5, "resolution": "720p"}
# Tenants whose limits never bind, so the benchmark measures the admission path, not its rejections.
OPEN_LIMITS = dict(max_queued_tasks=1_000_000, max_queued_units=10_000_000, max_cost_per_minute=10**12, max_cost_per_day=10**12,
                   max_user_queued_tasks=1_000_000, max_user_queued_units=10_000_000, user_submit_rate_per_minute=10**7,
                   tenant_submit_rate_per_minute=10**7, max_wait_seconds=10**6)


def _api_worker(settings_json: str, out: mp.Queue, stop: mp.Event) -> None:
    from aivedio.context import build_platform, set_platform
    from aivedio.local.http_server import LambdaHttpServer
    from aivedio.local.runtime import API_HANDLER, load_handler

    settings = Settings.model_validate_json(settings_json)
    p = build_platform(settings, PlatformConfig(), pool_size=4)
    set_platform(p)
    server = LambdaHttpServer(("127.0.0.1", 0), load_handler(API_HANDLER), function_name="aivedio-api-bench")
    server.start()
    out.put(server.url)
    stop.wait()
    server.stop()
    p.close()


@contextmanager
def scratch_database(admin_url: str, prefix: str = "aivedio_bench_"):
    from aivedio.db.migrate import migrate

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


def bench_admission(admin_url: str, redis_url: str | None, *, workers: int, clients: int, seconds: float, tenants: int = 40) -> dict:
    from aivedio.admin.tenants import create_tenant
    from aivedio.context import build_platform

    prefix = f"bench{uuid.uuid4().hex[:6]}"
    with scratch_database(admin_url) as db_url:
        settings = Settings(database_url=db_url, redis_url=redis_url or "none", redis_prefix=prefix)
        p = build_platform(settings, PlatformConfig(), pool_size=2)
        try:
            keys = [create_tenant(p, name=f"bench-{i}", service_class="PAID_SHARED", weight=1 + i % 4, credits=10**9,
                                  policy_overrides=OPEN_LIMITS).api_key for i in range(tenants)]
            ctx = mp.get_context("spawn")
            q, stop = ctx.Queue(), ctx.Event()
            procs = [ctx.Process(target=_api_worker, args=(settings.model_dump_json(), q, stop)) for _ in range(workers)]
            for proc in procs:
                proc.start()
            try:
                urls = [q.get(timeout=120) for _ in procs]
                run_load(urls, keys, BODY, clients=clients, seconds=2)  # warm-up: connections, caches, plans
                sustained = run_load(urls, keys, BODY, clients=clients, seconds=seconds)
                half = run_load(urls, keys, BODY, clients=clients, seconds=seconds,
                                rate_total=max(1.0, sustained["accepted_per_second"] / 2))
            finally:
                stop.set()
                join_or_kill(procs)
            with p.db.connection() as conn:
                # Every accepted request must have reserved exactly once: the benchmark checks itself.
                row = conn.execute("""select (select count(*) from generation_task) as tasks,
                                             (select count(*) from ledger_transaction where event_type = 'RESERVE') as reserves""").fetchone()
        finally:
            if p.cache is not None:
                p.cache.delete_prefix()
            p.close()
    return {"workers": workers, "clients": clients, "tenants": tenants,
            "sustained": sustained, "half_load": half,
            "tasks_written": row["tasks"], "reserves_written": row["reserves"]}
