"""The fair scheduler's benchmarks (issue 4, "Benchmarks"), each on a scratch database of the same
PostgreSQL server that pgbench measures:

- claims per second, DRR pick included: several scheduler processes (replicas, as EventBridge runs
  several ticks at once), each calling `Scheduler(platform).tick(budget)` in a loop, on a lane whose
  capacity never binds, over many tenants with deep queues;
- the cost of one pick at 10, 1,000 and 100,000 active tenants. A pick is `Ring.next` (the Redis
  ring) plus one `Scheduler.visit` that claims exactly one task: every tenant has weight 1 and
  exactly one queued task of `quantum` units (a claimed task is replaced outside the timing), so the
  visit reads the same rows and writes the same rows at every size. The sizes are measured pick by
  pick in turn, so the machine's other load weighs on each alike;
- the claim rate with 1,000,000 queued tasks against the rate with 10,000: same tenants, same
  config, one scheduler process per setting, ticks alternating between the two settings until each
  has made a fixed number of claims;
- latency from an event to the work it starts (aivedio_tools.bench.latency, under `latency`): admission
  to submit, and freed slot to next submit while a provider account binds, on the real local
  runtime with its provider simulators.

Setup is bulk SQL (INSERT ... SELECT generate_series), not admission: the scheduler never reads
wallets or credit reservations, so none are written. Scratch databases and Redis keys are dropped
afterwards."""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
import uuid
from contextlib import ExitStack, contextmanager

from aivedio.config import LaneConfig, Limits, PlatformConfig, Pools, ProviderAccount, ProviderConfig, Settings
from aivedio.context import build_platform, set_platform
from aivedio.observability import logger
from aivedio.scheduling.resources import ensure_platform_pools
from aivedio.scheduling.ring import Ring
from aivedio.scheduling.scheduler import LaneView, Scheduler
from aivedio_tools.bench.latency import bench_latency
from aivedio_tools.bench.pgbench import pgbench_database, run_on
from aivedio_tools.bench.rounds import alternate, spread
from aivedio_tools.bench.scratch import CAP, SCHEDULER_DATABASE_PREFIX, SCHEDULER_REDIS_PREFIX, percentile, scratch_database
from aivedio_tools.bench.workers import get_or_fail, join_or_kill, raise_first_error

LANE = "PAID_SHARED"
BIG = 10**12
MAX_EMPTY_TICKS = 20  # consecutive ticks without a claim before the queue-depth benchmark gives up
TASK_BASE_UNITS = 1  # a 5 s 720p text_to_video: 1 fairness unit, 25 cost units, 1 media unit


def bench_config() -> PlatformConfig:
    """Lanes, provider accounts, model cap, cost budget and worker pools far above anything a run claims,
    so the benchmarks measure the claim path, never a NoRoom."""
    return PlatformConfig(
        providers=[ProviderConfig(name="provider-a", accounts=[ProviderAccount(account_id="account-01", max_concurrency=CAP),
                                                               ProviderAccount(account_id="account-02", max_concurrency=CAP)])],
        lanes={lane: LaneConfig(capacity_units=CAP, max_queue_units=CAP) for lane in
               ("PAID_SHARED", "STANDARD", "BEST_EFFORT", "EXPENSIVE", "RECOVERY")}
        | {"ENTERPRISE_RESERVED": LaneConfig(capacity_units=CAP, borrowable_units=1000, min_headroom_units=50)},
        limits=Limits(model_global_running_cap=CAP, platform_cost_per_minute=CAP),
        pools=Pools(worker_cpu_units=CAP, worker_gpu_units=CAP),
    )


# -- bulk setup ---------------------------------------------------------------------------------------

