"""DRR per binding pool (issue 14, part 2): a tenant whose work runs on two provider accounts is two
flows. With one deficit per (lane, tenant), a quantum was split across both accounts, and a turn
paused on a full account held back the tenant's work for the other: a tenant ordering both got 0.14
of account A (fair 0.25) and 0.29 of account B (fair 0.40) in `two-accounts --param both_weight=2`.

Each test gets a database of its own: pools and queues are global, so tests must not share them."""
from __future__ import annotations

from collections import Counter

import pytest

from aivedio.config import LaneConfig, Limits, PlatformConfig, ProviderAccount, ProviderConfig, SchedulerConfig
from aivedio.scheduling.scheduler import LaneView, Scheduler, pool_of
from tests.admission_support import new_tenant
from tests.conftest import create_test_database, drop_test_database
from tests.scheduler_support import BODY_1U, OPEN, UNCAPPED, complete, pick_attempts, submit

pytestmark = pytest.mark.timeout(240)
ENT, PAID = "ENTERPRISE_RESERVED", "PAID_SHARED"
ACC_A, ACC_B = "provider-account:sim-a:a1", "provider-account:sim-b:b1"


@pytest.fixture
def db_url():
    url = create_test_database("scheduler_pools")
    yield url
    drop_test_database(url)


def _platform(make_platform, slots_a: int, slots_b: int):
    from aivedio.scheduling.resources import ensure_platform_pools

    cfg = PlatformConfig(
        providers=[ProviderConfig(name="sim-a", models=["m-a"], accounts=[ProviderAccount(account_id="a1", max_concurrency=slots_a)]),
                   ProviderConfig(name="sim-b", models=["m-b"], accounts=[ProviderAccount(account_id="b1", max_concurrency=slots_b)])],
        lanes={ENT: LaneConfig(capacity_units=500, borrowable_units=0), PAID: LaneConfig(capacity_units=200)},
        limits=Limits(pool_shards=1), scheduler=SchedulerConfig(base_quantum=1))
    p = make_platform(cfg)
    with p.db.connection() as c:
        ensure_platform_pools(c, cfg)
    return p


def _tenant(p, weight: int):
    return new_tenant(p, service_class=PAID, weight=weight, credits=10_000_000, **{**OPEN, **UNCAPPED})


def _body(model: str) -> dict:
    return {**BODY_1U, "model": model}


def test_a_task_s_pool_is_the_accounts_able_to_run_it(make_platform):
    p = _platform(make_platform, 1, 1)
    task = {"model_code": "m-a", "resolution": BODY_1U["resolution"], "duration_seconds": BODY_1U["duration_seconds"]}
    assert pool_of(p.config, task) == ACC_A
    assert pool_of(p.config, {**task, "model_code": "m-b"}) == ACC_B
    assert pool_of(p.config, {**task, "model_code": "no-such-model"}) == ""


def test_a_full_account_pauses_only_its_own_pool(make_platform, conn):
    # Account A has 1 slot, B has 5. The tenant's oldest tasks are for A: once A is full, its turn
    # for A waits, and its work for B goes on in the same visit (one deficit paused the whole turn,
    # so this visit claimed 1 task).
    p = _platform(make_platform, 1, 5)
    t = _tenant(p, 4)  # a quantum of 4 per pool
    submit(p, t.tenant_id, t.user_id, _body("m-a"), n=3)
    submit(p, t.tenant_id, t.user_id, _body("m-b"), n=6)
    with p.db.connection() as c:
        view = LaneView(p, c, PAID)
    r = Scheduler(p).visit(PAID, t.tenant_id, view, conservative=False)
    assert Counter(c.route.account for c in r.claims) == Counter({"a1": 1, "b1": 4}), r
    assert r.pending and not r.drained
    st = conn.execute("select * from drr_lane_tenant where lane = %s and tenant_id = %s", (PAID, t.tenant_id)).fetchone()
    turns = st["pool_turns"]
    assert set(turns) == {ACC_A, ACC_B}, turns
    # A's turn began (one claim) and waits for its account with the rest of its quantum; B spent its quantum.
    assert (turns[ACC_A]["kind"], turns[ACC_A]["on"], turns[ACC_A]["deficit"]) == ("TURN", ACC_A, 3), turns
    assert (turns[ACC_B]["kind"], turns[ACC_B]["deficit"]) == (None, 0), turns
    assert (st["paused_on"], st["paused_kind"], st["deficit"]) == (ACC_A, "TURN", 3), st

    # The tick resumes the paused turn when A has room: only A's pool is served (B had its turn),
    # with no new quantum.
    for a in pick_attempts(p, 100):
        if a.account == "a1":
            complete(p, a)
    with p.db.connection() as c:
        view = LaneView(p, c, PAID)
    r = Scheduler(p).visit(PAID, t.tenant_id, view, conservative=False, resume_keys=frozenset({ACC_A}))
    assert Counter(c.route.account for c in r.claims) == Counter({"a1": 1}), r
    turns = conn.execute("select pool_turns from drr_lane_tenant where lane = %s and tenant_id = %s",
                         (PAID, t.tenant_id)).fetchone()["pool_turns"]
    assert (turns[ACC_A]["deficit"], turns[ACC_B]["deficit"]) == (2, 0), turns


