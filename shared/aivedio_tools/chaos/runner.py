"""`aivedio chaos --seed S`: one chaos run, start to verdict.

1. The plan (aivedio_tools.chaos.plan) is drawn from the seed, written and printed first.
2. A database of the run's own on the given PostgreSQL, a private redis-server, the provider
   simulator (given 10x the platform's account limits, so its peak is what the platform ran), and a
   TCP fault proxy in front of each of the three: every platform process reaches them through it.
3. The platform as OS processes (aivedio_tools.chaos.node): two API, two scheduler, two dispatcher
   processes and one reconciler, each restarted when it dies (a failpoint's crash included).
4. The workload over the HTTP API (aivedio_tools.chaos.workload) and the fault injector, for the
   duration; a sampler records the shards' counters every half second.
5. Then the faults stop, every process is up, and the run waits for every task to settle within
   the liveness bound; a last read of every task; the processes stop.
6. The facts are dumped from PostgreSQL, the simulator's truth beside them, and the checkers
   (pure functions of the run directory) give the verdict: `aivedio chaos check DIR` gives it again.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import selectors
import signal
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from aivedio.admin.tenants import create_tenant
from aivedio.bootstrap import apply_config
from aivedio.config import (
    LaneConfig,
    MediaConfig,
    PlatformConfig,
    ProviderAccount,
    ProviderConfig,
    SchedulerConfig,
    Settings,
    SimulatorBehaviour,
    Timers,
)
from aivedio.context import build_platform
from aivedio.db.migrate import migrate, schema_fingerprint
from aivedio.faults import failpoints, safeguards
from aivedio_tools.chaos import checkers, db_faults, facts, proxy, records, redis_faults
from aivedio_tools.chaos import plan as plans
from aivedio_tools.chaos.redis_server import RedisServer, free_port
from aivedio_tools.chaos.workload import History, Workload
from aivedio_tools.provider_sim import SimulatorServer
from aivedio import tasks

log = logging.getLogger("aivedio_tools.chaos")

PROVIDER = "sim-chaos"
WEBHOOK_SECRET = "whsec_Y2hhb3Mtc3VpdGUtd2ViaG9vay1zZWNyZXQ="  # the run's simulator and receiver share it
SIM_HEADROOM = 10
SUBMIT_TIMEOUT_S = 1.0
# Platform seconds at plan.TIME_SCALE (40): a lease is 3 s real, the lease scanner looks every 1 s,
# a SUBMIT_UNKNOWN goes to review after 10 s; plan.LIVENESS_BOUND_S allows for all of it.
TIMERS = Timers(
    scheduler_tick_seconds=2, outbox_relay_seconds=2, poll_first_seconds=6, poll_min_seconds=6, poll_max_seconds=12,
    poll_error_backoff_max_seconds=20, unknown_first_check_seconds=4, unknown_backoff_max_seconds=20,
    unknown_safe_window_seconds=400, requeue_backoff_base_seconds=4, requeue_backoff_max_seconds=40,
    lease_seconds=120, attempt_recovery_seconds=40, aging_step_seconds=80, reconciler_seconds=40)
OPEN_POLICY = dict(user_submit_rate_per_minute=100_000, tenant_submit_rate_per_minute=100_000, max_user_queued_tasks=10_000,
                   max_user_queued_units=100_000, max_queued_tasks=10_000, max_queued_units=100_000,
                   max_cost_per_minute=100_000_000, max_cost_per_day=1_000_000_000, max_wait_seconds=100_000_000,
                   allow_best_effort_downgrade=False, max_running_tasks=10_000, max_running_units=10_000,
                   max_user_running_tasks=10_000, max_user_running_units=10_000)
CREDITS = 100_000_000
READY_TIMEOUT_S = 90.0
RESTART_DELAY_S = 0.5
SAMPLE_EVERY_S = 0.5
STOP_TIMEOUT_S = 10.0

SAMPLE_SQL = """
select s.resource_key, s.shard_no, s.used_units, s.capacity_units,
       coalesce((select sum(r.reserved_units) from resource_reservation r
                  where r.resource_key = s.resource_key and r.shard_no = s.shard_no and r.state = 'ACTIVE'), 0)::bigint
         as active_reserved
  from resource_pool_shard s"""
LIVE_ATTEMPTS_SQL = f"""
select provider_account, count(*)::int as n from task_attempt
 where state in ({tasks.sql_list(tasks.ATTEMPT_LIVE)}) group by provider_account"""
OPEN_TASKS_SQL = f"""
select count(*)::int as n from generation_task where state not in ({tasks.sql_list(tasks.TERMINAL | {"MANUAL_REVIEW"})})"""
# Ended tasks whose charge is not finalized yet: their terminal event is still on its way through
# the relay and settlement (a dispatcher restarted after a crash takes a few seconds).
UNSETTLED_TASKS_SQL = f"""
select count(*)::int as n from generation_task t join generation_charge c using (task_id)
 where t.state in ({tasks.sql_list(tasks.TERMINAL)}) and c.finalized_at is null"""
SETTLEMENT_GRACE_S = 10.0


def platform_config(sim_url: str, behaviour: dict[str, Any], timers: dict[str, float] | None = None) -> PlatformConfig:
    provider = ProviderConfig(name=PROVIDER, base_url=sim_url, submit_timeout_seconds=SUBMIT_TIMEOUT_S,
                              simulator=SimulatorBehaviour(**behaviour), webhook_secret=WEBHOOK_SECRET,
                              accounts=[ProviderAccount(account_id=a, api_key=f"key-{a}", max_concurrency=n)
                                        for a, n in plans.ACCOUNTS.items()])
    lanes = {"ENTERPRISE_RESERVED": LaneConfig(capacity_units=500, borrowable_units=200, min_headroom_units=50,
                                               max_wait_seconds=10**7),
             "PAID_SHARED": LaneConfig(capacity_units=1200, max_wait_seconds=10**7),
             "STANDARD": LaneConfig(capacity_units=600, max_wait_seconds=10**7)}
    return PlatformConfig(time_scale=plans.TIME_SCALE, providers=[provider], timers=TIMERS.model_copy(update=timers or {}), lanes=lanes,
                          scheduler=SchedulerConfig(tick_budget_seconds=0.5, batch_size=4), media=MediaConfig(enabled=False))


def _with_db(url: str, name: str) -> str:
    u = urlsplit(url)
    return urlunsplit((u.scheme, u.netloc, f"/{name}", u.query, u.fragment))


def _via(url: str, port: int) -> str:
    """The URL with its host and port replaced by the fault proxy's, and no `host=` of a unix
    socket's directory left in its query (libpq would prefer that to the proxy)."""
    u = urlsplit(url)
    auth = u.netloc.rsplit("@", 1)[0] + "@" if "@" in u.netloc else ""
    query = urlencode([(k, v) for k, v in parse_qsl(u.query, keep_blank_values=True) if k != "host"])
    return urlunsplit((u.scheme, f"{auth}127.0.0.1:{port}", u.path, query, u.fragment))