def seed_tenants(conn, n: int, *, weights: int = 1, tag: str = "t") -> None:
    """n PAID_SHARED tenants with one user each and a policy whose caps never bind; weight
    1 + i % weights. Also each tenant's DRR row and its per-tenant and per-user pools, as a tenant
    that has been scheduled before has them (steady state, not first contact)."""
    q = dict(n=n, w=weights, tag=tag, big=BIG, cap=CAP, lane=LANE)
    conn.execute("insert into tenant (name, service_class) select %(tag)s || '-' || g, 'PAID_SHARED' from generate_series(1, %(n)s) g", q)
    conn.execute("""insert into app_user (tenant_id, name, role)
                    select tenant_id, name || '-owner', 'OWNER' from tenant where name like %(tag)s || '-%%'""", q)
    conn.execute(
        """insert into tenant_scheduling_policy
               (tenant_id, service_class, weight, max_queued_tasks, max_queued_units, max_running_tasks, max_running_units,
                max_cost_per_minute, max_cost_per_day, reserved_units, burst_units, max_wait_seconds,
                max_user_queued_tasks, max_user_queued_units, max_user_running_tasks, max_user_running_units,
                user_submit_rate_per_minute, tenant_submit_rate_per_minute, burst_rounds, initial_burst_credit)
           select tenant_id, 'PAID_SHARED', w, %(cap)s, %(cap)s, %(cap)s, %(cap)s, %(big)s, %(big)s, 0, 40, 1000000,
                  %(cap)s, %(cap)s, %(cap)s, %(cap)s, 10000000, 10000000, 4, 8 * w
             from (select tenant_id, 1 + (substring(name from '[0-9]+$')::int %% %(w)s) as w
                     from tenant where name like %(tag)s || '-%%') t""",
        q,
    )
    conn.execute("""insert into drr_lane_tenant (lane, tenant_id, deficit, active)
                    select %(lane)s, tenant_id, 0, true from tenant where name like %(tag)s || '-%%'""", q)
    # The pools claim() ensures on first contact: tenant and user running tasks and units, one shard each.
    conn.execute(
        """insert into resource_pool_shard (resource_key, shard_no, capacity_units, used_units)
           select k, 0, %(cap)s, 0
             from app_user u join tenant t using (tenant_id),
                  lateral (values ('tenant:' || u.tenant_id || ':running_tasks'), ('tenant:' || u.tenant_id || ':running_units'),
                                  ('user:' || u.tenant_id || ':' || u.user_id || ':running_tasks'),
                                  ('user:' || u.tenant_id || ':' || u.user_id || ':running_units')) v(k)
            where t.name like %(tag)s || '-%%'""",
        q,
    )


INSERT_TASKS = """
insert into generation_task
    (tenant_id, user_id, queue_class, priority_band, base_priority_band, resource_class, state, model_code,
     fairness_units, provider_slot_units, estimated_cost_units, enqueue_at, next_eligible_at, policy_version,
     estimate_version, idempotency_key, mode, prompt, duration_seconds, resolution, media_units, gpu_units,
     admission_decision, normalized_params)
select u.tenant_id, u.user_id, %(lane)s, 3, 3, 'video-standard', 'QUEUED', 'video-model-x',
       %(units)s, 1, 25 * %(units)s, e.at, e.at, 1, 1, %(key)s || g, 'text_to_video', 'bench', 5 * %(units)s, '720p', 1, 0,
       'ACCEPTED', '{{}}'::jsonb
  from app_user u join tenant t using (tenant_id)
  cross join generate_series(1, %(per)s) g
  cross join lateral (select now() - interval '1 hour' + g * interval '1 millisecond' as at) e
 where t.name like %(tag)s || '-%%' {cond}
 order by g, u.tenant_id
"""
# A bulk seed writes the queue counters (task_queue_usage per user, tenant_queue_usage per shard,
# which migration 0230's row trigger keeps) once per user and shard for the whole insert, in the
# same statement, with the row trigger off: a million inserted rows would otherwise upsert the same
# few counter rows a million times in one transaction (over fifteen minutes for the scheduler bench).
QUEUE_USAGE_TRIGGER = "generation_task_queue_usage_insert"
BULK_INSERT_TASKS = """
with inserted as ({insert} returning tenant_id, user_id, queue_class, fairness_units),
per_user as (
    insert into task_queue_usage as q (tenant_id, user_id, queue_class, queued_tasks, queued_units)
    select tenant_id, user_id, queue_class, count(*), sum(fairness_units) from inserted group by 1, 2, 3
    on conflict (tenant_id, user_id, queue_class) do update
       set queued_tasks = q.queued_tasks + excluded.queued_tasks, queued_units = q.queued_units + excluded.queued_units),
per_shard as (
    insert into tenant_queue_usage as s (tenant_id, queue_class, shard, queued_tasks, queued_units)
    select tenant_id, queue_class, aivedio_queue_shard(user_id), count(*), sum(fairness_units) from inserted group by 1, 2, 3
    on conflict (tenant_id, queue_class, shard) do update
       set queued_tasks = s.queued_tasks + excluded.queued_tasks, queued_units = s.queued_units + excluded.queued_units)
select count(*)::int as n from inserted
"""


