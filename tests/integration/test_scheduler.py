"""The fair scheduler in one process, over the real PostgreSQL and Redis (issue 4).

- the atomic claim: a claim that fails on one resource key (a tenant cap, checked after several
  increments that succeeded) leaves the task QUEUED with no attempt, no reservation, no event and
  every counter as it was; a second claim of one task fails its CAS, also when two race;
- release is a CAS: releasing twice (or twice at once) decrements once;
- DRR: weights 4:2:1 get 4:2:1 of a saturated lane's cost units;
- aging promotes a waiting task one band per aging step and never above P1; the starvation
  detector records and logs an intervention once;
- the enterprise lane lends at most borrowable_units, keeps min_headroom_units unlent, and stops
  lending while ENTERPRISE_RESERVED work is queued, leaving running borrowed work alone;
- with Redis disabled the scheduler still claims by DRR from PostgreSQL (conservative mode, with
  BEST_EFFORT and EXPENSIVE paused); after a Redis flush the ring is rebuilt.

Each test gets a database of its own: pools and queues are global, so tests must not share them."""
from __future__ import annotations

import threading
from collections import Counter
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from psycopg.rows import dict_row

from aivedio.config import LaneConfig, Limits, ManualClock, PlatformConfig, ProviderAccount, ProviderConfig, SchedulerConfig
from aivedio.scheduling import claim as claim_mod
from aivedio.scheduling import router
from aivedio.scheduling.claim import LENDER_KEY, NoRoom, claim
from aivedio.scheduling.maintenance import TOP_AGING_BAND, age_tasks, detect_starvation
from aivedio.scheduling.resources import ensure_platform_pools, rebuild_counters, release_attempt
from aivedio.scheduling.ring import _keys as ring_keys
from aivedio.scheduling.ring import Ring, built_key
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import new_tenant, second_user
from tests.conftest import create_test_database, drop_test_database
from tests.scheduler_support import (BODY_1U, BODY_EXPENSIVE, OPEN, UNCAPPED, complete, counters, finish_all, pick_attempts,
                                     submit, used)

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis_cluster]
ENT, PAID, STD, BE = "ENTERPRISE_RESERVED", "PAID_SHARED", "STANDARD", "BEST_EFFORT"


@pytest.fixture
def db_url():
    """A fresh database per test (overrides the per-module one of conftest)."""
    url = create_test_database("scheduler")
    yield url
    drop_test_database(url)


def make_config(lanes: dict | None = None, shards: int = 2, **scheduler) -> PlatformConfig:
    """One roomy provider account; the enterprise lane lends nothing unless a test says so."""
    return PlatformConfig(
        providers=[ProviderConfig(name="sim-a", accounts=[ProviderAccount(account_id="a1", max_concurrency=500)])],
        lanes={ENT: LaneConfig(capacity_units=500, borrowable_units=0), **(lanes or {})},
        limits=Limits(pool_shards=shards),
        scheduler=SchedulerConfig(**scheduler),
    )


def start(make_platform, config: PlatformConfig, **kw):
    p = make_platform(config, **kw)
    with p.db.connection() as c:
        ensure_platform_pools(c, config)
    return p


def tenant(p, service_class=PAID, weight=1, **policy):
    return new_tenant(p, service_class=service_class, weight=weight, credits=10_000_000, **{**OPEN, **policy})


def task_row(conn, task_id) -> dict:
    return conn.execute("select * from generation_task where task_id = %s", (task_id,)).fetchone()


def footprint(conn, task_id) -> dict:
    """What a claim of this task would have written."""
    q = lambda sql: conn.execute(sql, (task_id,)).fetchone()["n"]  # noqa: E731
    return {
        "attempts": q("select count(*) as n from task_attempt where task_id = %s"),
        "reservations": q("select count(*) as n from resource_reservation where task_id = %s"),
        "dispatch_events": q("select count(*) as n from outbox_event where event_type = 'TaskDispatchRequested' and aggregate_id = %s"),
    }


def claim_args(p, conn, task: dict, *, lane_key: str | None = None) -> tuple:
    policy = conn.execute("select * from tenant_scheduling_policy where tenant_id = %s", (task["tenant_id"],)).fetchone()
    route = router.route(p, task, policy["service_class"])[0]
    kw = dict(lane_key=lane_key or f"lane:{task['queue_class']}", borrowed=False, shards=p.config.limits.pool_shards,
              lease_seconds=300.0, now=p.clock.now(), ensured=set())
    return route, policy, kw


# --- the atomic claim --------------------------------------------------------------------------------------