def postgres_upstream(url: str) -> tuple[str, int | None]:
    """Where the fault proxy reaches the PostgreSQL of `url`: its host and port, or the path of its
    unix socket (`?host=<directory>`, as the embedded server's URL names it) and no port."""
    u = urlsplit(url)
    directory = dict(parse_qsl(u.query)).get("host") or (u.hostname if (u.hostname or "").startswith("/") else None)
    if directory:
        return f"{directory}/.s.PGSQL.{u.port or 5432}", None
    return u.hostname or "127.0.0.1", u.port or 5432


def create_database(admin_url: str, label: str) -> str:
    """A fresh migrated database, cloned from a template of the current schema (made once)."""
    template = f"aivedio_chaos_tpl_{schema_fingerprint()[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as c:
        if c.execute("select 1 from pg_database where datname = %s", (template,)).fetchone() is None:
            tmp = f"{template}_{os.getpid()}"
            c.execute(sql.SQL("create database {}").format(sql.Identifier(tmp)))
            migrate(_with_db(admin_url, tmp))
            try:
                c.execute(sql.SQL("alter database {} rename to {}").format(sql.Identifier(tmp), sql.Identifier(template)))
            except psycopg.errors.DuplicateDatabase:  # another run made it first
                c.execute(sql.SQL("drop database {}").format(sql.Identifier(tmp)))
        name = f"aivedio_chaos_{label}_{os.getpid()}"[:63]
        c.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))
        for attempt in range(20):
            try:
                c.execute(sql.SQL("create database {} template {}").format(sql.Identifier(name), sql.Identifier(template)))
                break
            except psycopg.errors.ObjectInUse:  # another run is cloning the template this instant
                time.sleep(0.1 * (attempt + 1))
        else:
            raise RuntimeError("could not clone the chaos template database")
        # A crash of the database server is not what this simulates: commits need not wait for the disk.
        c.execute(sql.SQL("alter database {} set synchronous_commit = off").format(sql.Identifier(name)))
    return _with_db(admin_url, name)


