"""Admission benchmarks (issue 15, part 5), each beside its baseline in alternating rounds
(aivedio_tools.bench.rounds), on scratch databases of the same PostgreSQL server that pgbench measures:

- in_process: admit() called directly from `workers` processes (no HTTP), closed loop, over
  `tenants` tenants with a wallet each; beside pgbench tpcb-like with as many clients;
- http: through `aivedio serve --api-workers N`'s own path (aivedio_tools.local.api_workers.ApiWorkers:
  N processes on one SO_REUSEPORT port), closed loop with `clients` keep-alive clients, then open
  loop at half the sustained rate for latency; beside pgbench with `clients` clients;
- pg_cpu_ms_per_admission beside pg_cpu_ms_per_tpcb_txn: the CPU time of the database's backends
  (aivedio_tools.bench.pgcpu) over the in-process runs and over the pgbench runs;
- hot_wallet: one tenant whose `users` users all spend one wallet, against the spread tenants (a
  wallet each), both in process with the same workers;
- profile: where one admission's time goes (aivedio_tools.bench.profile).

Every run starts from a clone of one seeded template (tenants, users, keys, credit), so queues and
ledgers never carry over from one run to the next, and checks itself afterwards: every accepted
request is a task that reserved exactly once, and nothing else was written."""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from aivedio.admin.tenants import create_tenant
from aivedio.admission.decisions import Rejected
from aivedio.admission.models import GenerationRequest
from aivedio.admission.service import admit
from aivedio.auth import Caller, issue_key
from aivedio.billing import allowances
from aivedio.cache.client import Cache
from aivedio.config import PlatformConfig, Settings
from aivedio.context import build_platform
from aivedio.events_routing import RELAY
from aivedio_tools.bench.http_load import run_load
from aivedio_tools.bench.pgbench import pgbench_database, run_on, with_database
from aivedio_tools.bench.pgcpu import BackendCpu, Vacuuming
from aivedio_tools.bench.profile import profile_admission
from aivedio_tools.bench.rounds import alternate, spread
from aivedio_tools.bench.scratch import OPEN_LIMITS, scratch_database
from aivedio_tools.bench.workers import get_or_fail, join_or_kill, quiet_children, raise_first_error
from aivedio_tools.local.api_workers import ApiWorkers

DATABASE_PREFIX = "aivedio_bench_adm_"
BODY = {"model": "video-model-x", "mode": "text_to_video", "prompt": "bench", "duration_seconds": 5, "resolution": "720p"}
CREDITS = 10**12
BENCH_PRICE = 70  # BODY's price under the default price book
HOT_CHUNK_TASKS = 64  # a slot's refill: credit for this many tasks
WARM_ADMISSIONS = 20  # per in-process worker, before the clock starts
HTTP_WARM_SECONDS = 2.0
# The rows every admission of a tenant updates in place (see bench.pgcpu.Vacuuming): a partitioned
# wallet's admissions update their slot's allowance instead of the wallet and its lot.
HOT_TABLES = ("wallet_account", "credit_lot", "tenant_cost_window", "task_queue_usage", "tenant_queue_usage",
              "wallet_allowance")
TARGETS = {"in_process_ratio_vs_pgbench": 0.3, "http_ratio_vs_pgbench": 0.2, "half_load_p99_ms": 15.0,
           "pg_cpu_ratio_max": 2.5, "hot_wallet_ratio_to_spread": 0.8}


@dataclass(frozen=True)
class Client:
    """One caller: who, and the API key that says so."""
    tenant_id: str
    user_id: str
    api_key: str


@dataclass(frozen=True)
class Seeded:
    template: str  # the seeded database every run clones
    spread: list[Client]  # one user of each of the spread tenants, a wallet each
    hot: list[Client]  # the users of the one hot tenant, one wallet