def seed_tasks(conn, per_tenant: int, *, units: int = TASK_BASE_UNITS, tag: str = "t", key: str = "b", tenant_id=None,
               bulk: bool = False) -> int:
    """per_tenant QUEUED tasks for each tenant (or one tenant), FIFO-interleaved across tenants.
    `bulk`: BULK_INSERT_TASKS, the trigger off in this transaction only (the ALTER holds the
    table's lock until the commit that switched it back on, so no other writer misses a count);
    for a seed before the measurement, never for one while schedulers run."""
    cond = "and u.tenant_id = %(tenant)s" if tenant_id is not None else ""
    params = dict(lane=LANE, units=units, per=per_tenant, tag=tag, key=key + "-", tenant=tenant_id)
    insert = INSERT_TASKS.format(cond=cond)
    if not bulk:
        return conn.execute(insert, params).rowcount
    with conn.transaction():
        conn.execute(f"alter table generation_task disable trigger {QUEUE_USAGE_TRIGGER}")
        n = conn.execute(BULK_INSERT_TASKS.format(insert=insert.strip()), params).fetchone()["n"]
        conn.execute("set constraints all immediate")  # the insert's deferred checks, which an ALTER may not leave pending
        conn.execute(f"alter table generation_task enable trigger {QUEUE_USAGE_TRIGGER}")
    return n


def prepare_database(conn, config: PlatformConfig) -> None:
    with conn.transaction():
        ensure_platform_pools(conn, config)


def vacuum_analyze(conn) -> None:
    for t in ("generation_task", "tenant", "app_user", "tenant_scheduling_policy", "drr_lane_tenant", "resource_pool_shard"):
        conn.execute(f"vacuum (analyze) {t}")


def db_counts(conn) -> dict:
    row = conn.execute(
        """select (select count(*) from task_attempt) as attempts,
                  (select count(*) from generation_task where state = 'DISPATCHING') as dispatching,
                  (select count(*) from generation_task where state = 'QUEUED') as queued,
                  (select count(*) from resource_reservation where state = 'ACTIVE') as reservations,
                  (select count(*) from outbox_event where event_type = 'TaskDispatchRequested') as dispatch_events,
                  (select deadlocks from pg_stat_database where datname = current_database()) as deadlocks""").fetchone()
    return dict(row)


@contextmanager
def bench_platform(admin_url: str, redis_url: str | None, pool_size: int = 4):
    """A scratch database with the benchmark config and a Redis prefix of its own; both dropped after."""
    prefix = f"{SCHEDULER_REDIS_PREFIX}{uuid.uuid4().hex[:6]}"
    config = bench_config()
    with scratch_database(admin_url, prefix=SCHEDULER_DATABASE_PREFIX) as db_url:
        settings = Settings(database_url=db_url, redis_url=redis_url or "none", redis_prefix=prefix)
        p = build_platform(settings, config, pool_size=pool_size)
        try:
            with p.db.connection() as conn:
                prepare_database(conn, config)
            yield p
        finally:
            if p.cache is not None:
                p.cache.delete_prefix()
            p.close()


def build_ring(p, lane: str = LANE) -> float:
    t0 = time.perf_counter()
    with p.db.connection() as conn:
        Ring(p).rebuild(conn, lane)
    return round(time.perf_counter() - t0, 2)


# -- 1. claims per second, several scheduler processes -----------------------------------------------

