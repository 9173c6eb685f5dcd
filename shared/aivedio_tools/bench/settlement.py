"""Settlements per second (issue 6, "`aivedio bench` reports settlements per second against pgbench in
the same run"), on a scratch database of the same PostgreSQL server that pgbench measures.

Setup is bulk SQL: tenants through create_tenant (a wallet with one paid lot each), then per tenant
a block of SUCCEEDED tasks, each with its attempt, charge snapshot, credit reservation, lot
allocation and RESERVE ledger transaction, exactly the rows admission and the scheduler leave (the
ledger's balance triggers check them at commit). The measured path is the real one: W worker
processes (as W Lambda instances of functions/settlement) each feed the handler SQS batches of 10
TaskSucceeded envelopes and count the records it settled. The handler settles a batch in one
transaction (settle_many), and each settlement in it is the whole work: dedupe, wallet lock, locked
price and policy, SETTLE and RELEASE across lots, snapshot, provider cost on the attempt and as a
provider_cost_event, outbox. The benchmark then checks itself: one
SETTLE per settled task and every wallet's snapshot equal to its ledger."""
from __future__ import annotations

import json
import multiprocessing as mp
import time
import uuid
from datetime import datetime, timezone

from aivedio.admin.tenants import create_tenant
from aivedio.config import PlatformConfig, Settings
from aivedio.context import build_platform, set_platform
from aivedio.observability import logger
from aivedio.pricing import price_book
from aivedio_tools.bench.pgbench import pgbench_database, run_on
from aivedio_tools.bench.rounds import alternate, spread
from aivedio_tools.bench.scratch import scratch_database
from aivedio_tools.bench.workers import join_or_kill, raise_first_error
from aivedio_tools.local.handlers import load_handler
from aivedio_tools.local.lambda_context import FakeLambdaContext

DATABASE_PREFIX = "aivedio_bench_settle_"
BATCH = 10  # SQS's default batch size for a Lambda event source
PRICE = 70  # a 5 s 720p task under the default price book

SEED_TASKS = """
create temp table bench_task on commit drop as
select gen_random_uuid() as task_id, gen_random_uuid() as reservation_id, gen_random_uuid() as txn_id,
       gen_random_uuid() as attempt_id, g
  from generate_series(1, %(n)s) g;

insert into generation_task (task_id, tenant_id, user_id, queue_class, priority_band, base_priority_band, resource_class, state,
                             model_code, fairness_units, provider_slot_units, estimated_cost_units, policy_version, estimate_version,
                             idempotency_key, mode, duration_seconds, resolution, normalized_params, finished_at)
select task_id, %(tenant)s, %(user)s, 'PAID_SHARED', 2, 2, 'STANDARD', 'SUCCEEDED', 'video-model-x', 1, 1, 25, 1, 1,
       'bench-' || task_id, 'text_to_video', 5, '720p', %(params)s::jsonb, now()
  from bench_task;

insert into task_attempt (attempt_id, task_id, tenant_id, attempt_no, provider, provider_account, provider_request_key,
                          provider_job_id, state, model_code, estimated_cost_amount, estimated_cost_currency)
select attempt_id, task_id, %(tenant)s, 1, 'provider-a', 'account-01', 'bench:' || task_id, 'job-' || task_id, 'SUCCEEDED',
       'video-model-x', 0.25, 'USD'
  from bench_task;

insert into credit_reservation (reservation_id, tenant_id, wallet_id, task_id, quoted_amount, reserved_amount, state,
                                price_version_id, charge_policy_code)
select reservation_id, %(tenant)s, %(wallet)s, task_id, %(price)s, %(price)s, 'ACTIVE', %(pv)s, 'USAGE_BASED' from bench_task;

insert into reservation_allocation (reservation_id, lot_id, tenant_id, amount)
select reservation_id, %(lot)s, %(tenant)s, %(price)s from bench_task;

insert into generation_charge (task_id, tenant_id, price_version_id, normalized_params, quoted_amount, max_reserve_amount,
                               charge_policy_code)
select task_id, %(tenant)s, %(pv)s, %(params)s::jsonb, %(price)s, %(price)s, 'USAGE_BASED' from bench_task;

insert into ledger_transaction (ledger_txn_id, tenant_id, wallet_id, unit_code, business_key, event_type, task_id, reservation_id)
select txn_id, %(tenant)s, %(wallet)s, 'CREDIT', 'reserve:generation:' || task_id || ':v1', 'RESERVE', task_id, reservation_id
  from bench_task;

insert into ledger_entry (ledger_txn_id, tenant_id, wallet_id, lot_id, bucket, amount_delta, unit_code)
select txn_id, %(tenant)s, %(wallet)s, %(lot)s, b.bucket, b.delta, 'CREDIT'
  from bench_task, (values ('AVAILABLE', -%(price)s::bigint), ('RESERVED', %(price)s::bigint)) b(bucket, delta);

update wallet_account set available_amount = available_amount - %(n)s * %(price)s,
                          reserved_amount = reserved_amount + %(n)s * %(price)s where wallet_id = %(wallet)s;
update credit_lot set remaining_amount = remaining_amount - %(n)s * %(price)s,
                      reserved_amount = reserved_amount + %(n)s * %(price)s where lot_id = %(lot)s;
"""