@contextmanager
def seeded_template(admin_url: str, *, tenants: int, users: int, hot_slots: int = 16):
    """The template: `tenants` tenants with a wallet each, and one tenant with `users` users on
    one wallet (partitioned into `hot_slots` slots; 0: not partitioned), every limit open and credit
    for far more than any run admits."""
    with scratch_database(admin_url, prefix=DATABASE_PREFIX + "tpl_") as url:
        p = build_platform(Settings(database_url=url, redis_url="none"), PlatformConfig(), pool_size=2)
        try:
            spread = []
            for i in range(tenants):
                t = create_tenant(p, name=f"bench-{i}", service_class="PAID_SHARED", weight=1 + i % 4, credits=CREDITS,
                                  policy_overrides=OPEN_LIMITS, trusted=True)
                spread.append(Client(str(t.tenant_id), str(t.user_id), t.api_key))
            big = create_tenant(p, name="bench-hot", service_class="PAID_SHARED", weight=1, credits=CREDITS,
                                policy_overrides=OPEN_LIMITS, trusted=True)
            hot = [Client(str(big.tenant_id), str(big.user_id), big.api_key)]

            def add_user(conn, n: int) -> Client:
                uid = conn.execute("insert into app_user (tenant_id, name, role) values (%s, %s, 'MEMBER') returning user_id",
                                   (big.tenant_id, f"member-{n}")).fetchone()["user_id"]
                return Client(str(big.tenant_id), str(uid), issue_key(conn, big.tenant_id, uid).secret)

            hot += [p.db.transaction(lambda c, n=n: add_user(c, n)) for n in range(1, users)]
            if hot_slots:
                # The hot wallet partitioned (billing.allowances): its users admit through slots.
                p.db.transaction(lambda conn: allowances.partition(conn, operator="bench", tenant_id=big.tenant_id,
                                                                   slots=hot_slots,
                                                                   chunk_amount=HOT_CHUNK_TASKS * BENCH_PRICE))
            with p.db.connection() as conn:
                conn.execute("vacuum analyze")
        finally:
            p.close()
        yield Seeded(dbname(url), spread, hot)


@contextmanager
def clone(admin_url: str, template: str):
    """A fresh copy of the template for one run; its URL. Dropped afterwards."""
    name = f"{DATABASE_PREFIX}{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url, autocommit=True) as c:
        c.execute(sql.SQL("create database {} template {}").format(sql.Identifier(name), sql.Identifier(template)))
    try:
        yield with_database(admin_url, name)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as c:
            c.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


SELF_CHECK = """
select count(*) as tasks, count(*) filter (where reserves = 1) as reserved_once,
       (select count(*) from ledger_transaction where event_type = 'RESERVE' and task_id is not null) as reserves,
       (select count(*) from idempotency_record) as records,
       (select count(*) from ledger_transaction where event_type = 'RESERVE' and task_id is not null
           and reason_code is null) as through_wallet,
       (select count(*) from ledger_transaction where reason_code = 'FROM_ALLOWANCE') as through_slots,
       (select count(*) from ledger_transaction where reason_code = 'ALLOWANCE') as slot_refills,
       (select count(*) from wallet_account w where (w.available_amount, w.reserved_amount, w.consumed_amount)
           <> (select coalesce(sum(amount_delta) filter (where bucket = 'AVAILABLE'), 0),
                      coalesce(sum(amount_delta) filter (where bucket = 'RESERVED'), 0),
                      coalesce(sum(amount_delta) filter (where bucket = 'CONSUMED'), 0)
                 from ledger_entry e where e.wallet_id = w.wallet_id)) as wallets_off_ledger,
       (select count(*) from wallet_account w where w.reserved_amount <>
           (select coalesce(sum(reserved_amount - settled_amount - released_amount), 0) from credit_reservation r
             where r.wallet_id = w.wallet_id)
           + (select coalesce(sum(amount), 0) from wallet_allowance a where a.wallet_id = w.wallet_id)) as wallets_off_reservations
  from (select t.task_id, (select count(*) from ledger_transaction l
                            where l.task_id = t.task_id and l.event_type = 'RESERVE') as reserves
          from generation_task t) x
"""


def self_check(url: str, accepted: int) -> dict:
    """Every accepted request is one task that reserved exactly once, with its idempotency record;
    every wallet's snapshot equals its ledger, and its reserved its reservations and allowances."""
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as c:
        r = c.execute(SELF_CHECK).fetchone()
    ok = (accepted == r["tasks"] == r["reserves"] == r["reserved_once"] == r["records"]
          and r["wallets_off_ledger"] == 0 and r["wallets_off_reservations"] == 0)
    return {"accepted": accepted, "tasks": r["tasks"], "reserves": r["reserves"], "tasks_reserved_once": r["reserved_once"],
            "wallets_off_ledger": r["wallets_off_ledger"], "wallets_off_reservations": r["wallets_off_reservations"],
            "paths": {"wallet": r["through_wallet"], "slot": r["through_slots"], "slot_refills": r["slot_refills"]},
            "ok": ok}


def dbname(url: str) -> str:
    """The database a URL names (a unix-socket URL keeps its host in the query)."""
    return urlsplit(url).path.lstrip("/")


def analyze(url: str) -> None:
    """Statistics of the warmed-up clone, as autovacuum would keep them (it may be off on a test
    server): the clone's tables were empty when the template was analyzed, and plans made for empty
    tables (the foreign-key checks' among them) would scan what the run inserts. An ANALYZE makes
    every backend plan again."""
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("analyze")