def drop_database(admin_url: str, db_url: str) -> None:
    name = urlsplit(db_url).path.lstrip("/")
    with psycopg.connect(admin_url, autocommit=True) as c:
        c.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


@dataclass
class Node:
    role: str
    index: int
    proc: subprocess.Popen | None = None
    held_down: bool = False  # a fault holds it down (killed, not yet restarted): no supervisor restart
    starts: int = 0
    exits: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


class Cluster:
    """The platform's processes, restarted when they die, except while a fault holds one down."""

    def __init__(self, spec_path: Path, env: dict[str, str], plan: dict[str, Any], logs: Path):
        self.spec_path, self.env, self.plan, self.logs = spec_path, env, plan, logs
        self.nodes = {n.name: n for n in (Node(r, i) for r, k in plan["roles"].items() for i in range(k))}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="chaos-supervisor", daemon=True)

    def _env_of(self, node: Node) -> dict[str, str]:
        armed = self.plan["failpoints"]
        seed = self.plan["seeds"]["failpoints"] + 1000 * node.starts + zlib.crc32(node.name.encode()) % 1000
        return {**os.environ, **self.env, **failpoints.env_for(seed % 2**31, armed, self.plan["stalls"])}

    def start(self, node: Node) -> None:
        if self._stop.is_set():  # a fault's restart timer firing after teardown starts nothing
            return
        with (self.logs / f"{node.name}.log").open("ab") as out:  # the child keeps its own copy of the handle
            node.proc = subprocess.Popen([sys.executable, "-m", "aivedio_tools.chaos.node", str(self.spec_path), node.role,
                                          str(node.index)], stdout=subprocess.PIPE, stderr=out, env=self._env_of(node))
        node.starts += 1

    def wait_ready(self, nodes: list[Node], timeout: float = READY_TIMEOUT_S) -> None:
        """Each node's "ready" line, within the timeout (a node hung in its start fails the run, it
        does not hang it)."""
        deadline = time.monotonic() + timeout
        for node in nodes:
            assert node.proc is not None and node.proc.stdout is not None
            with selectors.DefaultSelector() as sel:
                sel.register(node.proc.stdout, selectors.EVENT_READ)
                while True:
                    left = deadline - time.monotonic()
                    line = node.proc.stdout.readline() if left > 0 and sel.select(min(left, 1.0)) else b""
                    if b'"ready"' in line:
                        break
                    if not line and (node.proc.poll() is not None or time.monotonic() > deadline):
                        tail = (self.logs / f"{node.name}.log").read_text(errors="replace")[-3000:]
                        raise RuntimeError(f"chaos node {node.name} did not start (exit {node.proc.poll()}):\n{tail}")

    def start_all(self) -> None:
        for node in self.nodes.values():
            self.start(node)
        self.wait_ready(list(self.nodes.values()))
        self._supervisor.start()

    def _supervise(self) -> None:
        while not self._stop.wait(0.2):
            with self._lock:
                for node in self.nodes.values():
                    if node.proc is not None and not node.held_down and node.proc.poll() is not None:
                        node.exits.append(node.proc.returncode)
                        time.sleep(RESTART_DELAY_S)
                        self.start(node)

    def kill(self, name: str) -> None:
        with self._lock:
            node = self.nodes[name]
            node.held_down = True
            if node.proc is not None and node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait()
                node.exits.append(node.proc.returncode)

    def revive(self, name: str) -> None:
        with self._lock:
            node = self.nodes[name]
            if node.proc is None or node.proc.poll() is not None:
                self.start(node)
            node.held_down = False

    def signal(self, name: str, sig: int) -> None:
        with self._lock:
            node = self.nodes[name]
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(sig)

    def all_up(self) -> None:
        for name, node in self.nodes.items():
            self.signal(name, signal.SIGCONT)
            if node.held_down or node.proc is None or node.proc.poll() is not None:
                self.revive(name)

    def stop_all(self) -> None:
        self._stop.set()
        self._supervisor.join(5) if self._supervisor.is_alive() else None
        for node in self.nodes.values():
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGCONT)
                node.proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for node in self.nodes.values():
            if node.proc is None:
                continue
            try:
                node.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()

    def failpoints_hit(self) -> dict[str, int]:
        """What the processes' failpoints did, from the line each writes to its log as it fires."""
        out: dict[str, int] = {}
        for path in self.logs.glob("*.log"):
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("FAILPOINT "):
                    name, _, rest = line[len("FAILPOINT "):].partition(": ")
                    kind = f"{'stall' if rest.startswith('stalling') else 'crash'}:{name}"
                    out[kind] = out.get(kind, 0) + 1
        return out

    def exit_counts(self) -> dict[str, Any]:
        crashes = {n.name: sum(1 for c in n.exits if c == failpoints.EXIT_CODE) for n in self.nodes.values()}
        return {"starts": {n.name: n.starts for n in self.nodes.values()},
                "failpoint_crashes": sum(crashes.values()),
                "other_exits": {n.name: [c for c in n.exits if c not in (failpoints.EXIT_CODE, -signal.SIGKILL)]
                                for n in self.nodes.values() if any(c not in (failpoints.EXIT_CODE, -signal.SIGKILL) for c in n.exits)}}


