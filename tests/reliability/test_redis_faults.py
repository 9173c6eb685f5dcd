"""Redis lost in the middle of a 2,000-task run (issue 12, "Done means"; ch. 18.18, 20.12.2).

A redis-server of the test's own (a free port, no persistence; never the shared one) serves one
platform, whose roles run as threads of this process, each with its own Platform as separate
processes would have:
- 2 admitters admit 2,000 tasks of 6 tenants through the real admission path (`admit()`: rate
  limits, queue limits, wallet, ledger, outbox), a few at a time;
- the outbox relay publishes their TaskQueued events to the queue indexer, which puts the tenant on
  its lane's ring (what functions/queue_indexer does), and the claims' TaskDispatchRequested to the
  dispatchers' wake-up;
- 2 scheduler replicas tick (`Scheduler.tick`);
- 2 dispatchers play the attempt workflow and a fast provider: they take claimed attempts to
  RUNNING, hold them a few milliseconds, and complete them with the release of their reservations;
- a checker samples PostgreSQL in one REPEATABLE READ snapshot at a time.

Faults: at 30 % admitted, FLUSHALL; at 60 %, SIGKILL of the redis-server, a while without it
(admission on PostgreSQL buckets, conservative scheduling from PostgreSQL, the indexer's adds lost),
then a fresh, empty redis-server on the same port.

Checked: no task lost (every admitted task exists, and ends SUCCEEDED); no capacity exceeded (at
every sample: each shard's used_units within its capacity and equal to its ACTIVE reservations,
each key's ACTIVE reservations within the configured capacity); after each recovery, with the
workers held still, every tenant with queued work is on its lane's ring, and after the redis-index
service ran the ring equals PostgreSQL's queued set exactly; /healthz said redis down during the
outage; at the end every counter is 0 and the counter repair finds nothing."""
from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import dict_row

from aivedio.config import LaneConfig, Limits, PlatformConfig, ProviderAccount, ProviderConfig, SchedulerConfig, Settings
from tests.conftest import TEST_HOME, create_test_database, drop_test_database
from tests.redis_server import RedisServer, redis_server_binary
from tests.scheduler_support import BODY_1U, BODY_2U, OPEN, UNCAPPED, complete, pick_attempts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.xdist_group("attempt-invariants"),
              pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server binary")]

TASKS = 2000
FLUSH_AT, KILL_AT = 0.30, 0.60
OUTAGE_SECONDS = 2.0
RUN_DEADLINE_SECONDS = 150  # a hard bound; ~40-60 s is usual on 2 shared cores
TIME_SCALE = 50.0
HOLD_MS = (2, 15)  # how long the simulated provider keeps a job
CHECK_EVERY = 0.05
EVENTS_DIR = Path(__file__).resolve().parents[2] / "events"

# tenant -> (service class, weight, tasks)
TENANTS = {
    "ent": ("ENTERPRISE_RESERVED", 3, 300),
    "paid3": ("PAID_SHARED", 3, 450),
    "paid1": ("PAID_SHARED", 1, 350),
    "std2": ("STANDARD", 2, 400),
    "std1": ("STANDARD", 1, 300),
    "free": ("BEST_EFFORT", 1, 200),
}
assert sum(t[2] for t in TENANTS.values()) == TASKS


def make_config() -> PlatformConfig:
    """12 provider slots over three accounts, lanes small enough to bind."""
    return PlatformConfig(
        time_scale=TIME_SCALE,
        providers=[
            ProviderConfig(name="sim-a", accounts=[ProviderAccount(account_id="a1", max_concurrency=5),
                                                   ProviderAccount(account_id="a2", max_concurrency=3)]),
            ProviderConfig(name="sim-b", accounts=[ProviderAccount(account_id="b1", max_concurrency=4)]),
        ],
        lanes={"ENTERPRISE_RESERVED": LaneConfig(capacity_units=5, borrowable_units=2, min_headroom_units=1),
               "PAID_SHARED": LaneConfig(capacity_units=7), "STANDARD": LaneConfig(capacity_units=5),
               "BEST_EFFORT": LaneConfig(capacity_units=3)},
        limits=Limits(pool_shards=2),
        scheduler=SchedulerConfig(tick_budget_seconds=0.3, batch_size=4),
    )


