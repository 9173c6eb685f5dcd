"""The fair scheduler's invariants under real concurrency (issue 4, "Invariants").

Real OS processes (multiprocessing 'spawn'), one PostgreSQL database, one Redis:
- 2 admission workers admit 2,000 tasks through `admit()` while the rest already runs, and put
  each tenant on its lane's ring as the queue indexer would;
- 4 scheduler processes run `Scheduler.tick()` in a loop, as 4 replicas of the tick handler;
- 2 dispatcher processes play the attempt workflow and the provider: they take claimed attempts
  (attempt and task DISPATCHING; CAS to RUNNING), submit them to a provider simulator that counts
  its own in-flight jobs per account in Redis (INCR/DECR, with the peak kept by a Lua max), hold
  them a short random time, and complete them: CAS RUNNING -> PROVIDER_SUCCEEDED -> SUCCEEDED and
  `release_attempt` in one transaction. The provider finishes a job (DECR) before the platform
  learns of it, as a real one does: its count is what ran at the provider, not what we booked;
- a checker thread in this process samples PostgreSQL in one REPEATABLE READ snapshot at a time.

Faults: one scheduler is killed with SIGKILL in the middle of a claim transaction (after its
conditional increments, before its commit), and ~8% of completions are delivered twice, half
of them racing the first delivery, half late from the other dispatcher.

Checked continuously and at the end: no account above its max_concurrency (the simulator's own
peak), no tenant or user above its running caps, every shard counter within [0, capacity] and
equal to the sum of its ACTIVE reservations, every ACTIVE reservation on a live attempt, one
attempt per task; at the end all 2,000 tasks SUCCEEDED, every counter back to 0 and
`rebuild_counters` corrects nothing."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from aivedio.config import LaneConfig, Limits, PlatformConfig, ProviderAccount, ProviderConfig, SchedulerConfig, Settings
from tests.child_events import Events
from tests.conftest import TEST_HOME
from tests.scheduler_support import BODY_1U, BODY_2U, LIVE_STATES, OPEN, Running, complete, pick_attempts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(450)]

TASKS = 2000
SCHEDULERS = 4
DISPATCHERS = 2
ADMITTERS = 2
DISPATCH_WORKERS = 14  # threads per dispatcher: more than the whole provider capacity
HOLD_SECONDS = (0.1, 0.3)  # how long the simulated provider keeps a job: long enough that accounts fill up
DUP_CONCURRENT = 0.04  # completions delivered twice at once
DUP_LATE = 0.04  # completions delivered again later, by whichever dispatcher pops them
RUN_DEADLINE_SECONDS = 300  # a hard bound for a shared, loaded machine (~150-180 s seen at load 7-20 on 2 cores)
IDLE_WAIT = 0.25  # an idle scheduler or dispatcher sleeps at most this long unless woken
CHECK_EVERY = 0.1
KILL_AT_FRACTION = 0.3

# tenant name -> (service class, weight, users, tasks, policy caps)
TENANTS = {
    "ent": ("ENTERPRISE_RESERVED", 3, 1, 300, dict(max_running_tasks=4, max_running_units=6,
                                                   max_user_running_tasks=4, max_user_running_units=6)),
    "paid4": ("PAID_SHARED", 4, 2, 450, dict(max_running_tasks=5, max_running_units=7,
                                             max_user_running_tasks=3, max_user_running_units=5)),
    "paid2": ("PAID_SHARED", 2, 2, 350, dict(max_running_tasks=4, max_running_units=6,
                                             max_user_running_tasks=2, max_user_running_units=4)),
    "paid1": ("PAID_SHARED", 1, 1, 250, dict(max_running_tasks=3, max_running_units=4,
                                             max_user_running_tasks=3, max_user_running_units=4)),
    "std2": ("STANDARD", 2, 2, 350, dict(max_running_tasks=3, max_running_units=5,
                                         max_user_running_tasks=2, max_user_running_units=3)),
    "std1": ("STANDARD", 1, 1, 300, dict(max_running_tasks=2, max_running_units=3,
                                         max_user_running_tasks=2, max_user_running_units=3)),
}
assert sum(t[3] for t in TENANTS.values()) == TASKS


def make_config() -> PlatformConfig:
    """Two providers, three small accounts (12 slots in all), and lanes small enough to saturate:
    sometimes the lanes bind, sometimes the accounts, sometimes the tenants' caps."""
    return PlatformConfig(
        providers=[
            ProviderConfig(name="sim-a", accounts=[ProviderAccount(account_id="a1", max_concurrency=5),
                                                   ProviderAccount(account_id="a2", max_concurrency=3)]),
            ProviderConfig(name="sim-b", accounts=[ProviderAccount(account_id="b1", max_concurrency=4)]),
        ],
        lanes={"ENTERPRISE_RESERVED": LaneConfig(capacity_units=6, borrowable_units=3, min_headroom_units=1),
               "PAID_SHARED": LaneConfig(capacity_units=9), "STANDARD": LaneConfig(capacity_units=5)},
        limits=Limits(pool_shards=4),
        scheduler=SchedulerConfig(tick_budget_seconds=0.5, batch_size=2),
    )