def test_a_claim_failing_on_a_tenant_cap_leaves_the_task_queued_and_every_counter_as_it_was(make_platform, conn, monkeypatch):
    p = start(make_platform, make_config())
    t = tenant(p, max_running_tasks=1, max_running_units=100, max_user_running_tasks=100, max_user_running_units=100)
    first, second = submit(p, t.tenant_id, t.user_id, n=2)
    task1 = task_row(conn, first)
    route, policy, kw = claim_args(p, conn, task1)
    with conn.transaction():
        c1 = claim(conn, task1, route, policy, **kw)
    assert c1.fencing_token > 0 and task_row(conn, first)["state"] == "DISPATCHING"

    # The second claim passes cost, lane, model and both provider keys (sorted order) before the
    # tenant's running_tasks key refuses it: everything it did must roll back.
    assert sum(1 for k in sorted(counters(conn)) if k[0] < f"tenant:{t.tenant_id}:running_tasks" and counters(conn)[k]) >= 5
    before_counters, task2 = counters(conn), task_row(conn, second)
    with conn.transaction():  # the caller's transaction commits; only the claim's subtransaction rolls back
        with pytest.raises(NoRoom) as e:
            claim(conn, task2, route, policy, **kw)
    assert e.value.key == f"tenant:{t.tenant_id}:running_tasks" and e.value.tenant_bound
    after = task_row(conn, second)
    assert (after["state"], after["version"], after["current_attempt_id"], after["current_fencing_token"]) == (
        "QUEUED", task2["version"], None, None)
    assert footprint(conn, second) == {"attempts": 0, "reservations": 0, "dispatch_events": 0}
    assert counters(conn) == before_counters

    # The scheduler meets the same cap: the tenant is CAPPED, nothing changes.
    report = Scheduler(p).tick(2)
    assert report.claims == 0
    assert task_row(conn, second)["state"] == "QUEUED" and counters(conn) == before_counters
    with conn.transaction():
        assert rebuild_counters(conn) == 0