class World:
    """The run's shared state: who is admitted, the faults' progress, the holds, the errors."""

    def __init__(self):
        self.lock = threading.Lock()
        self.admitted: list[uuid.UUID] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.holding: set[str] = set()  # workers that park at their next turn
        self.parked: set[str] = set()
        self.wake = {"scheduler": threading.Event(), "dispatcher": threading.Event(), "relay": threading.Event()}
        self.samples = 0
        self.redis_down_seen: dict | None = None

    def error(self, msg: str) -> None:
        with self.lock:
            self.errors.append(msg)

    def park_point(self, who: str) -> None:
        """Where a worker waits while the test holds it still."""
        if who not in self.holding:
            return
        with self.lock:
            self.parked.add(who)
        while who in self.holding and not self.stop.is_set():
            time.sleep(0.005)
        with self.lock:
            self.parked.discard(who)

    def held_still(self, workers: set[str], timeout: float = 20.0) -> None:
        self.holding |= workers
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.parked >= workers:
                    return
            for e in self.wake.values():
                e.set()
            time.sleep(0.005)
        raise AssertionError(f"workers did not park: {workers - self.parked}")

    def release(self) -> None:
        self.holding = set()


def _platform(db_url: str, redis_url: str, prefix: str, pool_size: int):
    from aivedio.context import build_platform

    return build_platform(Settings(database_url=db_url, redis_url=redis_url, redis_prefix=prefix, home=TEST_HOME,
                                   log_level="WARNING"), make_config(), pool_size=pool_size)


def _loop(world: World, who: str, body) -> None:
    try:
        while not world.stop.is_set():
            world.park_point(who)
            body()
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
        world.error(f"{who}: {e!r}")
        raise


# --- the roles -------------------------------------------------------------------------------------------------

def admitter(world: World, p, plan: list, who: str) -> None:
    from aivedio.admission.models import GenerationRequest
    from aivedio.admission.service import admit
    from aivedio.auth import Caller

    items = iter(plan)

    def body():
        for _ in range(4):  # a few at a time, then a look at the hold
            item = next(items, None)
            if item is None:
                world.stop.wait(0.05)
                return
            tenant_id, user_id, req, key = item
            a = admit(p, Caller(tenant_id, user_id, "OWNER"), GenerationRequest(**req), req, key)
            with world.lock:
                world.admitted.append(uuid.UUID(json.loads(a.body)["task_id"]))
        world.wake["relay"].set()

    _loop(world, who, body)


def relay(world: World, p) -> None:
    """The outbox relay and the queue indexer behind it (functions/queue_indexer: Ring.add)."""
    from aivedio import outbox
    from aivedio.scheduling.ring import Ring

    ring = Ring(p)

    def deliver(envelope: dict) -> None:
        if envelope["event_type"] == "TaskQueued":
            ring.add(envelope["payload"]["queue_class"], uuid.UUID(envelope["payload"]["tenant_id"]))
            world.wake["scheduler"].set()
        elif envelope["event_type"] == "TaskDispatchRequested":
            world.wake["dispatcher"].set()

    def body():
        if outbox.relay_once(p, deliver, batch=200) == 0:
            world.wake["relay"].wait(0.05)
            world.wake["relay"].clear()

    _loop(world, "relay", body)


def scheduler(world: World, p, who: str) -> None:
    from aivedio.scheduling.scheduler import Scheduler

    s = Scheduler(p)

    def body():
        r = s.tick(p.config.scheduler.tick_budget_seconds)
        if r.claims:
            world.wake["relay"].set()
        else:
            world.wake["scheduler"].wait(0.05)
            world.wake["scheduler"].clear()

    _loop(world, who, body)


def dispatcher(world: World, p, who: str, seed: int) -> None:
    rng = random.Random(seed)

    def body():
        picked = pick_attempts(p, 16)
        if not picked:
            world.wake["dispatcher"].wait(0.05)
            world.wake["dispatcher"].clear()
            return
        time.sleep(rng.uniform(*HOLD_MS) / 1000)
        for a in picked:
            won, released = complete(p, a)
            if not won or not released:
                world.error(f"completion of {a.attempt_id}: won={won} released={released}")
        world.wake["scheduler"].set()

    _loop(world, who, body)


CHECK_SHARDS = """select s.resource_key, s.shard_no, s.used_units, s.capacity_units, coalesce(r.units, 0) as reserved
                    from resource_pool_shard s
                    left join (select resource_key, shard_no, sum(reserved_units)::bigint as units from resource_reservation
                                where state = 'ACTIVE' group by 1, 2) r using (resource_key, shard_no)"""