def _envelope(task_id: str, tenant_id: str, attempt_id: str, seconds: str) -> str:
    now = datetime.now(timezone.utc).isoformat()
    payload = {"task_id": task_id, "tenant_id": tenant_id, "attempt_id": attempt_id, "state": "SUCCEEDED",
               "stage": "PROVIDER_SUCCEEDED", "provider": "provider-a", "provider_account": "account-01",
               "provider_job_id": f"job-{task_id}", "charge_id": f"ch-{task_id}", "provider_charged": True,
               "usage": {"seconds": seconds, "cost_amount": "0.2000", "currency": "USD"}, "output_seconds": 5,
               "error_code": None, "finished_at": now}
    return json.dumps({"event_id": str(uuid.uuid4()), "event_type": "TaskSucceeded", "version": 1,
                       "aggregate_type": "generation_task", "aggregate_id": task_id, "tenant_id": tenant_id, "payload": payload,
                       "created_at": now})


def _worker(settings_json: str, tasks: list[tuple[str, str, str]], seconds: float, ready, go, out) -> None:
    """One Lambda instance of the settlement function: SQS batches through the real handler until
    the time is up or its tasks run out."""
    try:
        lambda_handler = load_handler("functions.settlement.handler")

        p = build_platform(Settings.model_validate_json(settings_json), PlatformConfig(), pool_size=1)
        set_platform(p)
        ctx = FakeLambdaContext("aivedio-settlement-bench")
        # Every third task ran shorter than quoted: a partial settle with a release; the others settle in full.
        bodies = [_envelope(t, ten, a, "3.5" if i % 3 == 0 else "5.0") for i, (t, ten, a) in enumerate(tasks)]
        warm = [{"messageId": str(uuid.uuid4()), "receiptHandle": "r", "body": b, "attributes": {}, "messageAttributes": {},
                 "md5OfBody": "", "eventSource": "aws:sqs", "eventSourceARN": "arn:aws:sqs:local:1:bench", "awsRegion": "local"}
                for b in bodies[:BATCH]]
        lambda_handler({"Records": warm}, ctx)  # connections, imports, plans
        bodies = bodies[BATCH:]
        ready.put("ok")
        go.wait()
        settled = failed = 0
        cpu0, t0 = time.process_time(), time.perf_counter()
        i = 0
        while i < len(bodies) and time.perf_counter() - t0 < seconds:
            batch = bodies[i:i + BATCH]
            i += len(batch)
            event = {"Records": [{"messageId": str(n), "receiptHandle": "r", "body": b, "attributes": {}, "messageAttributes": {},
                                  "md5OfBody": "", "eventSource": "aws:sqs", "eventSourceARN": "arn:aws:sqs:local:1:bench",
                                  "awsRegion": "local"} for n, b in enumerate(batch)]}
            bad = len(lambda_handler(event, ctx).get("batchItemFailures", []))
            settled += len(batch) - bad
            failed += bad
        elapsed = time.perf_counter() - t0
        out.put({"settled": settled, "failed": failed, "elapsed": elapsed, "cpu": time.process_time() - cpu0,
                 "exhausted": i >= len(bodies)})
        p.close()
    except BaseException as e:  # tell the parent instead of leaving it waiting
        ready.put(f"error: {e!r}")
        out.put({"error": repr(e)})
        raise