def _tick_worker(settings_json: str, config_json: str, warm: float, seconds: float, ready: mp.Queue, go, out: mp.Queue,
                 release) -> None:
    settings = Settings.model_validate_json(settings_json)
    p = build_platform(settings, PlatformConfig.model_validate_json(config_json), pool_size=2)
    set_platform(p)
    try:
        sched = Scheduler(p)
        end = time.monotonic() + warm  # warm-up: connections, prepared statements, the router's stats cache
        while time.monotonic() < end:
            sched.tick(end - time.monotonic())
        ready.put(True)
        go.wait()
        claims = visits = ticks = 0
        t0, cpu0 = time.monotonic(), time.process_time()
        end = t0 + seconds
        while (left := end - time.monotonic()) > 0:
            r = sched.tick(left)
            claims, visits, ticks = claims + r.claims, visits + r.visits, ticks + 1
        out.put({"claims": claims, "visits": visits, "ticks": ticks, "elapsed": time.monotonic() - t0,
                 "cpu": time.process_time() - cpu0})
        release.wait(60)  # keep the connections open until the parent has read their backends' CPU
    except BaseException as e:  # the parent must not wait forever
        out.put({"error": repr(e)})
        raise
    finally:
        p.close()


def _get(q: mp.Queue, procs: list, timeout: float):
    return get_or_fail(q, procs, timeout, "scheduler workers")


def _backends(conn) -> list[int]:
    """The client backends of this database, except the asking one (the schedulers' connections)."""
    return [r["pid"] for r in conn.execute(
        """select pid from pg_stat_activity where datname = current_database() and pid <> pg_backend_pid()
              and backend_type = 'client backend'""").fetchall()]