def checker(world: World, db_url: str, capacity: dict[str, int]) -> None:
    try:
        with psycopg.connect(db_url, row_factory=dict_row) as c:
            while not world.stop.is_set():
                with c.transaction():
                    c.execute("set transaction isolation level repeatable read")
                    by_key: dict[str, int] = defaultdict(int)
                    for r in c.execute(CHECK_SHARDS).fetchall():
                        if r["used_units"] > r["capacity_units"] or r["used_units"] != r["reserved"]:
                            world.error(f"shard {r['resource_key']}#{r['shard_no']}: used {r['used_units']}, "
                                        f"capacity {r['capacity_units']}, reserved {r['reserved']}")
                        by_key[r["resource_key"]] += r["reserved"]
                    for key, held in by_key.items():
                        if key in capacity and held > capacity[key]:
                            world.error(f"{key}: {held} units reserved, capacity {capacity[key]}")
                world.samples += 1
                time.sleep(CHECK_EVERY)
    except Exception as e:  # noqa: BLE001
        world.error(f"checker: {e!r}")


# --- the test --------------------------------------------------------------------------------------------------

def _plan(p) -> tuple[list, list]:
    """Tenants, and the admissions of the two admitters (interleaved tenants, stable order)."""
    from tests.admission_support import new_tenant

    rng = random.Random(12)
    items = []
    for name, (cls, weight, n) in TENANTS.items():
        t = new_tenant(p, service_class=cls, weight=weight, credits=100_000_000, **{**OPEN, **UNCAPPED})
        for i in range(n):
            items.append((t.tenant_id, t.user_id, BODY_2U if i % 5 == 0 else BODY_1U, f"{name}-{i}"))
    rng.shuffle(items)
    return items[0::2], items[1::2]


def _ring_vs_postgresql(p, db_url) -> tuple[dict, dict]:
    """Per lane: the ring's members and PostgreSQL's tenants with queued work."""
    from aivedio.scheduling.ring import Ring, active_tenants_pg

    ring = Ring(p)
    rings, queued = {}, {}
    with psycopg.connect(db_url, row_factory=dict_row) as c:
        for lane in p.config.lanes:
            members, listed = ring.members(lane)
            assert sorted(members) == sorted(listed), f"{lane}: list and set disagree"
            rings[lane] = members
            queued[lane] = {str(t) for t in active_tenants_pg(c, lane)}
    return rings, queued


def _healthz(p) -> dict:
    from aivedio.context import set_platform
    from aivedio_tools.local.lambda_context import FakeLambdaContext
    from functions.api.handler import lambda_handler

    set_platform(p)
    try:
        resp = lambda_handler(json.loads((EVENTS_DIR / "api_healthz.json").read_text()), FakeLambdaContext("aivedio-api"))
    finally:
        set_platform(None)
    return json.loads(resp["body"])