def bench_settlement(admin_url: str, *, workers: int, seconds: float, tenants: int = 64, tasks: int | None = None) -> dict:
    """Settlements per second with `workers` processes for `seconds`."""
    tasks = tasks or max(2000, int(1200 * seconds * workers / 2))  # more than the workers can settle in the time
    per_tenant = -(-tasks // tenants)
    with scratch_database(admin_url, prefix=DATABASE_PREFIX) as db_url:
        settings = Settings(database_url=db_url, redis_url="none")
        p = build_platform(settings, PlatformConfig(), pool_size=2)
        try:
            t_setup = time.perf_counter()
            made = [create_tenant(p, name=f"bench-{i}", service_class="PAID_SHARED", weight=1, credits=10**12)
                    for i in range(tenants)]
            params = json.dumps({"model": "video-model-x", "mode": "text_to_video", "resolution": "720p", "with_audio": False,
                                 "duration_seconds": 5})
            with p.db.connection() as conn:
                pv = price_book.ensure_price_book(conn, p.config, datetime.now(timezone.utc))
                for t in made:
                    lot = conn.execute("select lot_id from credit_lot where wallet_id = %s", (t.wallet_id,)).fetchone()["lot_id"]
                    args = {"n": per_tenant, "tenant": t.tenant_id, "user": t.user_id, "wallet": t.wallet_id, "lot": lot, "pv": pv,
                            "price": PRICE, "params": params}
                    with conn.transaction():
                        for statement in SEED_TASKS.split(";\n"):
                            if statement.strip():
                                conn.execute(statement, args)
                conn.execute("vacuum analyze")
                rows = conn.execute("select c.task_id, c.tenant_id, a.attempt_id from credit_reservation c join task_attempt a using (task_id)"
                                    " order by c.task_id").fetchall()
            setup_s = round(time.perf_counter() - t_setup, 1)
            logger.info("bench settlement: seeded", extra={"tasks": len(rows), "tenants": tenants, "seconds": setup_s})
            shares = [[(str(r["task_id"]), str(r["tenant_id"]), str(r["attempt_id"])) for r in rows[i::workers]]
                      for i in range(workers)]
            ctx = mp.get_context("spawn")
            ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
            procs = [ctx.Process(target=_worker, args=(settings.model_dump_json(), share, seconds, ready, go, out))
                     for share in shares]
            for proc in procs:
                proc.start()
            try:
                for _ in procs:
                    status = ready.get(timeout=180)
                    if status != "ok":
                        raise RuntimeError(f"settlement bench worker failed: {status}")
                go.set()
                results = [out.get(timeout=seconds + 180) for _ in procs]
            finally:
                go.set()
                join_or_kill(procs)
            raise_first_error(results, "settlement bench worker")
            with p.db.connection() as conn:
                check = conn.execute(
                    """select (select count(*) from ledger_transaction where event_type = 'SETTLE') as settles,
                              (select count(*) from generation_charge where finalized_at is not null) as finalized,
                              (select count(*) from provider_cost_event) as cost_events,
                              (select count(*) from wallet_account w where (w.available_amount, w.reserved_amount, w.consumed_amount)
                                  <> (select coalesce(sum(amount_delta) filter (where bucket = 'AVAILABLE'), 0),
                                             coalesce(sum(amount_delta) filter (where bucket = 'RESERVED'), 0),
                                             coalesce(sum(amount_delta) filter (where bucket = 'CONSUMED'), 0)
                                        from ledger_entry e where e.wallet_id = w.wallet_id)) as wallets_off""").fetchone()
        finally:
            p.close()
    settled = sum(r["settled"] for r in results)
    elapsed = max(r["elapsed"] for r in results)
    return {"workers": workers, "seconds": seconds, "tenants": tenants, "tasks_seeded": len(rows), "setup_seconds": setup_s,
            "batch": BATCH, "settled": settled, "failed": sum(r["failed"] for r in results),
            "settlements_per_second": round(settled / elapsed, 1) if elapsed else None,
            "worker_cpu_ms_per_settlement": round(1000 * sum(r["cpu"] for r in results) / settled, 2) if settled else None,
            "ran_out_of_tasks": any(r["exhausted"] for r in results),
            # Warm-up batches are settled too: the database holds the measured ones plus one batch per worker.
            "checked_in_db": {"settles": check["settles"], "finalized": check["finalized"], "cost_events": check["cost_events"],
                              "expected": settled + workers * BATCH, "wallets_off_ledger": check["wallets_off"]}}


def bench_settlement_rounds(admin_url: str, *, workers: int, seconds: float, rounds: int = 3) -> dict:
    """bench_settlement, then pgbench tpcb-like with as many clients on the same server, `rounds`
    times; the ratio is the median of the rounds' ratios, its spread beside it. The other figures
    are the last round's."""
    with pgbench_database(admin_url) as pg_url:
        got = alternate(lambda i: bench_settlement(admin_url, workers=workers, seconds=seconds),
                        lambda i: run_on(admin_url, pg_url, clients=workers, seconds=seconds),
                        rounds=rounds, figure=lambda r: r.get("settlements_per_second"), baseline_figure=lambda r: r.get("tps"))
    last = got["rounds"][-1]
    return {**last["bench"], "baseline_pgbench_tpcb_like": last["baseline"], "ratio_vs_pgbench": got["ratio"]["median"],
            "ratio_spread": got["ratio"], "target_ratio": 0.5, "rounds": rounds,
            "settlements_per_second_rounds": spread([r["bench"].get("settlements_per_second") for r in got["rounds"]], 1),
            "pgbench_tps_rounds": spread([r["baseline"].get("tps") for r in got["rounds"]], 1),
            "rounds_note": "the other figures are the last round's"}