def _backend_cpu(pids: list[int]) -> dict[int, float] | None:
    """CPU seconds (user + system) each PostgreSQL backend has used, read from /proc: only when the
    server runs on this machine and its processes are readable; None otherwise."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except FileNotFoundError:
            continue  # a backend that has gone
        except (OSError, ValueError, IndexError):
            return None
    return out or None


def bench_claims(admin_url: str, redis_url: str | None, *, workers: int, seconds: float, tenants: int = 200,
                 tasks_per_tenant: int = 100, warm: float = 2.0) -> dict:
    with bench_platform(admin_url, redis_url) as p:
        t0 = time.perf_counter()
        with p.db.connection() as conn:
            with conn.transaction():
                seed_tenants(conn, tenants, weights=4)
                seed_tasks(conn, tasks_per_tenant, bulk=True)
            vacuum_analyze(conn)
        ring_s = build_ring(p)
        setup_s = round(time.perf_counter() - t0, 2)
        logger.info("bench scheduler claims: seeded", extra={"tenants": tenants, "tasks": tenants * tasks_per_tenant, "seconds": setup_s})
        with p.db.connection() as conn:
            before = db_counts(conn)
        ctx = mp.get_context("spawn")
        ready, out, go, release = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
        args = (p.settings.model_dump_json(), p.config.model_dump_json(), warm, seconds, ready, go, out, release)
        procs = [ctx.Process(target=_tick_worker, args=args) for _ in range(workers)]
        for proc in procs:
            proc.start()
        try:
            for _ in procs:
                _get(ready, procs, 120 + warm)
            with p.db.connection() as conn:
                at_go = db_counts(conn)
                pg_cpu0 = _backend_cpu(_backends(conn))
            go.set()
            results = [_get(out, procs, seconds + 120) for _ in procs]
            with p.db.connection() as conn:
                pg_cpu1 = _backend_cpu(_backends(conn))
        finally:
            go.set()
            release.set()
            join_or_kill(procs)
        raise_first_error(results, "scheduler worker")
        with p.db.connection() as conn:
            after = db_counts(conn)
    claims = sum(r["claims"] for r in results)
    visits = sum(r["visits"] for r in results)
    elapsed = max(r["elapsed"] for r in results)
    # A backend opened after the start used all its CPU inside the window.
    pg_cpu = sum(v - (pg_cpu0 or {}).get(k, 0.0) for k, v in pg_cpu1.items()) if pg_cpu1 else None
    cpu_per_claim = {"scheduler_process_ms": round(1000 * sum(r["cpu"] for r in results) / claims, 2) if claims else None,
                     "postgres_backend_ms": round(1000 * pg_cpu / claims, 2) if claims and pg_cpu is not None else None}
    return {
        "workers": workers, "seconds": seconds, "tenants": tenants, "tasks_seeded": tenants * tasks_per_tenant,
        "weights": "1 + i % 4", "task_units": TASK_BASE_UNITS, "setup_seconds": setup_s, "ring_rebuild_seconds": ring_s,
        "claims": claims, "visits": visits, "claims_per_visit": round(claims / visits, 2) if visits else None,
        "claims_per_second": round(claims / elapsed, 1) if elapsed else None,
        "cpu_per_claim": cpu_per_claim,
        "per_worker": [{"claims": r["claims"], "visits": r["visits"], "ticks": r["ticks"]} for r in results],
        "measured_in_db": {"attempts": after["attempts"] - at_go["attempts"], "deadlocks": after["deadlocks"] - at_go["deadlocks"]},
        "db_before": before, "db_after": after,
    }


# -- 2. the cost of one pick ---------------------------------------------------------------------------

class _PickEnv:
    """One tenant count: its scratch database, ring and scheduler, and the pick timings taken on it."""

    def __init__(self, p, tenants: int, setup_s: float, ring_s: float | None):
        self.p, self.tenants, self.setup_s, self.ring_s = p, tenants, setup_s, ring_s
        self.sched = Scheduler(p)
        with p.db.connection() as conn:
            self.view = LaneView(p, conn, LANE)
        self.total: list[float] = []
        self.next: list[float] = []
        self.refills = 0

    def pick(self, use_redis: bool, record: bool = True) -> None:
        """ring.next + one visit, timed together; then (untimed) the claimed task is replaced so the
        tenant keeps exactly one queued task."""
        p = self.p
        t0 = time.perf_counter()
        with p.db.connection() as conn:
            tenant = self.sched.ring.next(conn, LANE, use_redis)
        t1 = time.perf_counter()
        r = self.sched.visit(LANE, tenant, self.view, not use_redis)
        t2 = time.perf_counter()
        if len(r.claims) != 1:
            raise RuntimeError(f"a pick claimed {len(r.claims)} tasks ({r.outcome}); the benchmark expects exactly one")
        if record:
            self.total.append(t2 - t0)
            self.next.append(t1 - t0)
        self.refills += 1
        with p.db.connection() as conn:
            seed_tasks(conn, 1, units=p.config.scheduler.base_quantum, key=f"r{self.refills}", tenant_id=tenant)
        # The arrival's queue indexer: a visit that claims a tenant's last task takes it off the ring.
        self.sched.ring.add(LANE, tenant)

    def summary(self) -> dict:
        us = [t * 1e6 for t in self.total]
        return {"picks": len(us), "median_us": round(statistics.median(us), 1), "p90_us": round(percentile(us, 0.9), 1),
                "mean_us": round(statistics.fmean(us), 1),
                "ring_next_median_us": round(statistics.median(self.next) * 1e6, 1)}


def _pick_env(stack, admin_url: str, redis_url: str | None, tenants: int) -> _PickEnv:
    p = stack.enter_context(bench_platform(admin_url, redis_url, pool_size=2))
    t0 = time.perf_counter()
    with p.db.connection() as conn:
        with conn.transaction():
            seed_tenants(conn, tenants, weights=1)
            seed_tasks(conn, 1, units=p.config.scheduler.base_quantum)  # weight 1: a visit pays for exactly one
        vacuum_analyze(conn)
    ring_s = build_ring(p) if p.cache is not None else None
    setup_s = round(time.perf_counter() - t0, 2)
    logger.info("bench scheduler pick: seeded", extra={"tenants": tenants, "setup_seconds": setup_s, "ring_rebuild_seconds": ring_s})
    return _PickEnv(p, tenants, setup_s, ring_s)


def bench_pick_cost(admin_url: str, redis_url: str | None, *, sizes=(10, 1000, 100_000), picks: int = 400, warm: int = 50,
                    rounds: int = 3) -> dict:
    """Every size is set up first, then the picks are interleaved (one at each size in turn), so
    whatever else the machine does at a moment weighs on every size alike. The picks are `rounds`
    consecutive rounds; each ratio is the median of the rounds' ratios, their spread beside it."""
    use_redis = redis_url is not None
    with ExitStack() as stack:
        envs = [_pick_env(stack, admin_url, redis_url, n) for n in sizes]
        for i in range(warm + picks):
            for env in envs:
                env.pick(use_redis, record=i >= warm)
        results = {}
        for env in envs:
            with env.p.db.connection() as conn:
                counts = db_counts(conn)
            results[str(env.tenants)] = {"tenants": env.tenants, "setup_seconds": env.setup_s, "ring_rebuild_seconds": env.ring_s,
                                         **env.summary(), "db": counts}
        small_env = next(e for e in envs if e.tenants == min(sizes))
        large_env = next(e for e in envs if e.tenants == max(sizes))
        per_round = _pick_rounds(small_env.total, large_env.total, rounds)
    small, large = results[str(min(sizes))], results[str(max(sizes))]
    name = f"{large['tenants']}_vs_{small['tenants']}"
    ratios = {f"median_{name}": per_round["median"]["median"], f"p90_{name}": per_round["p90"]["median"]}
    return {"definition": ("one pick = Ring.next (Redis LMOVE, or the PostgreSQL ring without Redis) + Scheduler.visit that "
                           "claims exactly one task; every tenant has weight 1 and exactly one queued task of quantum units "
                           "(replaced, untimed, after its claim); LaneView refresh not included; sizes interleaved pick by pick"),
            "ring": "redis" if use_redis else "postgresql", "warm_up_picks": warm, "sizes": results, "ratios": ratios,
            "ratio_spread": {f"median_{name}": per_round["median"], f"p90_{name}": per_round["p90"]}, "rounds": rounds,
            "target_ratio_max": 1.5}