def _redis_prefix() -> str:
    return f"benchadm{uuid.uuid4().hex[:6]}"


def _drop_prefix(redis_url: str | None, prefix: str) -> None:
    if redis_url:
        c = Cache(redis_url, prefix)
        try:
            c.delete_prefix()
        finally:
            c.close()


# -- in process -----------------------------------------------------------------------------------------

def _admit_worker(settings_json: str, clients: list[tuple[str, str]], index: int, seconds: float, ready, go, out) -> None:
    """One process calling admit() in a closed loop, round-robin over its clients (tenant, user)."""
    p = None
    try:
        p = build_platform(Settings.model_validate_json(settings_json), PlatformConfig(), pool_size=2)
        callers = [Caller(uuid.UUID(t), uuid.UUID(u), "OWNER", None) for t, u in clients]
        req = GenerationRequest(**BODY)
        statuses: dict[str, int] = {}

        def one(i: int, tag: str) -> None:
            c = callers[i % len(callers)]
            try:
                st = admit(p, c, req, BODY, f"{tag}-{index}-{i}").status
            except Rejected as r:
                st = r.status
            statuses[str(st)] = statuses.get(str(st), 0) + 1

        for i in range(WARM_ADMISSIONS):
            one(i, "warm")
        warm = statuses.get("202", 0)
        statuses.clear()
        ready.put("ok")
        go.wait(120)
        cpu0, t0 = time.process_time(), time.perf_counter()
        end, i = t0 + seconds, 0
        while time.perf_counter() < end:
            one(i, "run")
            i += 1
        out.put({"statuses": statuses, "elapsed": time.perf_counter() - t0, "cpu": time.process_time() - cpu0, "warm": warm})
    except BaseException as e:  # the parent must not wait forever
        ready.put(f"error: {e!r}")
        out.put({"error": repr(e)})
        raise
    finally:
        if p is not None:
            p.close()


def run_in_process(admin_url: str, redis_url: str | None, template: str, clients: list[Client], *, workers: int,
                   seconds: float) -> dict:
    """`workers` processes calling admit() for `seconds` on a clone of the template."""
    prefix = _redis_prefix()
    with clone(admin_url, template) as url:
        settings = Settings(database_url=url, redis_url=redis_url or "none", redis_prefix=prefix)
        ctx = mp.get_context("spawn")
        ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
        # Each worker starts at another client, so the workers spread over the tenants (or users) at once.
        shares = [[(c.tenant_id, c.user_id) for c in clients[i:] + clients[:i]] for i in range(workers)]
        procs = [ctx.Process(target=_admit_worker, args=(settings.model_dump_json(), shares[i], i, seconds, ready, go, out))
                 for i in range(workers)]
        with quiet_children():
            for proc in procs:
                proc.start()
        try:
            for _ in procs:
                status = get_or_fail(ready, procs, 180, "admission bench workers")
                if status != "ok":
                    raise RuntimeError(f"admission bench worker failed: {status}")
            analyze(url)
            with Vacuuming(url, HOT_TABLES) as vac, BackendCpu(admin_url, dbname(url)) as cpu:
                go.set()
                results = [get_or_fail(out, procs, seconds + 120, "admission bench workers") for _ in procs]
        finally:
            go.set()
            join_or_kill(procs)
        raise_first_error(results, "admission bench worker")
        statuses: dict[str, int] = {}
        for r in results:
            for k, n in r["statuses"].items():
                statuses[k] = statuses.get(k, 0) + n
        accepted = statuses.get("202", 0)
        elapsed = max(r["elapsed"] for r in results)
        check = self_check(url, accepted + sum(r["warm"] for r in results))
    _drop_prefix(redis_url, prefix)
    return {"workers": workers, "callers": len(clients), "tenants": len({c.tenant_id for c in clients}), "seconds": seconds, "accepted": accepted, "statuses": statuses,
            "accepted_per_second": round(accepted / elapsed, 1) if elapsed else None,
            "pg_cpu_ms_per_admission": cpu.ms_per(accepted), **({"pg_cpu_note": cpu.note} if cpu.note else {}),
            "worker_cpu_ms_per_admission": round(1000 * sum(r["cpu"] for r in results) / accepted, 3) if accepted else None,
            **vac.note(), "self_check": check}


# -- through aivedio serve's API workers ----------------------------------------------------------------