def test_flushall_and_a_killed_redis_mid_run_lose_nothing_and_exceed_nothing(tmp_path):
    from aivedio.bootstrap import apply_config
    from aivedio.observability import logger
    from aivedio.reconcile import capacity_counters, redis_index
    from aivedio.scheduling.resources import platform_pools, rebuild_counters

    level = logger.log_level
    logger.setLevel("ERROR")  # thousands of admissions; the expected outage warnings are not news
    server = RedisServer(tmp_path / "redis").start()
    db_url = create_test_database("redis_faults")
    prefix = f"t{uuid.uuid4().hex[:8]}"
    made = []
    world = World()
    try:
        def plat(pool):
            made.append(_platform(db_url, server.url, prefix, pool))
            return made[-1]

        setup = plat(4)
        with setup.db.connection() as c:
            apply_config(c, setup.config, setup.clock)
        plan_a, plan_b = _plan(setup)
        capacity = {k: cap for k, (cap, _) in platform_pools(setup.config).items()}
        roles = [
            (admitter, (world, plat(3), plan_a, "admit-a")),
            (admitter, (world, plat(3), plan_b, "admit-b")),
            (relay, (world, plat(2))),
            (scheduler, (world, plat(3), "sched-1")),
            (scheduler, (world, plat(3), "sched-2")),
            (dispatcher, (world, plat(2), "disp-1", 1)),
            (dispatcher, (world, plat(2), "disp-2", 2)),
        ]
        roles = [threading.Thread(target=fn, args=args, daemon=True, name=f"redis-faults-{i}") for i, (fn, args) in enumerate(roles)]
        workers = {"admit-a", "admit-b", "relay", "sched-1", "sched-2", "disp-1", "disp-2"}
        check = threading.Thread(target=checker, args=(world, db_url, capacity), daemon=True, name="redis-faults-check")
        t0 = time.monotonic()
        for th in (*roles, check):
            th.start()

        def admitted() -> int:
            with world.lock:
                return len(world.admitted)

        def wait_admitted(n: int) -> None:
            while admitted() < n:
                assert time.monotonic() - t0 < RUN_DEADLINE_SECONDS and not world.errors, world.errors[:5]
                time.sleep(0.01)

        def recovered_index(label: str) -> dict:
            """Hold the world still; the ring holds every queued tenant; after the repair, exactly them."""
            deadline = time.monotonic() + 20
            while True:  # the ticks rebuild each lane's index once Redis answers
                if all(server.client().exists(f"{prefix}:queue:index_built:{lane}") for lane in setup.config.lanes):
                    break
                assert time.monotonic() < deadline, f"{label}: the index was never rebuilt"
                time.sleep(0.02)
            # The admitters and the ticks first; then the relay, once it has drained the outbox: a tenant
            # whose TaskQueued is still in the outbox is on its way to the ring, not lost from it.
            world.held_still(workers - {"relay"})
            with psycopg.connect(db_url) as c:
                while c.execute("select count(*) from outbox_event where status = 'PENDING'").fetchone()[0]:
                    assert time.monotonic() < deadline, f"{label}: the outbox never drained"
                    time.sleep(0.01)
            world.held_still({"relay"})
            try:
                rings, queued = _ring_vs_postgresql(setup, db_url)
                for lane in setup.config.lanes:
                    assert rings[lane] >= queued[lane], f"{label}: {lane} lost queued tenants {queued[lane] - rings[lane]}"
                report = redis_index.run_once(setup)
                rings, queued = _ring_vs_postgresql(setup, db_url)
                assert rings == queued, f"{label}: after the repair {rings} != {queued}"
                return {"queued_tenants": sum(map(len, queued.values())), "repaired": report.repaired}
            finally:
                world.release()

        wait_admitted(int(TASKS * FLUSH_AT))
        server.client().flushall()
        flushed_at = admitted()
        after_flush = recovered_index("after FLUSHALL")

        wait_admitted(int(TASKS * KILL_AT))
        server.kill()
        killed_at = admitted()
        time.sleep(OUTAGE_SECONDS / 2)
        world.redis_down_seen = _healthz(setup)
        time.sleep(OUTAGE_SECONDS / 2)
        during_outage = admitted() - killed_at
        server.start()  # empty: no persistence
        after_restart = recovered_index("after the restart")

        # Everything admitted, and every admitted task done.
        wait_admitted(TASKS)
        with psycopg.connect(db_url, row_factory=dict_row) as c:
            while True:
                states = Counter(r["state"] for r in c.execute("select state from generation_task").fetchall())
                if states.get("SUCCEEDED", 0) == TASKS:
                    break
                assert time.monotonic() - t0 < RUN_DEADLINE_SECONDS and not world.errors, (states, world.errors[:5])
                time.sleep(0.1)
        took = time.monotonic() - t0
        world.stop.set()
        for th in (*roles, check):
            th.join(30)

        assert not world.errors, world.errors[:10]
        assert world.samples > 50, world.samples
        assert flushed_at < killed_at and during_outage > 0, (flushed_at, killed_at, during_outage)  # admission went on
        doc = world.redis_down_seen
        assert doc["redis"] == "down" and doc["database"] == "ok" and "redis" in doc["degraded"], doc
        with psycopg.connect(db_url, row_factory=dict_row) as c:
            ids = {r["task_id"] for r in c.execute("select task_id from generation_task").fetchall()}
            assert ids == set(world.admitted) and len(ids) == TASKS  # no task lost, none made up
            assert c.execute("select count(*) as n from resource_reservation where state = 'ACTIVE'").fetchone()["n"] == 0
            assert c.execute("select coalesce(sum(used_units), 0) as n from resource_pool_shard").fetchone()["n"] == 0
            one_attempt = c.execute("""select count(*) as n from (select task_id from task_attempt group by task_id
                                                                   having count(*) <> 1) x""").fetchone()["n"]
            assert one_attempt == 0
            with c.transaction():
                assert rebuild_counters(c) == 0
            pg_buckets = c.execute("select count(*) as n from rate_limit_bucket").fetchone()["n"]
        assert pg_buckets > 0  # the outage's admissions were rate limited in PostgreSQL
        assert capacity_counters.run_once(setup).repaired == 0
        redis_index.run_once(setup)
        rings, queued = _ring_vs_postgresql(setup, db_url)
        assert rings == queued == {lane: set() for lane in setup.config.lanes}
        print(f"\nredis faults: {TASKS} tasks in {took:.1f}s, {world.samples} samples; flush at {flushed_at} "
              f"{after_flush}; kill at {killed_at}, {during_outage} admitted during the outage; {after_restart}")
    finally:
        world.stop.set()
        for th in threading.enumerate():
            if th.name.startswith("redis-faults-"):
                th.join(30)
        for p in made:
            p.close()
        server.stop()
        drop_test_database(db_url)
        logger.setLevel(level)