# --- the provider simulator's own books (Redis, under the test's prefix) ------------------------------------

INCR_PEAK = """
local v = redis.call('INCR', KEYS[1])
local p = tonumber(redis.call('GET', KEYS[2]) or '0')
if v > p then redis.call('SET', KEYS[2], v) end
return v
"""


class SimBooks:
    def __init__(self, r, prefix: str):
        self.r, self.p = r, prefix
        self._incr = r.register_script(INCR_PEAK)

    def k(self, *parts) -> str:
        return ":".join([self.p, "sim", *map(str, parts)])

    def submit(self, provider: str, account: str, task_id) -> int:
        acct = f"{provider}/{account}"
        self.r.hincrby(self.k("submits"), str(task_id), 1)
        return int(self._incr(keys=[self.k("inflight", acct), self.k("peak", acct)]))

    def finish(self, provider: str, account: str) -> int:
        return int(self.r.decr(self.k("inflight", f"{provider}/{account}")))

    def error(self, msg: str) -> None:
        self.r.rpush(self.k("errors"), msg)

    # Wake-ups, as deployed: a release wakes the scheduler tick, a claim's outbox event starts the
    # attempt workflow. Each process has its own list; a wake is coalesced to one element.
    def wake(self, role: str, which) -> None:
        pipe = self.r.pipeline(transaction=False)
        for i in which:
            pipe.rpush(self.k("wake", role, i), 1)
            pipe.ltrim(self.k("wake", role, i), 0, 0)
        pipe.execute()

    def wait_wake(self, role: str, i: int, timeout: float) -> None:
        self.r.blpop([self.k("wake", role, i)], timeout=timeout)


def _settings(db_url: str, redis_url: str, prefix: str) -> Settings:
    return Settings(database_url=db_url, redis_url=redis_url, redis_prefix=prefix, home=TEST_HOME)


def _child_platform(db_url, redis_url, prefix, config_json, pool_size):
    from aivedio.context import build_platform, set_platform
    from aivedio.observability import logger

    logger.setLevel("WARNING")  # thousands of admissions and claims; keep the output to what matters
    p = build_platform(_settings(db_url, redis_url, prefix), PlatformConfig.model_validate(config_json), pool_size=pool_size)
    set_platform(p)
    return p


# --- child processes ---------------------------------------------------------------------------------------