def run_http(admin_url: str, redis_url: str | None, template: str, clients: list[Client], *, workers: int, load_clients: int,
             seconds: float, half_load: bool = True) -> dict:
    """`aivedio serve --api-workers workers`'s API (ApiWorkers) on a clone of the template: warm-up,
    then `load_clients` closed-loop clients for `seconds`, then half that rate open-loop."""
    prefix = _redis_prefix()
    keys = [c.api_key for c in clients]
    with clone(admin_url, template) as url:
        settings = Settings(database_url=url, redis_url=redis_url or "none", redis_prefix=prefix)
        main = build_platform(settings, PlatformConfig(), pool_size=2)
        # As under `aivedio serve`: the workers forward their wake-ups of the relay to this process.
        main.extras["wake"] = {RELAY: threading.Event()}
        main.extras["loop_status"] = {}
        api = None
        try:
            with quiet_children():
                api = ApiWorkers(main, settings, main.config, "127.0.0.1", 0, workers).start()
            warm = run_load([api.url], keys, BODY, clients=load_clients, seconds=HTTP_WARM_SECONDS)
            analyze(url)
            with Vacuuming(url, HOT_TABLES) as vac:
                with BackendCpu(admin_url, dbname(url)) as cpu:
                    sustained = run_load([api.url], keys, BODY, clients=load_clients, seconds=seconds)
                half = None
                if half_load:
                    half = run_load([api.url], keys, BODY, clients=load_clients, seconds=seconds,
                                    rate_total=max(1.0, sustained["accepted_per_second"] / 2))
        finally:
            if api is not None:
                api.stop()
            main.close()
        accepted = warm["accepted"] + sustained["accepted"] + (half["accepted"] if half else 0)
        check = self_check(url, accepted)
    _drop_prefix(redis_url, prefix)
    return {"api_workers": workers, "load_clients": load_clients, "seconds": seconds, "sustained": sustained,
            "half_load": half, "pg_cpu_ms_per_admission": cpu.ms_per(sustained["accepted"]),
            **({"pg_cpu_note": cpu.note} if cpu.note else {}), **vac.note(), "self_check": check}


# -- all of them, in rounds -------------------------------------------------------------------------------

def _paths(result: dict, side: str) -> dict:
    """How the runs' admissions went: through a slot, the merged path or the wallet (migration 0195)."""
    out: dict[str, int] = {}
    for r in result["rounds"]:
        for k, n in ((r[side].get("self_check") or {}).get("paths") or {}).items():
            out[k] = out.get(k, 0) + n
    return out


def _compact(run: dict) -> dict:
    keep = ("accepted_per_second", "accepted", "statuses", "pg_cpu_ms_per_admission", "worker_cpu_ms_per_admission", "pg_cpu_note",
            "tps", "transactions", "pg_cpu_ms_per_txn", "latency_avg_ms", "vacuum_runs")
    out = {k: run[k] for k in keep if k in run}
    if "sustained" in run:
        out["sustained"] = {k: run["sustained"][k] for k in ("accepted_per_second", "p50_ms", "p99_ms", "statuses")}
        if run.get("half_load"):
            out["half_load"] = {k: run["half_load"][k] for k in ("accepted_per_second", "p50_ms", "p99_ms", "statuses")}
        out["pg_cpu_ms_per_admission"] = run.get("pg_cpu_ms_per_admission")
    if "self_check" in run:
        out["self_check_ok"] = run["self_check"]["ok"]
    return out