def test_a_second_claim_of_a_task_fails_its_cas_even_when_two_race(make_platform, conn, db_url):
    p = start(make_platform, make_config())
    t = tenant(p, **UNCAPPED)
    one, two = submit(p, t.tenant_id, t.user_id, n=2)
    task = task_row(conn, one)
    route, policy, kw = claim_args(p, conn, task)
    with conn.transaction():
        c = claim(conn, task, route, policy, **kw)
    before = counters(conn)
    for stale_or_fresh in (task, task_row(conn, one)):  # the row as read before the claim, and as it is now
        with conn.transaction():
            with pytest.raises(NoRoom) as e:
                claim(conn, stale_or_fresh, route, policy, **kw)
        assert e.value.key == "task:moved"
    assert counters(conn) == before
    assert footprint(conn, one) == {"attempts": 1, "reservations": len(
        conn.execute("select 1 from resource_reservation where attempt_id = %s", (c.attempt_id,)).fetchall()), "dispatch_events": 1}

    # Two schedulers claim one task at the same instant: one wins; the other waits on the row, then fails its CAS.
    task2 = task_row(conn, two)
    barrier, results = threading.Barrier(2), []

    def racer():
        with psycopg.connect(db_url, row_factory=dict_row) as c2:
            barrier.wait(10)
            try:
                with c2.transaction():
                    results.append(claim(c2, task2, route, policy, **{**kw, "ensured": set()}))
            except NoRoom as err:
                results.append(err.key)

    threads = [threading.Thread(target=racer) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert len(results) == 2 and results.count("task:moved") == 1, results
    assert footprint(conn, two)["attempts"] == 1
    assert conn.execute("select count(*) as n from task_attempt").fetchone()["n"] == 2
    with conn.transaction():
        assert rebuild_counters(conn) == 0


def test_a_rolled_back_claim_does_not_leave_its_tenant_capped(make_platform, conn):
    """The per-tenant pools are created by a tenant's first claim, and a scheduler remembers which it
    created. A claim that fails (here: its lane is full) or whose transaction rolls back (a deadlock
    retry) takes the new pools with it; the next claim must not trust the memory and fail as CAPPED."""
    p = start(make_platform, make_config({BE: LaneConfig(capacity_units=0)}))
    ensured: set = set()
    for rollback in ("claim fails", "transaction rolls back"):
        t = tenant(p, **UNCAPPED)
        (tid,) = submit(p, t.tenant_id, t.user_id)
        task = task_row(conn, tid)
        route, policy, kw = claim_args(p, conn, task)
        kw["ensured"] = ensured
        if rollback == "claim fails":
            with conn.transaction():
                with pytest.raises(NoRoom) as e:
                    claim(conn, task, route, policy, **{**kw, "lane_key": f"lane:{BE}"})  # a lane with no room
            assert e.value.key == f"lane:{BE}"
        else:
            with pytest.raises(ZeroDivisionError):
                with conn.transaction():
                    claim(conn, task, route, policy, **kw)
                    1 / 0
        assert not conn.execute("select 1 from resource_pool_shard where resource_key like %s",
                                (f"tenant:{t.tenant_id}:%",)).fetchall()
        with conn.transaction():
            c = claim(conn, task_row(conn, tid), route, policy, **kw)
        assert task_row(conn, tid)["current_attempt_id"] == c.attempt_id
        assert used(conn, f"tenant:{t.tenant_id}:running_tasks") == 1


def test_releasing_an_attempt_twice_decrements_once(make_platform, conn, db_url):
    p = start(make_platform, make_config())
    t = tenant(p, **UNCAPPED)
    a, b = submit(p, t.tenant_id, t.user_id, n=2)
    claimed = []
    for tid in (a, b):
        task = task_row(conn, tid)
        route, policy, kw = claim_args(p, conn, task)
        with conn.transaction():
            claimed.append(claim(conn, task, route, policy, **kw))
    held = conn.execute("select resource_key, shard_no, reserved_units from resource_reservation where attempt_id = %s",
                        (claimed[0].attempt_id,)).fetchall()
    assert len(held) >= 8  # lane, account, provider, model, cost, worker:cpu, tenant x2, user x2
    before = counters(conn)
    with conn.transaction():
        first = release_attempt(conn, claimed[0].attempt_id, p.clock.now())
    assert len(first) == len(held)
    expected = dict(before)
    for r in held:
        expected[(r["resource_key"], r["shard_no"])] -= r["reserved_units"]
    assert counters(conn) == expected
    with conn.transaction():
        assert release_attempt(conn, claimed[0].attempt_id, p.clock.now()) == []
    assert counters(conn) == expected

    # Two releases of the other attempt at once: one decrements, the other finds nothing ACTIVE.
    barrier, results = threading.Barrier(2), []

    def releaser():
        with psycopg.connect(db_url, row_factory=dict_row) as c2:
            barrier.wait(10)
            with c2.transaction():
                results.append(len(release_attempt(c2, claimed[1].attempt_id, p.clock.now())))

    threads = [threading.Thread(target=releaser) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert sorted(results) == [0, len(held)], results
    assert conn.execute("select count(*) as n from resource_pool_shard where used_units <> 0").fetchone()["n"] == 0
    with conn.transaction():
        assert rebuild_counters(conn) == 0


# --- DRR ----------------------------------------------------------------------------------------------------

def test_drr_gives_weights_4_2_1_their_share_of_a_saturated_lane(make_platform, conn):
    # quantum = base_quantum x weight = 4, 2, 1 units: a DRR round is 7 units, and the lane holds 5,
    # so turns are cut short by capacity and must resume where they stopped.
    p = start(make_platform, make_config({PAID: LaneConfig(capacity_units=5)}, base_quantum=1))
    weights = {"w4": 4, "w2": 2, "w1": 1}
    tenants = {n: tenant(p, weight=w, **UNCAPPED) for n, w in weights.items()}
    for n, t in tenants.items():
        submit(p, t.tenant_id, t.user_id, n=45 * weights[n])
    name_of = {t.tenant_id: n for n, t in tenants.items()}
    s = Scheduler(p)
    served: Counter = Counter()
    rounds = 0
    while rounds < 200:
        # Measure only while every tenant is backlogged: the lane is saturated and DRR decides.
        queued = {r["tenant_id"] for r in conn.execute(
            "select distinct tenant_id from generation_task where state = 'QUEUED'").fetchall()}
        if len(queued) < 3:
            break
        s.tick(5)
        for a in finish_all(p):
            served[name_of[a.tenant_id]] += 1  # 1 unit each
        rounds += 1
        assert used(conn, f"lane:{PAID}") == 0
    total = sum(served.values())
    assert total >= 150, (rounds, served)
    shares = {n: served[n] / total for n in weights}
    ideal = {n: w / sum(weights.values()) for n, w in weights.items()}
    # Armada's fairness error: the sum of shortfalls below the fair share, as a fraction of the whole.
    error = sum(max(0.0, ideal[n] - shares[n]) for n in weights)
    assert error <= 0.03, (shares, ideal, served)
    for n in weights:
        assert abs(shares[n] - ideal[n]) <= 0.03, (shares, ideal, served)


def _shares_while_backlogged(p, conn, tenants: dict, weights: dict, *, finish_per_tick=None, max_rounds=300) -> Counter:
    """Ticks as the deployed tick runs them (a new Scheduler per invocation), completing running
    work between ticks, and counts claims per tenant while every tenant still has queued work."""
    name_of = {t.tenant_id: n for n, t in tenants.items()}
    served: Counter = Counter()
    running: list = []  # oldest first, as a provider finishes equal jobs
    for _ in range(max_rounds):
        queued = {r["tenant_id"] for r in conn.execute(
            "select distinct tenant_id from generation_task where state = 'QUEUED'").fetchall()}
        if len(queued) < len(tenants):
            break
        Scheduler(p).tick(5)
        claimed = pick_attempts(p, 1000)
        for a in claimed:
            served[name_of[a.tenant_id]] += 1
        running += claimed
        done, running = (running, []) if finish_per_tick is None else (running[:finish_per_tick], running[finish_per_tick:])
        for a in done:
            complete(p, a)
    return served


def _fairness_error(served: Counter, weights: dict) -> tuple[float, dict]:
    total = sum(served.values())
    shares = {n: served[n] / total for n in weights}
    ideal = {n: w / sum(weights.values()) for n, w in weights.items()}
    return max(abs(shares[n] - ideal[n]) for n in weights), shares


def test_weights_hold_when_a_provider_account_binds_not_the_lane(make_platform, conn):
    # The case: a lane of 200 in front of one provider account of 6, three backlogged tenants
    # at 4:2:1, a new Scheduler per tick as in AWS (and as the local tick loop calls the handler).
    # Turns are cut short by the account, not the lane; they must resume across ticks.
    cfg = PlatformConfig(providers=[ProviderConfig(name="sim-a", accounts=[ProviderAccount(account_id="a1", max_concurrency=6)])],
                         lanes={ENT: LaneConfig(capacity_units=500, borrowable_units=0), PAID: LaneConfig(capacity_units=200)},
                         limits=Limits(pool_shards=1), scheduler=SchedulerConfig(base_quantum=1))
    p = start(make_platform, cfg)
    weights = {"w4": 4, "w2": 2, "w1": 1}
    tenants = {n: tenant(p, weight=w, **UNCAPPED) for n, w in weights.items()}
    for n, t in tenants.items():
        submit(p, t.tenant_id, t.user_id, n=30 * weights[n])
    served = _shares_while_backlogged(p, conn, tenants, weights, finish_per_tick=2)
    assert sum(served.values()) >= 60, served
    error, shares = _fairness_error(served, weights)
    print(f"provider-bound 4:2:1: shares {shares}, error {error:.4f}")
    assert error <= 0.03, (shares, served)
    assert used(conn, "provider-account:sim-a:a1") <= 6


def test_each_provider_pool_follows_the_weights_of_the_tenants_backlogged_on_it(make_platform, conn):
    # Two accounts, each serving one model: w4 and w1 order m-a (account of 4 slots), w2 and w2b order
    # m-b (account of 2). Pool a's shares follow 4:1, pool b's 1:1, and the scarcity of one pool costs
    # the tenants of the other nothing.
    cfg = PlatformConfig(providers=[
        ProviderConfig(name="prov-a", models=["m-a"], accounts=[ProviderAccount(account_id="a1", max_concurrency=4)]),
        ProviderConfig(name="prov-b", models=["m-b"], accounts=[ProviderAccount(account_id="b1", max_concurrency=2)])],
        lanes={ENT: LaneConfig(capacity_units=500, borrowable_units=0), PAID: LaneConfig(capacity_units=200)},
        limits=Limits(pool_shards=1), scheduler=SchedulerConfig(base_quantum=1))
    p = start(make_platform, cfg)
    weights = {"w4": 4, "w1": 1, "w2": 2, "w2b": 2}
    model = {"w4": "m-a", "w1": "m-a", "w2": "m-b", "w2b": "m-b"}
    tenants = {n: tenant(p, weight=w, **UNCAPPED) for n, w in weights.items()}
    for n, t in tenants.items():
        submit(p, t.tenant_id, t.user_id, n=25 * weights[n], body={**BODY_1U, "model": model[n]})
    served = _shares_while_backlogged(p, conn, tenants, weights, finish_per_tick=2)
    for pool in (("w4", "w1"), ("w2", "w2b")):
        error, shares = _fairness_error(Counter({n: served[n] for n in pool}), {n: weights[n] for n in pool})
        print(f"pool {pool}: shares {shares}, error {error:.4f}")
        assert sum(served[n] for n in pool) >= 20 and error <= 0.03, (pool, shares, served)


def test_a_roomy_lane_grants_several_rounds_per_turn_with_the_same_shares(make_platform, conn):
    # 60 free units, 2 tenants of weights 2 and 1, base quantum 1: a rotation of the ring grants
    # 60 // (2 tenants x 1 x heaviest weight 2) = 15 rounds' quanta each (30 and 15 units), fitting
    # the room, then fewer as the room shrinks. The shares stay 2:1 in a fraction of the visits a
    # one-quantum turn needs (one visit per 1.5 units on average).
    p = start(make_platform, make_config({PAID: LaneConfig(capacity_units=60)}, base_quantum=1))
    heavy, light = tenant(p, weight=2, **UNCAPPED), tenant(p, weight=1, **UNCAPPED)
    submit(p, heavy.tenant_id, heavy.user_id, n=60)
    submit(p, light.tenant_id, light.user_id, n=60)
    with p.db.connection() as c:
        Ring(p).rebuild(c, PAID)  # the queue index is up: not the conservative mode, which turns one quantum at a time
    report = Scheduler(p).tick(10)
    served = Counter(a.tenant_id for a in finish_all(p))
    assert served[heavy.tenant_id] + served[light.tenant_id] == 60, served
    assert abs(served[heavy.tenant_id] - 40) <= 2, served
    assert report.visits <= 20, report  # 40 with one quantum per turn


def test_a_saturated_lane_serves_a_newcomer_within_one_slot_per_backlogged_tenant(make_platform, conn):
    # The DRR ideal: a tenant that arrives behind a flood waits for as many freed slots as
    # there are backlogged tenants, never for a whole turn of the flood's banked quanta.
    p = start(make_platform, make_config({PAID: LaneConfig(capacity_units=4)}))
    whale, small = tenant(p, **UNCAPPED), tenant(p, **UNCAPPED)
    submit(p, whale.tenant_id, whale.user_id, n=40)
    with p.db.connection() as c:
        Ring(p).rebuild(c, PAID)
    s = Scheduler(p)
    running: list = []

    def free_one_slot_and_tick() -> None:
        if running:
            assert complete(p, running.pop(0))[0]
        s.tick(5)
        running.extend(pick_attempts(p, 100))

    for _ in range(6):  # the whale alone, slot by slot; the last slot began a new turn of the whale's
        free_one_slot_and_tick()  # (with a quantum of 4 units it would hold 3 more slots of that turn)
    assert len(running) == 4
    newcomer = submit(p, small.tenant_id, small.user_id, n=1)[0]
    freed = 0
    while task_row(conn, newcomer)["state"] == "QUEUED":
        assert freed < 2, "the newcomer waited for more slots than there are backlogged tenants"
        free_one_slot_and_tick()
        freed += 1


def test_a_user_at_its_cap_does_not_stop_its_tenants_other_users(make_platform, conn):
    """Issue 15: user A queues 5 tasks at its running cap of 2, user B of the same tenant queues 1;
    B's task is claimed in the same tick as A's capped batch is skipped. Before, a user: key ended
    the tenant's whole turn and B waited behind all of A's batch."""
    p = start(make_platform, make_config({PAID: LaneConfig(capacity_units=20)}))
    t = tenant(p, max_running_tasks=20, max_running_units=20, max_user_running_tasks=2, max_user_running_units=20)
    b = second_user(p, t)
    a_tasks = submit(p, t.tenant_id, t.user_id, n=5)
    (b_task,) = submit(p, t.tenant_id, b.user_id)
    Scheduler(p).tick(5)
    states = {tid: task_row(conn, tid)["state"] for tid in [*a_tasks, b_task]}
    assert states[b_task] == "DISPATCHING"
    assert sorted(states[x] for x in a_tasks) == ["DISPATCHING"] * 2 + ["QUEUED"] * 3


def test_a_visit_reads_past_a_capped_users_heads_to_the_next_user(make_platform, conn):
    # All of the first fit-scan window belongs to a capped user: the visit reads the other users'
    # heads once (a bounded scan) instead of giving up the turn.
    p = start(make_platform, make_config({PAID: LaneConfig(capacity_units=20)}, fit_scan_depth=4))
    t = tenant(p, max_running_tasks=20, max_running_units=20, max_user_running_tasks=1, max_user_running_units=20)
    b = second_user(p, t)
    submit(p, t.tenant_id, t.user_id, n=6)
    (b_task,) = submit(p, t.tenant_id, b.user_id)
    Scheduler(p).tick(5)
    assert task_row(conn, b_task)["state"] == "DISPATCHING"
    running = conn.execute("select user_id, count(*) as n from generation_task where tenant_id = %s and state = 'DISPATCHING' "
                           "group by user_id", (t.tenant_id,)).fetchall()
    assert {r["user_id"]: r["n"] for r in running} == {t.user_id: 1, b.user_id: 1}


def test_a_tenant_cap_still_ends_the_turn(make_platform, conn):
    p = start(make_platform, make_config({PAID: LaneConfig(capacity_units=20)}))
    t = tenant(p, max_running_tasks=2, max_running_units=20, max_user_running_tasks=20, max_user_running_units=20)
    b = second_user(p, t)
    submit(p, t.tenant_id, t.user_id, n=3)
    submit(p, t.tenant_id, b.user_id, n=3)
    Scheduler(p).tick(5)
    n = conn.execute("select count(*) as n from generation_task where tenant_id = %s and state = 'DISPATCHING'",
                     (t.tenant_id,)).fetchone()["n"]
    assert n == 2


def test_a_tenant_whose_tasks_wait_out_a_backoff_stays_on_the_ring(make_platform, conn):
    # A requeue after a 429 makes the task eligible later. A visit before then must not take the
    # tenant off the ring: nothing would visit it again until the queue index is rebuilt.
    clock = ManualClock(datetime.now(timezone.utc))
    p = start(make_platform, make_config({PAID: LaneConfig(capacity_units=4)}), clock=clock)
    t = tenant(p, **UNCAPPED)
    task = submit(p, t.tenant_id, t.user_id, n=1)[0]
    with p.db.connection() as c:
        Ring(p).rebuild(c, PAID)
    conn.execute("update generation_task set next_eligible_at = %s where task_id = %s", (clock.now() + timedelta(seconds=60), task))
    s = Scheduler(p)
    assert s.tick(2).by_lane[PAID] == 0
    ring = [m.decode() if isinstance(m, bytes) else m for m in p.cache.r.lrange(ring_keys(p.cache, PAID)[0], 0, -1)]
    assert str(t.tenant_id) in ring
    clock.advance(61)
    assert s.tick(2).by_lane[PAID] == 1
    assert task_row(conn, task)["state"] == "DISPATCHING"


# --- aging and starvation -----------------------------------------------------------------------------------

def test_aging_promotes_one_band_per_step_and_never_above_p1(make_platform, conn):
    clock = ManualClock(datetime.now(timezone.utc))
    cfg = make_config()
    step = cfg.timers.aging_step_seconds
    p = start(make_platform, cfg, clock=clock)
    t = tenant(p, service_class=BE, **UNCAPPED)
    (old,) = submit(p, t.tenant_id, t.user_id)
    assert task_row(conn, old)["priority_band"] == 4

    def band(tid):
        return task_row(conn, tid)["priority_band"]

    clock.advance(step - 1)
    assert age_tasks(p) == 0 and band(old) == 4
    clock.advance(1)
    assert age_tasks(p) == 1 and band(old) == 3
    assert age_tasks(p) == 0 and band(old) == 3  # the same step again: nothing more
    clock.advance(step)
    (young,) = submit(p, t.tenant_id, t.user_id)  # arrives two steps after the first
    assert age_tasks(p) == 1 and (band(old), band(young)) == (2, 4)
    clock.advance(step)
    assert age_tasks(p) == 2 and (band(old), band(young)) == (1, 3)
    clock.advance(10 * step)
    for _ in range(5):  # however often it runs, a band per elapsed step at most, and P1 at the top
        age_tasks(p)
    assert (band(old), band(young)) == (TOP_AGING_BAND, TOP_AGING_BAND) == (1, 1)
    assert task_row(conn, old)["base_priority_band"] == 4 and task_row(conn, old)["aging_promotions"] == 3

    # The aged task is the tenant's head: a claim takes the best band first.
    (newest,) = submit(p, t.tenant_id, t.user_id)
    assert band(newest) == 4
    s = Scheduler(p)
    assert s.tick(2, lanes=[BE]).conservative  # the lane's index is built first; BEST_EFFORT waits for it
    s.tick(2, lanes=[BE])
    states = {tid: task_row(conn, tid)["state"] for tid in (old, young, newest)}
    assert states[old] == "DISPATCHING" and states[young] == "DISPATCHING", states


def test_the_starvation_detector_records_and_logs_one_intervention(make_platform, conn, caplog):
    clock = ManualClock(datetime.now(timezone.utc))
    p = start(make_platform, make_config({STD: LaneConfig(capacity_units=10, max_wait_seconds=600)}), clock=clock)
    t = tenant(p, service_class=STD, **UNCAPPED)
    (tid,) = submit(p, t.tenant_id, t.user_id)
    assert task_row(conn, tid)["priority_band"] == 3
    clock.advance(599)
    assert detect_starvation(p) == 0
    caplog.clear()
    clock.advance(2)
    assert detect_starvation(p) == 1
    logged = [(r.levelname, getattr(r, "lane", None), getattr(r, "task_id", None)) for r in caplog.records
              if r.getMessage() == "starvation intervention"]
    assert logged == [("WARNING", STD, str(tid))], [r.getMessage() for r in caplog.records]
    rows = conn.execute("select * from scheduler_intervention where task_id = %s", (tid,)).fetchall()
    assert [(r["kind"], r["lane"], r["tenant_id"]) for r in rows] == [("STARVATION", STD, t.tenant_id)]
    assert rows[0]["detail"]["waited_seconds"] >= 600
    assert task_row(conn, tid)["priority_band"] <= TOP_AGING_BAND  # served first on the tenant's next visit
    clock.advance(600)
    assert detect_starvation(p) == 0  # once per task
    assert conn.execute("select count(*) as n from scheduler_intervention").fetchone()["n"] == 1


# --- the enterprise lane lends ------------------------------------------------------------------------------

def _borrowed_running(conn) -> list[dict]:
    return conn.execute(
        """select t.task_id, t.state, t.capacity_mode, a.attempt_id, a.capacity_mode as attempt_mode
             from generation_task t join task_attempt a on a.attempt_id = t.current_attempt_id
            where t.capacity_mode = 'BORROWED' and t.state in ('DISPATCHING', 'RUNNING')""").fetchall()


def test_the_enterprise_lane_lends_at_most_borrowable_units_and_stops_when_its_demand_returns(make_platform, conn):
    lanes = {ENT: LaneConfig(capacity_units=10, borrowable_units=4, min_headroom_units=2), PAID: LaneConfig(capacity_units=3)}
    p = start(make_platform, make_config(lanes))
    paid = tenant(p, **UNCAPPED)
    ent = tenant(p, service_class=ENT, **UNCAPPED)
    submit(p, paid.tenant_id, paid.user_id, n=20)
    s = Scheduler(p)
    r = s.tick(3)
    assert r.claims == 7, r  # 3 in its own lane, 4 borrowed: ENTERPRISE has 10 idle, but lends only 4
    borrowed = _borrowed_running(conn)
    assert len(borrowed) == 4 and all(b["attempt_mode"] == "BORROWED" for b in borrowed)
    assert (used(conn, f"lane:{PAID}"), used(conn, f"lane:{ENT}"), used(conn, LENDER_KEY)) == (3, 4, 4)
    modes = {r["capacity_mode"] for r in conn.execute(
        "select capacity_mode from resource_reservation where attempt_id = %s", (borrowed[0]["attempt_id"],)).fetchall()}
    assert modes == {"BORROWED"}
    assert s.tick(2).claims == 0  # both full

    # A borrowed slot frees: exactly one more is borrowed, never more than 4 at once.
    finish_all(p, only_tasks={borrowed[0]["task_id"]})
    assert s.tick(2).claims == 1 and len(_borrowed_running(conn)) == 4 and used(conn, LENDER_KEY) == 4

    # Reserved demand returns (queued, not yet served): new borrowing stops at once, running borrowed work goes on.
    ent_tasks = submit(p, ent.tenant_id, ent.user_id, n=3)
    still = {b["task_id"]: b for b in _borrowed_running(conn)}
    normal_running = [r["task_id"] for r in conn.execute(
        "select task_id from generation_task where capacity_mode = 'NORMAL' and state = 'DISPATCHING'").fetchall()]
    finish_all(p, only_tasks=set(normal_running[:2]) | {next(iter(still))})  # 2 normal and 1 borrowed finish
    r = s.tick(2, lanes=[PAID])
    assert r.claims == 2, r  # only into its own lane's 2 free units
    new_modes = [r["capacity_mode"] for r in conn.execute(
        "select capacity_mode from generation_task where state = 'DISPATCHING' and task_id <> all(%s)",
        (list(still) + normal_running,)).fetchall()]
    assert new_modes == ["NORMAL", "NORMAL"], new_modes
    running_borrowed = {b["task_id"]: b for b in _borrowed_running(conn)}
    assert set(running_borrowed) == set(still) - {next(iter(still))}  # untouched, not preempted
    for b in running_borrowed.values():
        assert conn.execute("select count(*) as n from resource_reservation where attempt_id = %s and state = 'ACTIVE'",
                            (b["attempt_id"],)).fetchone()["n"] >= 8
    # The enterprise tenant is served in its own lane, beside the borrowed work.
    assert s.tick(2, lanes=[ENT]).claims == 3
    assert {task_row(conn, tid)["state"] for tid in ent_tasks} == {"DISPATCHING"}
    assert used(conn, f"lane:{ENT}") == 3 + len(running_borrowed)
    with conn.transaction():
        assert rebuild_counters(conn) == 0


def test_the_enterprise_lane_keeps_its_minimum_headroom_unlent(make_platform, conn):
    # 6 units, 5 borrowable, 3 kept as headroom: at most 3 may be lent.
    lanes = {ENT: LaneConfig(capacity_units=6, borrowable_units=5, min_headroom_units=3), PAID: LaneConfig(capacity_units=1)}
    p = start(make_platform, make_config(lanes))
    paid = tenant(p, weight=10, **UNCAPPED)  # a quantum of 40 units: one visit could take all 5 lendable
    submit(p, paid.tenant_id, paid.user_id, n=12)
    s = Scheduler(p)
    for _ in range(3):
        s.tick(2)
    assert used(conn, f"lane:{PAID}") == 1
    assert used(conn, LENDER_KEY) == len(_borrowed_running(conn)) <= 3, (used(conn, LENDER_KEY), used(conn, f"lane:{ENT}"))
    assert 6 - used(conn, f"lane:{ENT}") >= 3


# --- without Redis, and after a flush -----------------------------------------------------------------------

def test_without_redis_the_scheduler_claims_fairly_from_postgresql_and_pauses_best_effort_and_expensive(make_platform, conn):
    p = start(make_platform, make_config({PAID: LaneConfig(capacity_units=6)}), redis=False)
    assert p.cache is None
    heavy, light = tenant(p, weight=2, **UNCAPPED), tenant(p, weight=1, **UNCAPPED)
    cheap = tenant(p, service_class=BE, **UNCAPPED)
    submit(p, heavy.tenant_id, heavy.user_id, n=80)
    submit(p, light.tenant_id, light.user_id, n=40)
    be_tasks = submit(p, cheap.tenant_id, cheap.user_id, n=3)
    expensive = submit(p, heavy.tenant_id, heavy.user_id, BODY_EXPENSIVE, n=2)
    assert {task_row(conn, tid)["queue_class"] for tid in be_tasks} == {BE}
    assert {task_row(conn, tid)["queue_class"] for tid in expensive} == {"EXPENSIVE"}
    s = Scheduler(p)
    served: Counter = Counter()
    for _ in range(40):
        queued = {r["tenant_id"] for r in conn.execute(
            "select distinct tenant_id from generation_task where state = 'QUEUED' and queue_class = %s", (PAID,)).fetchall()}
        if len(queued) < 2:
            break
        r = s.tick(5)
        assert r.conservative
        assert "BEST_EFFORT" not in r.by_lane and "EXPENSIVE" not in r.by_lane
        for a in finish_all(p):
            served[a.tenant_id] += 1
    total = served[heavy.tenant_id] + served[light.tenant_id]
    assert total >= 60, served
    share = served[heavy.tenant_id] / total
    assert abs(share - 2 / 3) <= 0.05, (share, served)
    # Paused, though their lanes have room: they wait for Redis to come back.
    assert {task_row(conn, tid)["state"] for tid in be_tasks + expensive} == {"QUEUED"}
    assert served[cheap.tenant_id] == 0


def test_after_a_redis_flush_the_ring_is_rebuilt_from_postgresql(make_platform, conn):
    p = start(make_platform, make_config({PAID: LaneConfig(capacity_units=4)}))
    a, b = tenant(p, **UNCAPPED), tenant(p, **UNCAPPED)
    submit(p, a.tenant_id, a.user_id, n=10, ring=False)  # nobody told the ring: only a rebuild finds them
    submit(p, b.tenant_id, b.user_id, n=10, ring=False)
    cache = p.cache
    ring_key = ring_keys(cache, PAID)[0]  # the ring's list
    s = Scheduler(p)
    first = s.tick(2)
    assert first.conservative and first.claims > 0  # the index was missing: rebuilt, this tick conservative...
    assert set(cache.r.lrange(ring_key, 0, -1)) == {str(a.tenant_id), str(b.tenant_id)}
    assert cache.r.exists(built_key(cache, PAID))
    finish_all(p)
    second = s.tick(2)
    assert not second.conservative and second.claims == 4  # ...the next one is not
    finish_all(p)

    assert cache.delete_prefix() > 0
    assert cache.r.llen(ring_key) == 0 and not cache.r.exists(built_key(cache, PAID))
    third = s.tick(2)
    assert third.conservative and third.claims > 0
    assert set(cache.r.lrange(ring_key, 0, -1)) == {str(a.tenant_id), str(b.tenant_id)}
    assert cache.r.exists(built_key(cache, PAID))
    finish_all(p)
    fourth = s.tick(2)
    assert not fourth.conservative and fourth.claims == 4
    claimed_by = Counter(r["tenant_id"] for r in conn.execute(
        "select tenant_id from task_attempt").fetchall())
    assert claimed_by[a.tenant_id] > 0 and claimed_by[b.tenant_id] > 0
    assert pick_attempts(p, 100)  # the last tick's claims are real attempts