def admitter_main(db_url, redis_url, prefix, config_json, plan, events, go, stop) -> None:
    """Admit its share of the tasks through the core, and tell the ring (the queue indexer's job)."""
    from aivedio.admission.models import GenerationRequest
    from aivedio.admission.service import admit
    from aivedio.auth import Caller
    from aivedio.scheduling.ring import Ring

    try:
        p = _child_platform(db_url, redis_url, prefix, config_json, 2)
        ring = Ring(p)
        books = SimBooks(p.cache.r, prefix)
        events.put(("ready", "admitter", os.getpid()))
        go.wait(60)
        done = 0
        for tenant_id, user_id, body, key in plan:
            if stop.is_set():
                break
            a = admit(p, Caller(uuid.UUID(tenant_id), uuid.UUID(user_id), "OWNER"), GenerationRequest(**body), body, key)
            res = json.loads(a.body)
            ring.add(res["queue_class"], uuid.UUID(tenant_id))
            done += 1
            if done % 8 == 0:  # the queue indexer wakes the tick too
                books.wake("scheduler", [done // 8 % SCHEDULERS])
        events.put(("admitted", done, os.getpid(), time.process_time()))
        p.close()
    except BaseException as e:
        events.put(("error", f"admitter: {e!r}", os.getpid()))
        raise


def scheduler_main(db_url, redis_url, prefix, config_json, idx, events, go, stop, arm) -> None:
    """One scheduler replica: ticks in a loop. With `arm` (only the victim has one), the first claim
    after arm is set stops inside its transaction, after its conditional increments and before the
    commit, reports what it holds, and waits to be killed."""
    from aivedio.scheduling import scheduler as sched_mod
    from aivedio.scheduling.scheduler import Scheduler

    try:
        p = _child_platform(db_url, redis_url, prefix, config_json, 3)
        if arm is not None:
            real_claim = sched_mod.claim

            def stalling_claim(conn, task, *a, **kw):
                claimed = real_claim(conn, task, *a, **kw)  # increments, attempt, reservations, outbox: not committed
                if arm.is_set():
                    mine = conn.execute(
                        "select state, current_attempt_id, pg_backend_pid() as pid from generation_task where task_id = %s",
                        (task["task_id"],)).fetchone()
                    held = conn.execute("select count(*) as n from resource_reservation where attempt_id = %s",
                                        (claimed.attempt_id,)).fetchone()["n"]
                    events.put(("in_claim", {"task_id": str(task["task_id"]), "attempt_id": str(mine["current_attempt_id"]),
                                             "state_in_tx": mine["state"], "backend_pid": mine["pid"],
                                             "increments": held}, os.getpid()))
                    time.sleep(600)  # SIGKILL arrives here, before the commit
                return claimed

            sched_mod.claim = stalling_claim
        s = Scheduler(p)
        books = SimBooks(p.cache.r, prefix)
        events.put(("ready", "scheduler", os.getpid()))
        go.wait(60)
        claims = ticks = 0
        while not stop.is_set():
            r = s.tick(p.config.scheduler.tick_budget_seconds)
            claims, ticks = claims + r.claims, ticks + 1
            if r.claims:
                books.wake("dispatcher", range(DISPATCHERS))
            else:
                books.wait_wake("scheduler", idx, IDLE_WAIT)
        events.put(("scheduled", {"claims": claims, "ticks": ticks, "cpu_s": round(time.process_time(), 1)}, os.getpid()))
        p.close()
    except BaseException as e:
        events.put(("error", f"scheduler: {e!r}", os.getpid()))
        raise


def dispatcher_main(db_url, redis_url, prefix, config_json, idx, events, go, stop, seed) -> None:
    try:
        p = _child_platform(db_url, redis_url, prefix, config_json, 6)
        books = SimBooks(p.cache.r, prefix)
        rng = random.Random(seed)
        rng_lock = threading.Lock()
        free = threading.Semaphore(DISPATCH_WORKERS)
        stats = defaultdict(int)
        stats_lock = threading.Lock()

        def bump(name, n=1):
            with stats_lock:
                stats[name] += n

        def deliver(a: Running) -> tuple[bool, int]:
            won, released = complete(p, a)
            books.r.hincrby(books.k("wins"), str(a.attempt_id), int(won))
            if won:  # a release wakes one tick (one replica), as deployed
                with rng_lock:
                    which = rng.randrange(SCHEDULERS)
                books.wake("scheduler", [which])
            if not won and released:
                books.error(f"a losing completion of {a.attempt_id} released {released} reservations")
            if won and not released:
                books.error(f"the winning completion of {a.attempt_id} released nothing")
            return won, released

        def run(a: Running) -> None:
            try:
                with rng_lock:
                    hold, dice = rng.uniform(*HOLD_SECONDS), rng.random()
                if books.submit(a.provider, a.account, a.task_id) < 1:
                    books.error("in-flight counter below 1 after a submit")
                time.sleep(hold)
                if books.finish(a.provider, a.account) < 0:
                    books.error(f"in-flight counter of {a.provider}/{a.account} went negative")
                if dice < DUP_CONCURRENT:  # the same completion twice at once (a retried webhook racing itself)
                    barrier = threading.Barrier(2)
                    results = []

                    def twin():
                        barrier.wait(10)
                        results.append(deliver(a))

                    th = threading.Thread(target=twin)
                    th.start()
                    barrier.wait(10)
                    results.append(deliver(a))
                    th.join(30)
                    bump("dup_concurrent")
                    if sorted(w for w, _ in results) != [False, True]:
                        books.error(f"concurrent completions of {a.attempt_id}: {results}")
                else:
                    deliver(a)
                    if dice < DUP_CONCURRENT + DUP_LATE:  # delivered again later, maybe by the other dispatcher
                        books.r.rpush(books.k("late_dups"), json.dumps([str(a.attempt_id), str(a.task_id), str(a.tenant_id),
                                                                        a.provider, a.account, a.version]))
                bump("completed")
            except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
                books.error(f"dispatcher worker: {e!r}")
            finally:
                free.release()

        def replay(raw: str) -> None:
            try:
                at, tk, tn, prov, acct, ver = json.loads(raw)
                a = Running(uuid.UUID(at), uuid.UUID(tk), uuid.UUID(tn), prov, acct, ver)
                won, released = deliver(a)
                bump("dup_late")
                if won or released:
                    books.error(f"a late duplicate completion of {at} changed something: won={won} released={released}")
            except Exception as e:  # noqa: BLE001
                books.error(f"late duplicate: {e!r}")
            finally:
                free.release()

        pool = ThreadPoolExecutor(max_workers=DISPATCH_WORKERS)
        events.put(("ready", "dispatcher", os.getpid()))
        go.wait(60)
        while not stop.is_set():
            n = 0
            while free.acquire(blocking=False):
                n += 1
            picked = pick_attempts(p, n) if n else []
            for a in picked:
                pool.submit(run, a)
            spare = n - len(picked)
            while spare and (raw := books.r.lpop(books.k("late_dups"))):
                pool.submit(replay, raw)
                spare -= 1
            for _ in range(spare):
                free.release()
            if not picked:
                books.wait_wake("dispatcher", idx, IDLE_WAIT)
        pool.shutdown(wait=True)
        events.put(("dispatched", {**stats, "cpu_s": round(time.process_time(), 1)}, os.getpid()))
        p.close()
    except BaseException as e:
        events.put(("error", f"dispatcher: {e!r}", os.getpid()))
        raise


# --- the checker -------------------------------------------------------------------------------------------

class Checker:
    """Samples PostgreSQL in one REPEATABLE READ snapshot per poll and records every violation."""

    def __init__(self, db_url: str, config: PlatformConfig, policies: dict):
        self.db_url, self.config = db_url, config
        self.policies = policies  # tenant_id -> policy row
        self.violations: list[str] = []
        self.samples = 0
        self.peak_tenant = defaultdict(lambda: [0, 0])  # tenant -> [tasks, units]
        self.peak_user = defaultdict(lambda: [0, 0])
        self.peak_key: dict[str, int] = defaultdict(int)  # resource key -> peak used
        self.peak_account_pg: dict[str, int] = defaultdict(int)
        self.borrowed_claims = 0
        from aivedio.scheduling.resources import platform_pools

        self.capacity = {k: cap for k, (cap, _) in platform_pools(config).items()}
        self.account_max = {f"{p.name}/{a.account_id}": a.max_concurrency for p in config.providers for a in p.accounts}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def flag(self, msg: str) -> None:
        if len(self.violations) < 200:
            self.violations.append(msg)

    def check(self, c: psycopg.Connection) -> None:
        with c.transaction():
            c.execute("set transaction isolation level repeatable read, read only")
            # Tenants' and users' running caps, from the tasks themselves.
            for r in c.execute(
                    f"""select tenant_id, user_id, count(*) as n, sum(fairness_units)::bigint as u from generation_task
                         where state in {LIVE_STATES} group by tenant_id, user_id""").fetchall():
                pol = self.policies[r["tenant_id"]]
                pu = self.peak_user[r["user_id"]]
                pu[0], pu[1] = max(pu[0], r["n"]), max(pu[1], r["u"])
                if r["n"] > pol["max_user_running_tasks"] or r["u"] > pol["max_user_running_units"]:
                    self.flag(f"user {r['user_id']} runs {r['n']} tasks / {r['u']} units over its caps")
            for r in c.execute(
                    f"""select tenant_id, count(*) as n, sum(fairness_units)::bigint as u from generation_task
                         where state in {LIVE_STATES} group by tenant_id""").fetchall():
                pol = self.policies[r["tenant_id"]]
                pt = self.peak_tenant[r["tenant_id"]]
                pt[0], pt[1] = max(pt[0], r["n"]), max(pt[1], r["u"])
                if r["n"] > pol["max_running_tasks"] or r["u"] > pol["max_running_units"]:
                    self.flag(f"tenant {r['tenant_id']} runs {r['n']} tasks / {r['u']} units over "
                              f"{pol['max_running_tasks']} / {pol['max_running_units']}")
            # Every shard within [0, capacity] and equal to its ACTIVE reservations; every key within its pool.
            by_key: dict[str, int] = defaultdict(int)
            for r in c.execute(
                    """select s.resource_key, s.shard_no, s.used_units, s.capacity_units,
                              coalesce((select sum(r.reserved_units) from resource_reservation r
                                         where r.resource_key = s.resource_key and r.shard_no = s.shard_no
                                           and r.state = 'ACTIVE'), 0)::bigint as reserved
                         from resource_pool_shard s""").fetchall():
                if not 0 <= r["used_units"] <= r["capacity_units"]:
                    self.flag(f"shard {r['resource_key']}#{r['shard_no']} used {r['used_units']} of {r['capacity_units']}")
                if r["used_units"] != r["reserved"]:
                    self.flag(f"shard {r['resource_key']}#{r['shard_no']} counts {r['used_units']} but ACTIVE "
                              f"reservations hold {r['reserved']}")
                by_key[r["resource_key"]] += r["used_units"]
            for key, used in by_key.items():
                self.peak_key[key] = max(self.peak_key[key], used)
                if key in self.capacity and used > self.capacity[key]:
                    self.flag(f"pool {key} uses {used} of {self.capacity[key]}")
            # Attempts live at each account, as PostgreSQL sees them (the simulator counts its own).
            for r in c.execute(
                    """select provider, provider_account, count(*) as n from task_attempt
                        where state in ('DISPATCHING', 'RUNNING') group by provider, provider_account""").fetchall():
                acct = f"{r['provider']}/{r['provider_account']}"
                self.peak_account_pg[acct] = max(self.peak_account_pg[acct], r["n"])
                if r["n"] > self.account_max[acct]:
                    self.flag(f"account {acct} has {r['n']} live attempts, max {self.account_max[acct]}")
            # Every ACTIVE reservation belongs to a live attempt of a live task, and the task's current one.
            bad = c.execute(
                f"""select r.attempt_id, r.resource_key, a.state as attempt_state, t.state as task_state
                      from resource_reservation r
                      join task_attempt a on a.attempt_id = r.attempt_id
                      join generation_task t on t.task_id = r.task_id
                     where r.state = 'ACTIVE'
                       and (a.state not in ('DISPATCHING', 'RUNNING') or t.state not in {LIVE_STATES}
                            or t.current_attempt_id is distinct from r.attempt_id)
                     limit 3""").fetchall()
            for r in bad:
                self.flag(f"ACTIVE reservation on a dead attempt: {dict(r)}")
            # A claimed task has exactly its one attempt and holds reservations; a queued one has neither.
            bad = c.execute(
                f"""select t.task_id, t.state from generation_task t
                     where t.state in {LIVE_STATES}
                       and ((select count(*) from task_attempt a where a.task_id = t.task_id) <> 1
                            or not exists (select 1 from resource_reservation r where r.task_id = t.task_id
                                             and r.attempt_id = t.current_attempt_id and r.state = 'ACTIVE'))
                    union all
                    select t.task_id, t.state from task_attempt a join generation_task t on t.task_id = a.task_id
                     where t.state = 'QUEUED'
                    union all
                    select t.task_id, t.state from resource_reservation r join generation_task t on t.task_id = r.task_id
                     where r.state = 'ACTIVE' and t.state = 'QUEUED'
                     limit 3""").fetchall()
            for r in bad:
                self.flag(f"task half claimed: {dict(r)}")
            self.borrowed_claims = c.execute(
                "select count(*) as n from task_attempt where capacity_mode = 'BORROWED'").fetchone()["n"]
        self.samples += 1

    def _run(self) -> None:
        with psycopg.connect(self.db_url, autocommit=True, row_factory=dict_row) as c:
            while not self._stop.is_set():
                try:
                    self.check(c)
                except Exception as e:  # noqa: BLE001
                    self.flag(f"checker error: {e!r}")
                self._stop.wait(CHECK_EVERY)

    def start(self) -> "Checker":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


class RingRebuilder:
    """The scheduled maintenance's QueueIndexRebuilder: re-adds tenants with queued work to the
    ring. A ring update can be lost (a tenant found empty is removed just after an admission re-added
    it); the rebuilder is what repairs that in production, so it runs here on a short period."""

    def __init__(self, platform, every: float = 1.0):
        from aivedio.scheduling.ring import Ring

        self.platform, self.ring, self.every = platform, Ring(platform), every
        self.readded = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            with self.platform.db.connection() as c:
                for lane in self.platform.config.lanes:
                    self.readded += self.ring.rebuild(c, lane)

    def start(self) -> "RingRebuilder":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


# --- the test ----------------------------------------------------------------------------------------------

def _setup(db_url, redis_url, prefix, config):
    """Pools, tenants with their users; the admission plan split between the admitters."""
    from aivedio.context import build_platform
    from aivedio.scheduling.resources import ensure_platform_pools
    from tests.admission_support import new_tenant, second_user

    p = build_platform(_settings(db_url, redis_url, prefix), config, pool_size=4)
    with p.db.connection() as c:
        # This module's own throwaway database: commits need not wait for the disk (a server crash is
        # not what this test simulates), which takes WAL flushes off the critical path of every claim.
        c.execute(sql.SQL("alter database {} set synchronous_commit = off").format(sql.Identifier(c.info.dbname)))
        ensure_platform_pools(c, config)
    tenants, items = {}, []
    rng = random.Random(4)
    for name, (klass, weight, n_users, n_tasks, caps) in TENANTS.items():
        t = new_tenant(p, service_class=klass, weight=weight, credits=10_000_000, **{**OPEN, **caps})
        members = [t] + [second_user(p, t) for _ in range(n_users - 1)]
        tenants[name] = t
        for i in range(n_tasks):
            m = members[i % n_users]
            body = BODY_2U if rng.random() < 0.25 else BODY_1U
            items.append((str(t.tenant_id), str(m.user_id), body, f"{name}-{i}"))
    rng.shuffle(items)  # tenants arrive interleaved, and some run dry before others
    plans = [items[i::ADMITTERS] for i in range(ADMITTERS)]
    with p.db.connection() as c:
        policies = {r["tenant_id"]: r for r in c.execute("select * from tenant_scheduling_policy").fetchall()}
    return p, tenants, policies, plans


def test_four_schedulers_two_thousand_tasks_keep_every_invariant(db_url, redis_url, redis_prefix, request):
    from aivedio.scheduling.resources import rebuild_counters

    config = make_config()
    cfg_json = config.model_dump(mode="json")
    platform, tenants, policies, plans = _setup(db_url, redis_url, redis_prefix, config)
    books = SimBooks(platform.cache.r, redis_prefix)
    ctx = mp.get_context("spawn")
    events, go, stop, arm = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
    ev = Events(events)
    common = (db_url, redis_url, redis_prefix, cfg_json)
    schedulers = [ctx.Process(target=scheduler_main, args=(*common, i, events, go, stop, arm if i == 0 else None), daemon=True)
                  for i in range(SCHEDULERS)]
    dispatchers = [ctx.Process(target=dispatcher_main, args=(*common, i, events, go, stop, 100 + i), daemon=True)
                   for i in range(DISPATCHERS)]
    admitters = [ctx.Process(target=admitter_main, args=(*common, plans[i], events, go, stop), daemon=True)
                 for i in range(ADMITTERS)]
    procs = schedulers + dispatchers + admitters
    checker = Checker(db_url, config, policies)
    rebuilder = RingRebuilder(platform)
    conn = psycopg.connect(db_url, autocommit=True, row_factory=dict_row)
    request.addfinalizer(platform.close)
    request.addfinalizer(conn.close)
    kill_report: dict = {}
    try:
        for pr in procs:
            pr.start()
        ready = ev.wait_for("ready", len(procs), 120)
        assert len(ready) == len(procs), f"only {len(ready)} of {len(procs)} processes started"
        checker.start()
        rebuilder.start()
        t0 = time.monotonic()
        go.set()

        def succeeded() -> int:
            return conn.execute("select count(*) as n from generation_task where state = 'SUCCEEDED'").fetchone()["n"]

        # Kill one scheduler in the middle of a claim transaction once the run is well under way.
        while succeeded() < KILL_AT_FRACTION * TASKS:
            assert time.monotonic() - t0 < RUN_DEADLINE_SECONDS, f"only {succeeded()} tasks done before the kill point"
            ev.pump(0.1)
        arm.set()
        got = ev.wait_for("in_claim", 1, 30)
        assert got, "the victim scheduler never entered a claim after being armed"
        kill_report = got[0][1]
        victim = schedulers[0]
        time.sleep(0.2)  # let its queue feeder thread release the queue's lock: the victim stays stalled in its claim
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        assert victim.exitcode == -signal.SIGKILL
        # PostgreSQL notices the dead client and aborts its transaction; wait for the backend to go.
        end = time.monotonic() + 15
        while conn.execute("select count(*) as n from pg_stat_activity where pid = %s",
                           (kill_report["backend_pid"],)).fetchone()["n"]:
            assert time.monotonic() < end, "the killed scheduler's backend never went away"
            time.sleep(0.05)
        assert kill_report["state_in_tx"] == "DISPATCHING" and kill_report["increments"] >= 3
        leftovers = conn.execute(
            """select (select count(*) from task_attempt where attempt_id = %(a)s) as attempts,
                      (select count(*) from resource_reservation where attempt_id = %(a)s) as reservations,
                      (select count(*) from outbox_event where event_type = 'TaskDispatchRequested'
                          and payload->>'attempt_id' = %(a)s::text) as events,
                      (select current_attempt_id from generation_task where task_id = %(t)s) as current""",
            {"a": kill_report["attempt_id"], "t": kill_report["task_id"]}).fetchone()
        assert (leftovers["attempts"], leftovers["reservations"], leftovers["events"]) == (0, 0, 0), dict(leftovers)
        assert str(leftovers["current"]) != kill_report["attempt_id"]

        # The survivors finish the run.
        while (done := succeeded()) < TASKS:
            assert time.monotonic() - t0 < RUN_DEADLINE_SECONDS, f"only {done} of {TASKS} tasks SUCCEEDED in time"
            ev.pump(0.1)
        elapsed = time.monotonic() - t0
        # Let the late duplicate completions drain, then stop everyone.
        end = time.monotonic() + 20
        while books.r.llen(books.k("late_dups")) and time.monotonic() < end:
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        stop.set()
        checker.stop()
        rebuilder.stop()
        for pr in procs:
            pr.join(20)
            if pr.is_alive():
                pr.kill()
                pr.join(5)

    ev.drain()
    reports = ev.seen
    errors = [r for r in reports if r[0] == "error"]
    assert not errors, errors
    dispatched = [r[1] for r in reports if r[0] == "dispatched"]
    scheduled = [r[1] for r in reports if r[0] == "scheduled"]
    admitted = sum(r[1] for r in reports if r[0] == "admitted")
    assert admitted == TASKS
    assert len(scheduled) == SCHEDULERS - 1 and len(dispatched) == DISPATCHERS

    # The simulator's own books: nothing went wrong in the dispatchers, nothing above any account's max.
    sim_errors = books.r.lrange(books.k("errors"), 0, 20)
    assert sim_errors == [], sim_errors
    peaks = {}
    for p in config.providers:
        for a in p.accounts:
            acct = f"{p.name}/{a.account_id}"
            peaks[acct] = (int(books.r.get(books.k("peak", acct)) or 0), a.max_concurrency)
            assert int(books.r.get(books.k("inflight", acct)) or 0) == 0
    for acct, (peak, cap) in peaks.items():
        assert peak <= cap, f"{acct} ran {peak} jobs at once at the provider; max_concurrency {cap}"
    assert any(peak == cap for peak, cap in peaks.values()), f"no account ever saturated: {peaks}"
    submits = books.r.hgetall(books.k("submits"))
    assert len(submits) == TASKS and set(submits.values()) == {"1"}, "a task was submitted to the provider twice"
    wins = books.r.hgetall(books.k("wins"))
    assert len(wins) == TASKS and set(wins.values()) == {"1"}, "an attempt was completed (CAS won) twice or never"
    dup_concurrent = sum(d.get("dup_concurrent", 0) for d in dispatched)
    dup_late = sum(d.get("dup_late", 0) for d in dispatched)
    assert dup_concurrent > 0 and dup_late > 0, (dup_concurrent, dup_late)

    # What the checker saw while it ran.
    assert checker.samples >= 20, checker.samples
    assert checker.violations == [], checker.violations[:10]
    name_of = {t.tenant_id: n for n, t in tenants.items()}
    for tid, (n, u) in checker.peak_tenant.items():
        pol = policies[tid]
        assert n <= pol["max_running_tasks"] and u <= pol["max_running_units"]

    # The end state.
    states = conn.execute("select state, count(*) as n from generation_task group by state").fetchall()
    assert {r["state"]: r["n"] for r in states} == {"SUCCEEDED": TASKS}
    attempts = conn.execute("""select count(*) as n, count(distinct task_id) as tasks, max(attempt_no) as max_no,
                                      count(*) filter (where state = 'SUCCEEDED') as ok from task_attempt""").fetchone()
    assert (attempts["n"], attempts["tasks"], attempts["max_no"], attempts["ok"]) == (TASKS, TASKS, 1, TASKS), dict(attempts)
    assert conn.execute("select count(*) as n from resource_reservation where state = 'ACTIVE'").fetchone()["n"] == 0
    assert conn.execute("select count(*) as n from resource_pool_shard where used_units <> 0").fetchone()["n"] == 0
    per_attempt = conn.execute("""select count(*) as n from (select attempt_id from resource_reservation
                                   group by attempt_id, resource_key having count(*) > 1) d""").fetchone()["n"]
    assert per_attempt == 0, "an attempt reserved one resource key twice"
    with conn.transaction():
        assert rebuild_counters(conn) == 0
    dispatch_events = conn.execute(
        "select count(*) as n from outbox_event where event_type = 'TaskDispatchRequested'").fetchone()["n"]
    assert dispatch_events == TASKS
    served = {name_of[r["tenant_id"]]: r["u"] for r in conn.execute(
        "select tenant_id, sum(fairness_units)::bigint as u from generation_task group by tenant_id").fetchall()}

    summary = {
        "elapsed_s": round(elapsed, 1),
        "provider_peak_vs_max": peaks,
        "pg_peak_live_attempts_per_account": dict(checker.peak_account_pg),
        "tenant_peak_running_tasks_units_vs_caps": {
            name_of[t]: (v[0], v[1], policies[t]["max_running_tasks"], policies[t]["max_running_units"])
            for t, v in checker.peak_tenant.items()},
        "lane_peak_used_vs_capacity": {k: (v, checker.capacity.get(k)) for k, v in checker.peak_key.items() if k.startswith("lane:")},
        "borrowed_claims": checker.borrowed_claims,
        "ring_tenants_readded_by_rebuilder": rebuilder.readded,
        "checker_samples": checker.samples,
        "duplicates": {"concurrent": dup_concurrent, "late": dup_late},
        "killed_mid_claim": kill_report,
        "scheduler_claims": scheduled,
        "units_per_tenant": served,
    }
    print("\nscheduler invariants:", json.dumps(summary, indent=1, default=str))