def test_a_tenant_whose_every_pool_is_full_waits_without_a_quantum(make_platform, conn):
    p = _platform(make_platform, 1, 1)
    filler, t = _tenant(p, 1), _tenant(p, 4)
    submit(p, filler.tenant_id, filler.user_id, _body("m-a"))
    submit(p, filler.tenant_id, filler.user_id, _body("m-b"))
    with p.db.connection() as c:
        view = LaneView(p, c, PAID)
    s = Scheduler(p)
    s.visit(PAID, filler.tenant_id, view, conservative=False)  # both accounts full now
    s.visit(PAID, filler.tenant_id, view, conservative=False)
    submit(p, t.tenant_id, t.user_id, _body("m-a"))
    submit(p, t.tenant_id, t.user_id, _body("m-b"))
    assert s.visit(PAID, t.tenant_id, view, conservative=False).outcome == "HELD"
    st = conn.execute("select * from drr_lane_tenant where lane = %s and tenant_id = %s", (PAID, t.tenant_id)).fetchone()
    assert (st["paused_kind"], st["deficit"], st["visits"]) == ("WAITING", 0, 0), st
    assert {k: (v["kind"], v["deficit"]) for k, v in st["pool_turns"].items()} == {ACC_A: ("WAITING", 0), ACC_B: ("WAITING", 0)}


def _served_per_account(p, conn, tenants: dict, *, finish_per_tick: int, rounds: int) -> dict[str, Counter]:
    """Ticks as the deployed tick runs them (a new Scheduler per invocation), completing the oldest
    running work between ticks, and counts claims per account and tenant while every tenant still
    has queued work for every account it orders."""
    name_of = {t.tenant_id: n for n, t in tenants.items()}
    served: dict[str, Counter] = {"a1": Counter(), "b1": Counter()}
    running: list = []
    for _ in range(rounds):
        queued = {(r["tenant_id"], r["model_code"]) for r in conn.execute(
            "select distinct tenant_id, model_code from generation_task where state = 'QUEUED'").fetchall()}
        if len(queued) < 4:  # a-w2 (m-a), b-w1 (m-b), both-w2 (m-a and m-b)
            break
        Scheduler(p).tick(5)
        claimed = pick_attempts(p, 1000)
        for a in claimed:
            served[a.account][name_of[a.tenant_id]] += 1
        running += claimed
        done, running = running[:finish_per_tick], running[finish_per_tick:]
        for a in done:
            complete(p, a)
    return served


def _error(counts: Counter, weights: dict) -> tuple[float, dict]:
    total = sum(counts.values())
    shares = {n: round(counts[n] / total, 3) for n in weights}
    return max(abs(counts[n] / total - w / sum(weights.values())) for n, w in weights.items()), shares


def test_shares_hold_per_account_for_a_tenant_that_orders_both(make_platform, conn):
    # Account A (4 slots) serves a-w2 and both-w2; account B (2 slots) serves b-w1 and both-w2, which
    # submits for A and B alternately. Fair: half of A, and two thirds of B, to both-w2.
    p = _platform(make_platform, 4, 2)
    weights = {"a-w2": 2, "b-w1": 1, "both-w2": 2}
    tenants = {n: _tenant(p, w) for n, w in weights.items()}
    submit(p, tenants["a-w2"].tenant_id, tenants["a-w2"].user_id, _body("m-a"), n=120)
    submit(p, tenants["b-w1"].tenant_id, tenants["b-w1"].user_id, _body("m-b"), n=60)
    both = tenants["both-w2"]
    for _ in range(120):
        submit(p, both.tenant_id, both.user_id, _body("m-a"))
        submit(p, both.tenant_id, both.user_id, _body("m-b"))
    served = _served_per_account(p, conn, tenants, finish_per_tick=2, rounds=150)
    err_a, shares_a = _error(served["a1"], {"a-w2": 2, "both-w2": 2})
    err_b, shares_b = _error(served["b1"], {"b-w1": 1, "both-w2": 2})
    print(f"per-account shares: A {shares_a} (error {err_a:.3f}), B {shares_b} (error {err_b:.3f}); served {served}")
    assert sum(served["a1"].values()) >= 100 and sum(served["b1"].values()) >= 50, served
    assert err_a <= 0.05 and err_b <= 0.05, (shares_a, shares_b)
    # Nothing above either account's slots: pick_attempts moved every claim to RUNNING, and
    # completions released them oldest first.
    slots = {r["resource_key"]: r["used"] for r in conn.execute(
        "select resource_key, sum(used_units)::int as used from resource_pool_shard where resource_key = any(%s) group by 1",
        ([ACC_A, ACC_B],)).fetchall()}
    assert slots[ACC_A] <= 4 and slots[ACC_B] <= 2, slots


def test_a_visit_reads_what_it_needs_on_its_own_connection(make_platform, conn):
    # A visit's transaction holds shard locks from its first claims while it routes the next task:
    # a stale provider-stats (or budgets) cache read through the pool then waited for a connection
    # that releases, blocked on those locks, were holding: every caller hung until the pool's 30 s
    # timeout (seen in the demo). With every other pool connection taken, the visit still claims.
    from tests.admission_support import clear_cache

    p = _platform(make_platform, 5, 5)
    t = _tenant(p, 4)
    submit(p, t.tenant_id, t.user_id, _body("m-a"), n=2)
    submit(p, t.tenant_id, t.user_id, _body("m-b"), n=2)
    with p.db.connection() as c:
        view = LaneView(p, c, PAID)
    clear_cache(p)
    held = [p.db.pool.getconn(timeout=5) for _ in range(p.db.pool.max_size - 1)]
    try:
        r = Scheduler(p).visit(PAID, t.tenant_id, view, conservative=False)
    finally:
        for c in held:
            p.db.pool.putconn(c)
    assert len(r.claims) == 4, r