class Injector:
    """Carries out the plan's timed fault events; each one's end (a restart, a SIGCONT, a cleared
    proxy) is scheduled when it starts. stop() ends them all at once."""

    def __init__(self, plan: dict[str, Any], t0: float, cluster: Cluster, proxies: dict[str, Any], redis_server: Any,
                 admin_url: str, db_url: str, faults_path: Path):
        self.plan, self.t0, self.cluster, self.proxies = plan, t0, cluster, proxies
        self.redis_server, self.admin_url, self.db_url = redis_server, admin_url, db_url
        self.dbname = urlsplit(db_url).path.lstrip("/")
        self._f = faults_path.open("a", buffering=1)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pending: list[threading.Timer] = []
        self._handles: list[Any] = []
        self.rng = random.Random(plan["seeds"]["faults"] + 1)
        self.counts: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="chaos-injector", daemon=True)

    def note(self, kind: str, target: str | None, detail: dict[str, Any] | None = None, **more: Any) -> None:
        detail = {**(detail or {}), **more}
        with self._lock:
            self._f.write(json.dumps({"t": round(time.monotonic() - self.t0, 3), "kind": kind, "target": target,
                                      "detail": detail}, default=str) + "\n")
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def later(self, seconds: float, fn, *args) -> None:
        t = threading.Timer(seconds, fn, args)
        t.daemon = True
        self._pending.append(t)
        t.start()

    def start(self) -> "Injector":
        self._thread.start()
        return self

    def _run(self) -> None:
        for ev in self.plan["faults"]:
            if self._stop.wait(max(0.0, ev["t"] - (time.monotonic() - self.t0))):
                return
            try:
                self.apply(ev)
            except Exception as e:  # noqa: BLE001 - a fault that could not be applied is noted, not fatal
                self.note("fault-error", ev.get("target"), fault=ev["kind"], error=repr(e))

    def apply(self, ev: dict[str, Any]) -> None:
        kind, target = ev["kind"], ev.get("target")
        if kind == "kill":
            self.cluster.kill(target)
            self.note(kind, target, restart_after=ev["seconds"])
            self.later(ev["seconds"], self._revive, target)
        elif kind == "stop":
            self.cluster.signal(target, signal.SIGSTOP)
            self.note(kind, target, cont_after=ev["seconds"])
            self.later(ev["seconds"], self._cont, target)
        elif kind == "pg-terminate":
            self.note(kind, self.dbname, db_faults.terminate_random_backends(self.admin_url, self.dbname, self.rng, ev["n"]))
        elif kind == "pg-hold-row":
            table = ev["table"]
            where = "true" if table == "resource_pool_shard" else "tenant_id = (select tenant_id from wallet_account order by random() limit 1)"
            self._handles.append(db_faults.hold_row_lock(self.db_url, table, where, (), ev["seconds"]))
            self.note(kind, table, seconds=ev["seconds"])
        elif kind == "pg-pin-xmin":
            self._handles.append(db_faults.pin_xmin(self.db_url, ev["seconds"]))
            self.note(kind, self.dbname, seconds=ev["seconds"])
        elif kind == "pg-lock-timeout":
            self._handles.append(db_faults.short_lock_timeout(self.admin_url, self.dbname, ev["ms"], ev["seconds"]))
            self.note(kind, self.dbname, ms=ev["ms"], seconds=ev["seconds"])
        elif kind == "redis-flushall":
            redis_faults.flushall(self.redis_server.url)
            self.note(kind, "redis")
        elif kind == "redis-pause":
            redis_faults.client_pause(self.redis_server.url, ev["ms"])
            self.note(kind, "redis", ms=ev["ms"])
        elif kind == "redis-kill":
            self.redis_server.kill()
            self.note(kind, "redis", restart_after=ev["seconds"])
            self.later(ev["seconds"], self._redis_up)
        elif kind == "proxy":
            px = self.proxies[target]
            px.set_mode(ev["mode"], ms=ev["ms"]) if ev["mode"] == "delay" else px.set_mode(ev["mode"])
            self.note(f"proxy-{ev['mode']}", target, seconds=ev["seconds"], ms=ev.get("ms"))
            self.later(ev["seconds"], px.clear)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")

    def _revive(self, name: str) -> None:
        self.cluster.revive(name)

    def _cont(self, name: str) -> None:
        self.cluster.signal(name, signal.SIGCONT)

    def _redis_up(self) -> None:
        if self.redis_server.proc is None or self.redis_server.proc.poll() is not None:
            self.redis_server.restart()

    def stop(self) -> None:
        """Every fault ends now: the pending ends run at once, processes are up and continued, and
        the database's lock_timeout is its default again (two overlapping short-lock-timeout faults
        would otherwise restore each other's short value)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5)
        for t in self._pending:
            if t.is_alive() or not t.finished.is_set():
                t.cancel()
                t.function(*t.args)
        for px in self.proxies.values():
            px.clear()
        self._redis_up()
        self.cluster.all_up()
        for h in self._handles:
            if hasattr(h, "join"):
                h.join(10)
        with psycopg.connect(self.admin_url, autocommit=True) as c:
            c.execute(sql.SQL("alter database {} reset lock_timeout").format(sql.Identifier(self.dbname)))
        self._f.close()


class Sampler:
    """The shards' counters and the live attempts, every SAMPLE_EVERY_S, in one snapshot each."""

    def __init__(self, db_url: str, path: Path, t0: float):
        self.db_url, self.path, self.t0 = db_url, path, t0
        self.samples = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-sampler", daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def _run(self) -> None:
        with self.path.open("a", buffering=1) as f:
            conn = None
            while not self._stop.wait(SAMPLE_EVERY_S):
                try:
                    if conn is None or conn.closed:
                        conn = psycopg.connect(self.db_url, autocommit=True, row_factory=dict_row)
                    with conn.transaction():
                        conn.execute("set transaction isolation level repeatable read, read only")
                        shards = conn.execute(SAMPLE_SQL).fetchall()
                        live = {r["provider_account"]: r["n"] for r in conn.execute(LIVE_ATTEMPTS_SQL).fetchall()}
                    f.write(json.dumps({"t": round(time.monotonic() - self.t0, 3), "shards": shards, "live_attempts": live}) + "\n")
                    self.samples += 1
                except psycopg.Error:  # a terminated backend or a held lock: the next sample tries again
                    self.errors += 1
                    conn = None
            if conn is not None:
                conn.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _make_tenants(platform, plan: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for t in plan["tenants"]:
        name = f"chaos-{plan['seed']}-{t['name']}"
        created = create_tenant(platform, name=name, service_class=t["service_class"], weight=t["weight"], credits=CREDITS,
                                operator="chaos", policy_overrides=dict(OPEN_POLICY), trusted=True)
        out[t["name"]] = {**created.as_dict(), "charge_policy": t["charge_policy"]}
    return out


def _settle(db_url: str, bound_s: float) -> float | None:
    """Seconds until no task is open (terminal or MANUAL_REVIEW), or None past the bound; then up to
    SETTLEMENT_GRACE_S more for the tasks that ended last to be settled, so the checkers read a task
    that ended a moment ago as settled rather than never settled (a settlement that never comes is
    still theirs to find: the grace only waits)."""
    t0 = time.monotonic()
    settled = None
    while time.monotonic() - t0 <= bound_s:
        try:
            with psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as c:
                if c.execute(OPEN_TASKS_SQL).fetchone()["n"] == 0 and not c.execute(LIVE_ATTEMPTS_SQL).fetchall():
                    settled = time.monotonic() - t0
                    break
        except psycopg.Error:
            pass
        time.sleep(0.5)
    if settled is None:
        return None
    grace_until = time.monotonic() + SETTLEMENT_GRACE_S
    while time.monotonic() < grace_until:
        try:
            with psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as c:
                if c.execute(UNSETTLED_TASKS_SQL).fetchone()["n"] == 0:
                    break
        except psycopg.Error:
            pass
        time.sleep(0.25)
    return settled


def run(seed: int, duration: float, out_dir: Path, *, admin_url: str, target: str | None = None,
        breaks: tuple[str, ...] = (), keep_db: bool = False, untargeted: bool = False, echo=None) -> dict[str, Any]:
    """One chaos run into out_dir; returns the verdict (aivedio_tools.chaos.checkers.verdict). A break
    aims the plan at its safeguard unless `untargeted` (the seed's own plan, the switch on)."""
    echo = echo or (lambda s: None)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the simulator's webhook requests, one line each
    plan = plans.make_plan(seed, duration, target=target, breaks=breaks, untargeted=untargeted)
    child_env = safeguards.env_for(list(breaks))  # raises on an unknown name before anything starts
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("history.jsonl", "faults.jsonl", "samples.jsonl"):
        (out_dir / stale).unlink(missing_ok=True)
    logs = out_dir / "logs"
    logs.mkdir(exist_ok=True)
    for line in plans.describe(plan):
        echo(line)

    # Each part is undone (last made, first undone) as soon as it exists: a failure while the run is
    # set up, such as a redis-server that does not start, leaks neither the database nor a server.
    with contextlib.ExitStack() as cleanup:
        db_url = create_database(admin_url, f"{seed}")
        if not keep_db:
            cleanup.callback(drop_database, admin_url, db_url)
        redis_server = RedisServer(out_dir / "redis")
        cleanup.callback(redis_server.stop)  # before start: a server that starts but never answers is stopped too
        redis_server.start()
        behaviour = SimulatorBehaviour(**plan["provider"])
        sim_accounts = [ProviderAccount(account_id=a, api_key=f"key-{a}", max_concurrency=n * SIM_HEADROOM)
                        for a, n in plans.ACCOUNTS.items()]
        sim = SimulatorServer(ProviderConfig(name=PROVIDER, base_url=None, webhook_secret=WEBHOOK_SECRET, accounts=sim_accounts,
                                             simulator=behaviour, submit_timeout_seconds=SUBMIT_TIMEOUT_S),
                              behaviour, plans.TIME_SCALE, port=0).start()
        cleanup.callback(sim.stop)
        proxies = {}
        for name, (host, port) in {"pg": postgres_upstream(db_url), "redis": ("127.0.0.1", redis_server.port),
                                   "provider": ("127.0.0.1", urlsplit(sim.base_url).port)}.items():
            proxies[name] = proxy.FaultProxy(host, port).start()
            cleanup.callback(proxies[name].stop)

        api_port = free_port()
        api_url = f"http://127.0.0.1:{api_port}"
        config = platform_config(f"http://127.0.0.1:{proxies['provider'].port}", plan["provider"], plan.get("timers"))
        prefix = f"chaos{seed}"
        node_settings = {"database_url": _via(db_url, proxies["pg"].port), "redis_url": _via(redis_server.url, proxies["redis"].port),
                         "redis_prefix": prefix, "home": str(out_dir / "home"), "log_level": "WARNING", "api_base_url": api_url}
        spec = {"settings": node_settings, "config": config.model_dump(mode="json"), "api_port": api_port, "api_url": api_url,
                "pool_size": 4, "workflow_workers": 6, "deliveries": plan["deliveries"], "delivery_seed": plan["seeds"]["deliveries"]}
        spec_path = out_dir / "spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))

        direct = build_platform(Settings(database_url=db_url, redis_url=redis_server.url, redis_prefix=prefix,
                                         home=out_dir / "home", log_level="WARNING", api_base_url=api_url), config, pool_size=2)
        cleanup.callback(direct.close)
        cluster = sampler = injector = workload = history = None
        result: dict[str, Any] = {}
        try:
            with direct.db.connection() as c:
                apply_config(c, config, direct.clock)
            tenants = _make_tenants(direct, plan)
            plan["params"]["tenants"] = {n: {"tenant_id": t["tenant_id"], "charge_policy": t["charge_policy"]} for n, t in tenants.items()}
            (out_dir / "plan.json").write_text(json.dumps(plan, indent=1))

            cluster = Cluster(spec_path, child_env, plan, logs)
            cluster.start_all()
            echo(f"  {len(cluster.nodes)} processes up; load for {duration:g}s")
            t0 = time.monotonic()
            started_at = datetime.now(timezone.utc)
            history = History(out_dir / "history.jsonl", t0)
            sampler = Sampler(db_url, out_dir / "samples.jsonl", t0).start()
            workload = Workload(plan, tenants, api_port, history).start()
            injector = Injector(plan, t0, cluster, proxies, redis_server, admin_url, db_url, out_dir / "faults.jsonl").start()
            time.sleep(duration)
            workload.stop()
            load_stopped = time.monotonic() - t0
            injector.stop()
            faults_stopped = time.monotonic() - t0
            echo(f"  faults stopped at {faults_stopped:.1f}s; waiting for every task to settle")
            settle = _settle(db_url, plans.LIVENESS_BOUND_S)
            settled_t = None if settle is None else faults_stopped + settle
            time.sleep(1.0)  # late webhooks and repeated deliveries land: nothing may change a settled task
            read = workload.read_all()
            sampler.stop()
            cluster.stop_all()
            with psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as c:
                counts = facts.dump(c, out_dir)
            (out_dir / "truth.json").write_text(json.dumps(sim.truth, default=str))
            run_doc = {"seed": seed, "duration_s": duration, "plan_digest": plans.digest(plan), "started_at": started_at.isoformat(),
                       "load_stopped_t": round(load_stopped, 3), "faults_stopped_t": round(faults_stopped, 3),
                       "settled_t": None if settled_t is None else round(settled_t, 3), "final_reads": read,
                       "history": dict(history.counts), "faults": {**injector.counts, **cluster.failpoints_hit()},
                       "samples": sampler.samples,
                       "sample_errors": sampler.errors, "facts": counts, "processes": cluster.exit_counts(),
                       "proxies": {k: p.stats() for k, p in proxies.items()}}
            (out_dir / "run.json").write_text(json.dumps(run_doc, indent=1, default=str))
            history.close()

            result = checkers.verdict(records.Run.load(out_dir))
            result.update(run=run_doc)
            (out_dir / "verdict.json").write_text(json.dumps(result, indent=1, default=str))
            return result
        finally:
            for part in (workload, sampler):
                if part is not None:
                    part.stop()
            if cluster is not None:
                cluster._stop.set()  # no restart from here on, whatever timer fires
            if injector is not None:
                try:
                    injector.stop()
                except Exception:  # noqa: BLE001 - the run already failed; the teardown goes on
                    log.warning("chaos injector did not stop cleanly", exc_info=True)
            if cluster is not None:
                cluster.stop_all()