def _pick_rounds(small: list[float], large: list[float], rounds: int) -> dict:
    """The median and p90 ratios (large over small) of each of `rounds` consecutive chunks of picks."""
    n = len(small)
    cuts = [(n * i // rounds, n * (i + 1) // rounds) for i in range(rounds)]
    med, p90 = [], []
    for a, b in cuts:
        s, lg = small[a:b], large[a:b]
        if not s or not lg:
            continue
        med.append(statistics.median(lg) / statistics.median(s))
        p90.append(percentile(lg, 0.9) / percentile(s, 0.9))
    return {"median": spread(med), "p90": spread(p90)}


# -- 3. claim rate against queue depth -----------------------------------------------------------------

def _depth_env(stack, admin_url: str, redis_url: str | None, *, tenants: int, queued: int) -> dict:
    p = stack.enter_context(bench_platform(admin_url, redis_url, pool_size=2))
    t0 = time.perf_counter()
    with p.db.connection() as conn:
        conn.execute("set synchronous_commit = off")  # this setup session only
        with conn.transaction():
            seed_tenants(conn, tenants, weights=1)
            seeded = seed_tasks(conn, max(1, queued // tenants), bulk=True)
        conn.execute("reset synchronous_commit")
        vacuum_analyze(conn)
    ring_s = build_ring(p) if p.cache is not None else None
    setup_s = round(time.perf_counter() - t0, 2)
    logger.info("bench scheduler queue depth: seeded", extra={"queued": seeded, "tenants": tenants, "setup_seconds": setup_s})
    return {"p": p, "sched": Scheduler(p), "queued": seeded, "setup_s": setup_s, "ring_s": ring_s, "claims": 0, "visits": 0,
            "seconds": 0.0}


def bench_queue_depth(admin_url: str, redis_url: str | None, *, tenants: int = 1000, small: int = 10_000,
                      large: int = 1_000_000, claims: int = 1500, budget: float = 0.25, rounds: int = 3) -> dict:
    """One scheduler process per setting, same tenants and config. Ticks of `budget` seconds
    alternate between the two settings until each has made at least `claims` claims, in `rounds`
    rounds of claims / rounds each; the ratio is the median of the rounds' ratios."""
    with ExitStack() as stack:
        envs = [_depth_env(stack, admin_url, redis_url, tenants=tenants, queued=q) for q in (small, large)]
        for e in envs:
            e["sched"].tick(budget)  # warm-up (connections, prepared statements, caches): one tick, not a drain
            with e["p"].db.connection() as conn:
                e["at_go"] = db_counts(conn)["attempts"]
        per_round: list[float | None] = []
        for rnd in range(1, rounds + 1):
            goal = -(-claims * rnd // rounds)
            start = [(e["claims"], e["seconds"]) for e in envs]
            _depth_round(envs, goal, budget)
            rates = [(e["claims"] - c0) / (e["seconds"] - s0) if e["seconds"] > s0 else None
                     for e, (c0, s0) in zip(envs, start)]
            per_round.append(rates[1] / rates[0] if rates[0] and rates[1] else None)
        out = {}
        for name, e in zip(("small", "large"), envs):
            with e["p"].db.connection() as conn:
                after = db_counts(conn)
            out[name] = {"tenants": tenants, "queued": e["queued"], "setup_seconds": e["setup_s"], "ring_rebuild_seconds": e["ring_s"],
                         "claims": e["claims"], "visits": e["visits"], "seconds": round(e["seconds"], 3),
                         "claims_per_second": round(e["claims"] / e["seconds"], 1),
                         "measured_in_db": {"attempts": after["attempts"] - e["at_go"]}, "db_after": after}
    return {"definition": (f"one scheduler process per setting, {tenants} tenants of weight 1, same config; ticks of {budget}s "
                           f"alternate between the settings until each has at least {claims} claims"),
            **out, "ratio_large_vs_small": spread(per_round)["median"], "ratio_spread": spread(per_round), "rounds": rounds,
            "ratio_whole_run": round(out["large"]["claims_per_second"] / out["small"]["claims_per_second"], 3),
            "target_ratio_min": 0.8}


def _depth_round(envs: list[dict], goal: int, budget: float) -> None:
    """Alternate ticks between the settings until each has made `goal` claims in all."""
    while any(e["claims"] < goal for e in envs):
        for e in envs:
            if e["claims"] >= goal:
                continue
            t0 = time.perf_counter()
            r = e["sched"].tick(budget)
            e["seconds"] += time.perf_counter() - t0
            e["claims"], e["visits"] = e["claims"] + r.claims, e["visits"] + r.visits
            # A short tick on a busy machine can end before its first claim; many in a row cannot.
            e["empty"] = 0 if r.claims else e.get("empty", 0) + 1
            if e["empty"] >= MAX_EMPTY_TICKS:
                raise RuntimeError("the scheduler stopped claiming before the benchmark's claim count")


# -- all three, beside pgbench --------------------------------------------------------------------------

def bench_scheduler(admin_url: str, redis_url: str | None, *, workers: int, seconds: float,
                    pgbench_clients: int | None = None, rounds: int = 3) -> dict:
    """All four: claims/s in `rounds` alternating rounds with pgbench's tpcb-like TPS on the same
    server (the ratio their median), then pick cost and queue depth in rounds of their own, then
    latency. The load average is recorded at each step: other work on the machine moves every figure."""
    load = {"start": os.getloadavg()[0]}
    clients = pgbench_clients or workers
    with pgbench_database(admin_url) as pg_url:
        got = alternate(lambda i: bench_claims(admin_url, redis_url, workers=workers, seconds=seconds),
                        lambda i: run_on(admin_url, pg_url, clients=clients, seconds=seconds),
                        rounds=rounds, figure=lambda r: r.get("claims_per_second"), baseline_figure=lambda r: r.get("tps"))
    load["after_claims"] = os.getloadavg()[0]
    last = got["rounds"][-1]
    report = {"claims": {**last["bench"], "baseline_pgbench_tpcb_like": last["baseline"],
                         "ratio_vs_pgbench": got["ratio"]["median"], "ratio_spread": got["ratio"], "target_ratio": 0.5,
                         "claims_per_second_rounds": spread([r["bench"].get("claims_per_second") for r in got["rounds"]], 1),
                         "pgbench_tps_rounds": spread([r["baseline"].get("tps") for r in got["rounds"]], 1),
                         "rounds_note": "the other figures are the last round's"},
              "setup_note": ("tasks are bulk-inserted QUEUED rows (INSERT ... SELECT generate_series), not admitted: no wallets, "
                             "credit reservations or charges, which the scheduler never reads")}
    report["pick_cost"] = bench_pick_cost(admin_url, redis_url, rounds=rounds)
    load["after_pick_cost"] = os.getloadavg()[0]
    report["queue_depth"] = bench_queue_depth(admin_url, redis_url, rounds=rounds)
    load["after_queue_depth"] = os.getloadavg()[0]

    report["latency"] = bench_latency(admin_url, redis_url, seconds=seconds)
    load["after_latency"] = os.getloadavg()[0]
    report["load_average_1m"] = {k: round(v, 2) for k, v in load.items()}
    return report