def bench_admission(admin_url: str, redis_url: str | None, *, workers: int, clients: int, seconds: float, rounds: int = 3,
                    tenants: int = 40, users: int = 40, pgbench_scale: int = 10, profile_admissions: int = 200,
                    hot_slots: int = 16) -> dict:
    with seeded_template(admin_url, tenants=tenants, users=users, hot_slots=hot_slots) as seeded, \
            pgbench_database(admin_url, scale=pgbench_scale) as pg_url:
        with clone(admin_url, seeded.template) as url, quiet_children():  # its log lines too
            profile = profile_admission(url, redis_url, n=profile_admissions)
        aps = lambda r: r.get("accepted_per_second")  # noqa: E731
        tps = lambda r: r.get("tps")  # noqa: E731
        in_process = alternate(
            lambda i: run_in_process(admin_url, redis_url, seeded.template, seeded.spread, workers=workers, seconds=seconds),
            lambda i: run_on(admin_url, pg_url, clients=workers, seconds=seconds, scale=pgbench_scale),
            rounds=rounds, figure=aps, baseline_figure=tps)
        http = alternate(
            lambda i: run_http(admin_url, redis_url, seeded.template, seeded.spread, workers=workers, load_clients=clients,
                               seconds=seconds),
            lambda i: run_on(admin_url, pg_url, clients=clients, seconds=seconds, scale=pgbench_scale),
            rounds=rounds, figure=lambda r: r["sustained"]["accepted_per_second"], baseline_figure=tps)
        hot = alternate(
            lambda i: run_in_process(admin_url, redis_url, seeded.template, seeded.hot, workers=workers, seconds=seconds),
            lambda i: run_in_process(admin_url, redis_url, seeded.template, seeded.spread, workers=workers, seconds=seconds),
            rounds=rounds, figure=aps, baseline_figure=aps)

    def col(result: dict, side: str, f) -> dict:
        return spread([f(r[side]) for r in result["rounds"]])

    adm_cpu = col(in_process, "bench", lambda r: r.get("pg_cpu_ms_per_admission"))
    txn_cpu = col(in_process, "baseline", lambda r: r.get("pg_cpu_ms_per_txn"))
    notes = sorted({r[side].get(k) for r in in_process["rounds"] for side in ("bench", "baseline")
                    for k in ("pg_cpu_note",) if r[side].get(k)})
    checks = [r[side]["self_check"] for res in (in_process, http, hot) for r in res["rounds"] for side in ("bench", "baseline")
              if "self_check" in r[side]]
    half = [r["bench"]["half_load"] or {} for r in http["rounds"]]
    return {
        "workers": workers, "clients": clients, "seconds": seconds, "rounds": rounds, "tenants": tenants,
        "users_on_the_hot_wallet": users, "targets": TARGETS,
        "definition": ("each ratio is the median of `rounds` alternating rounds (the bench, then its baseline), min and max "
                       "beside it; every run on a fresh clone of one seeded database"),
        "in_process": {"ratio_vs_pgbench": in_process["ratio"]["median"], "ratio_spread": in_process["ratio"],
                       "accepted_per_second": col(in_process, "bench", aps), "pgbench_tps": col(in_process, "baseline", tps),
                       "pgbench_clients": workers,
                       "rounds": [{"admission": _compact(r["bench"]), "pgbench": _compact(r["baseline"]), "ratio": r["ratio"]}
                                  for r in in_process["rounds"]]},
        "http": {"ratio_vs_pgbench": http["ratio"]["median"], "ratio_spread": http["ratio"],
                 "accepted_per_second": col(http, "bench", lambda r: r["sustained"]["accepted_per_second"]),
                 "pgbench_tps": col(http, "baseline", tps), "pgbench_clients": clients, "api_workers": workers,
                 "half_load": {"p50_ms": spread([h.get("p50_ms") for h in half], 2)["median"],
                               "p99_ms": spread([h.get("p99_ms") for h in half], 2)["median"],
                               "p50_spread": spread([h.get("p50_ms") for h in half], 2),
                               "p99_spread": spread([h.get("p99_ms") for h in half], 2)},
                 "pg_cpu_ms_per_admission": col(http, "bench", lambda r: r.get("pg_cpu_ms_per_admission"))["median"],
                 "rounds": [{"admission": _compact(r["bench"]), "pgbench": _compact(r["baseline"]), "ratio": r["ratio"]}
                            for r in http["rounds"]]},
        "pg_cpu_ms_per_admission": adm_cpu["median"], "pg_cpu_ms_per_tpcb_txn": txn_cpu["median"],
        "pg_cpu_ratio": round(adm_cpu["median"] / txn_cpu["median"], 2) if adm_cpu["median"] and txn_cpu["median"] else None,
        "pg_cpu_spread": {"per_admission": adm_cpu, "per_tpcb_txn": txn_cpu},
        "pg_cpu_definition": ("utime + stime from /proc/<pid>/stat of the bench database's client backends "
                              "(pg_stat_activity), sampled over the in-process runs and the pgbench runs beside them"),
        **({"pg_cpu_note": "; ".join(notes)} if notes else {}),
        "hot_wallet": {"ratio_to_spread": hot["ratio"]["median"], "ratio_spread": hot["ratio"],
                       "hot_accepted_per_second": col(hot, "bench", aps), "spread_accepted_per_second": col(hot, "baseline", aps),
                       "definition": (f"in process, {workers} workers: one tenant whose {users} users share one wallet "
                                      f"({'partitioned into ' + str(hot_slots) + ' slots' if hot_slots else 'not partitioned'}), "
                                      f"against {tenants} tenants with a wallet each"),
                       "hot_paths": _paths(hot, "bench"),
                       "rounds": [{"hot": _compact(r["bench"]), "spread": _compact(r["baseline"]), "ratio": r["ratio"]}
                                  for r in hot["rounds"]]},
        "self_check": {"ok": all(c["ok"] for c in checks), "runs": len(checks),
                       "failed": [c for c in checks if not c["ok"]]},
        "profile": profile,
    }
