"""The workloads `aivedio simulate` runs. A scenario is data: a platform config sized so the lanes
saturate, the tenants, and every arrival with its time (platform seconds from the start) and its
request body. Arrivals at time 0 are admitted before the run starts (a backlog already queued); the
rest are admitted through `admit()` at their time. Everything random comes from a seeded RNG, so DRR
and FIFO see the same workload.

Units (admission/estimates.py, checked by the scenario test): a 720p 5 s text_to_video is 1 fairness
unit; 1080p 20 s is 8; 1080p 30 s with audio is 15. All three stay in the tenant's lane (not 4k,
at most 30 s, not video_to_video), whatever the model.

Capacity is what the config says, as in a deployment: every lane's capacity_units and every provider
account's max_concurrency become resource_pool_shard rows (aivedio.bootstrap.apply_config, run by the
runner before the backlog is admitted), the claim reserves the account's and the lane's keys
(scheduling/claim.py demands_for), and a simulated completion releases them (release_attempt). The
provider-bound scenarios give the lane far more units than the accounts have slots, as most
deployments do, so the accounts bind."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Callable

from aivedio.config import LaneConfig, Limits, PlatformConfig, Pools, ProviderAccount, ProviderConfig, SchedulerConfig

PROVIDER = "sim-provider"
ACCOUNT = "sim-01"
MODEL = "video-model-x"

BODY_1U = {"model": MODEL, "mode": "text_to_video", "prompt": "sim", "duration_seconds": 5, "resolution": "720p"}
BODY_8U = {"model": MODEL, "mode": "text_to_video", "prompt": "sim", "duration_seconds": 20, "resolution": "1080p"}
BODY_15U = {"model": MODEL, "mode": "text_to_video", "prompt": "sim", "duration_seconds": 30, "resolution": "1080p",
            "with_audio": True}
UNITS = {"1u": (BODY_1U, 1), "8u": (BODY_8U, 8), "15u": (BODY_15U, 15)}

# Per-tenant limits that never bind: the simulation measures the scheduler, not admission. Submit
# rates are very high because the token buckets refill on Redis TIME (real time), not the sim clock.
OPEN_LIMITS = dict(
    max_queued_tasks=10**7, max_queued_units=10**9, max_running_tasks=10**6, max_running_units=10**8,
    max_cost_per_minute=10**13, max_cost_per_day=10**13, max_wait_seconds=10**8,
    max_user_queued_tasks=10**7, max_user_queued_units=10**9, max_user_running_tasks=10**6,
    max_user_running_units=10**8, user_submit_rate_per_minute=10**9, tenant_submit_rate_per_minute=10**9,
    cancel_rate_per_minute=10**6, allow_best_effort_downgrade=False, expensive_allowed=True,
)


@dataclass(frozen=True)
class TenantSpec:
    name: str
    weight: int = 1
    service_class: str = "PAID_SHARED"
    group: str = "default"


@dataclass(frozen=True)
class Arrival:
    at: float  # platform seconds from the start
    tenant: str
    body: dict
    key: str  # the Idempotency-Key; also seeds the task's runtime jitter, so both policies agree


@dataclass(frozen=True)
class BulkSpec:
    """Tenants and queued tasks written with set-based SQL instead of create_tenant()/admit()."""

    tenants: int
    tasks_per_tenant: int
    weight_of: Callable[[int], int]
    group_of: Callable[[int], str]
    body: dict
    units: int
    spread_seconds: float  # enqueue_at is spread over [-spread, 0): an old, deep backlog


@dataclass
class Scenario:
    name: str
    description: str
    config: PlatformConfig
    tenants: list[TenantSpec]
    arrivals: list[Arrival]
    lanes: list[str]
    horizon_seconds: float
    window_seconds: float
    runtime_per_unit: float = 30.0  # the simulated provider runs a task for units x this (platform s)
    jitter: float = 0.5  # runtime x U(1 - jitter, 1 + jitter), from a hash of the task's key
    stop_when_done: tuple[str, ...] = ()  # stop once every task of these tenant groups has finished
    maintenance_seconds: float = 30.0  # aging + starvation detector + ring rebuild period
    bulk: BulkSpec | None = None
    parameters: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    focus: dict = field(default_factory=dict)  # scenario-specific analysis settings ("kind": whose analysis)
    # The tick handler (functions/scheduler_tick/handler.py) builds a new Scheduler per call, and
    # `aivedio serve` calls it once per tick, so nothing a Scheduler object keeps in memory outlives a
    # tick there. True does the same; False keeps one Scheduler for the whole run (what the simulation
    # did before; an AWS continuous run keeps one for up to two minutes, two runs overlapping).
    fresh_scheduler_per_tick: bool = True
    policies: tuple[str, ...] = ("drr", "fifo")  # what runs unless the caller names the policies
    # key -> the simulated provider's draw in [0, 1) for that task's runtime jitter, where a scenario
    # spreads runtimes evenly; keys not here draw from a hash of the key (engine.runtime_for).
    runtime_draws: dict[str, float] = field(default_factory=dict)

    def units_of(self, body: dict) -> int:
        for b, u in UNITS.values():
            if b == body:
                return u
        raise ValueError(f"unknown body {body}")


def provider(name: str, models: list[str], accounts: dict[str, int]) -> ProviderConfig:
    """A simulated provider offering `models` through accounts {account_id: max_concurrency}."""
    return ProviderConfig(name=name, models=models, max_duration_seconds=60,
                          accounts=[ProviderAccount(account_id=a, max_concurrency=n) for a, n in accounts.items()])


def with_model(body: dict, model: str) -> dict:
    return {**body, "model": model}


def platform_config(lanes: dict[str, LaneConfig], slots: int, pool_shards: int = 1,
                    providers: list[ProviderConfig] | None = None, **scheduler) -> PlatformConfig:
    """One provider account whose max_concurrency is `slots` (or the given providers and their
    accounts); limits that are not the subject of a scenario (model cap, cost, worker pools, outbox
    backlog) are opened wide.

    Lanes a scenario does not name keep their defaults, except that the enterprise lane lends
    nothing unless the scenario says so: the default lends 200 units, which a 40-slot provider
    cannot back, and the scheduler would keep trying to borrow into a full provider.

    pool_shards defaults to 1 here: a counter split over 4 shards of 10 units can never hold a
    task of more than 10 units (a claim takes one shard per key), so at these small capacities
    sharding would measure fragmentation, not fairness (--param pool_shards=4 shows it)."""
    lanes = {"ENTERPRISE_RESERVED": LaneConfig(capacity_units=500, borrowable_units=0), **lanes}
    return PlatformConfig(
        providers=providers or [provider(PROVIDER, [MODEL], {ACCOUNT: slots})],
        lanes=lanes,
        limits=Limits(outbox_backlog_reject_threshold=10**9, platform_cost_per_minute=10**9, model_global_running_cap=10**6,
                      pool_shards=pool_shards),
        pools=Pools(worker_cpu_units=10**6, worker_gpu_units=10**6),
        scheduler=SchedulerConfig(**scheduler),
    )


def _lane(capacity: int, **kw) -> LaneConfig:
    return LaneConfig(capacity_units=capacity, max_queue_units=10**9, **kw)


def _flood(tenant: str, n: int, body: dict, at: float = 0.0) -> list[Arrival]:
    return [Arrival(at, tenant, body, f"{tenant}-{i:06d}") for i in range(n)]


def _poisson(rng: random.Random, tenant: str, n: int, body: dict, start: float, mean_gap: float, tag: str = "") -> list[Arrival]:
    out, t = [], start + rng.uniform(0, mean_gap)
    for i in range(n):
        out.append(Arrival(round(t, 3), tenant, body, f"{tenant}{tag}-{i:06d}"))
        t += rng.expovariate(1.0 / mean_gap)
    return out


# -- the scenarios -----------------------------------------------------------------------------------

def _whale(name: str, *, whale_tasks: int, small_tenants: int, small_tasks: int, mean_gap: float, lane_capacity: int,
           slots: int, window: float, warmup: float, runtime_per_unit: float, horizon: float, seed: int) -> Scenario:
    """One tenant floods its backlog at t=0; small tenants each submit tasks one at a time (a person
    waiting for a preview) at random times while the flood is queued. The run stops when every small
    tenant's task has finished."""
    rng = random.Random(seed)
    tenants = [TenantSpec("whale", 1, group="whale")] + [TenantSpec(f"small-{i:02d}", 1, group="small") for i in range(small_tenants)]
    arrivals = _flood("whale", whale_tasks, BODY_1U)
    # The small tenants start once the whale's first wave (claimed together at t=0) has turned over,
    # so completions come at the steady rate that the DRR ideal is defined by.
    for t in tenants[1:]:
        arrivals += _poisson(rng, t.name, small_tasks, BODY_1U, start=warmup, mean_gap=mean_gap)
    binding = "provider slots" if slots < lane_capacity else "lane units"
    return Scenario(
        name=name,
        description=f"one tenant floods {whale_tasks} tasks at t=0 while {small_tenants} tenants submit {small_tasks} each "
                    f"one at a time from t={warmup:.0f} s (Poisson, mean gap {mean_gap:.0f} s); PAID_SHARED {lane_capacity} units, "
                    f"{slots} provider slots ({binding} bind), 1-unit tasks of {runtime_per_unit:g} s",
        config=platform_config({"PAID_SHARED": _lane(lane_capacity)}, slots),
        tenants=tenants, arrivals=sorted(arrivals, key=lambda a: a.at), lanes=["PAID_SHARED"],
        horizon_seconds=horizon, window_seconds=window, stop_when_done=("small",), runtime_per_unit=runtime_per_unit,
        parameters=dict(whale_tasks=whale_tasks, small_tenants=small_tenants, small_tasks=small_tasks, mean_gap=mean_gap,
                        warmup_seconds=warmup, capacity_units=lane_capacity, provider_slots=slots,
                        runtime_per_unit=runtime_per_unit, seed=seed),
        focus={"kind": "whale-vs-small", "small_group": "small", "lane": "PAID_SHARED"},
        notes=["The run stops when every small tenant's task has finished, under either policy (so FIFO runs until the "
               "whale's backlog ahead of them has drained, the longest part of this scenario's wall time, after admitting "
               "the flood through admit()).",
               "The issue's DRR ideal counts one slot per backlogged tenant per round, i.e. DRR whose quantum is one "
               "task: the default base_quantum of 1 unit while the lane is saturated (a lane with room to spare grants "
               "several rounds' quanta per turn: Scheduler._rounds).",
               "The rate-based ideal ignores that completions arrive at random: with 2-4 tenants backlogged, waiting for "
               "that many slots to free has a long tail whatever the scheduler does. The realised-slot ideal measures "
               "the same thing on the run's actual completions (of the provider account the small tenants' work runs "
               "on); oracle_p99_over_ideal is what a perfect per-slot round robin scores on the rate-based ideal."],
    )


def whale_vs_small(whale_tasks: int = 5000, small_tenants: int = 10, small_tasks: int = 20, mean_gap: float = 60.0,
                   capacity: int = 40, window: float = 300.0, warmup: float = 60.0, seed: int = 4) -> Scenario:
    """The whale and ten small tenants on a lane whose units bind (as many provider slots as units)."""
    return _whale("whale-vs-small", whale_tasks=whale_tasks, small_tenants=small_tenants, small_tasks=small_tasks,
                  mean_gap=mean_gap, lane_capacity=capacity, slots=capacity, window=window, warmup=warmup,
                  runtime_per_unit=30.0, horizon=6 * 3600, seed=seed)


def whale_provider_bound(whale_tasks: int = 600, small_tenants: int = 10, small_tasks: int = 10, mean_gap: float = 30.0,
                         lane_capacity: int = 200, slots: int = 8, runtime_per_unit: float = 10.0, window: float = 150.0,
                         warmup: float = 20.0, seed: int = 4) -> Scenario:
    """The whale and ten small tenants where one small provider account binds (8 slots under a lane
    of 200 units): the small tenants' p99 wait against the time in which as many of that account's
    slots free up as there are backlogged tenants."""
    return _whale("whale-provider-bound", whale_tasks=whale_tasks, small_tenants=small_tenants, small_tasks=small_tasks,
                  mean_gap=mean_gap, lane_capacity=lane_capacity, slots=slots, window=window, warmup=warmup,
                  runtime_per_unit=runtime_per_unit, horizon=6 * 3600, seed=seed)

def _backlog(rate: float, horizon: float, share: float) -> int:
    """Tasks enough for a tenant taking `share` of a pool that completes `rate` tasks a second to
    stay backlogged for the whole horizon (15 % spare, plus a few)."""
    return int(math.ceil(1.15 * rate * horizon * share)) + 20


def _weighted(name: str, *, weights: dict[str, int], lane_capacity: int, slots: int, runtime_per_unit: float, horizon: float,
              window: float, seed: int) -> Scenario:
    """Tenants of the given weights, each with a backlog deep enough to stay backlogged."""
    rate = min(lane_capacity, slots) / runtime_per_unit  # 1-unit tasks, one slot each: the binding rate
    tenants = [TenantSpec(n, w, group=n) for n, w in weights.items()]
    # Equal backlogs, all queued at t=0: enough for the heaviest tenant's share, so every tenant
    # stays backlogged under DRR (and FIFO, which serves them in enqueue order, shares 1:1:1).
    per = _backlog(rate, horizon, max(weights.values()) / sum(weights.values()))
    arrivals = []
    for n in weights:
        arrivals += _flood(n, per, BODY_1U)
    binding = "provider slots" if slots < lane_capacity else "lane units"
    return Scenario(
        name=name,
        description=f"tenants of weight {', '.join(str(w) for w in weights.values())}, each backlogged for the whole run; "
                    f"PAID_SHARED {lane_capacity} units, {slots} provider slots ({binding} bind), 1-unit tasks of "
                    f"{runtime_per_unit:g} s, {horizon:.0f} s",
        config=platform_config({"PAID_SHARED": _lane(lane_capacity)}, slots),
        tenants=tenants, arrivals=arrivals, lanes=["PAID_SHARED"], horizon_seconds=horizon, window_seconds=window,
        runtime_per_unit=runtime_per_unit,
        parameters=dict(horizon_seconds=horizon, capacity_units=lane_capacity, provider_slots=slots, weights=weights, seed=seed,
                        runtime_per_unit=runtime_per_unit, backlog_each=per),
        focus={"lane": "PAID_SHARED"},
    )


def weighted_4_2_1(horizon: float = 900.0, capacity: int = 40, window: float = 300.0, seed: int = 421) -> Scenario:
    """Three tenants of weight 4, 2 and 1; the lane's units bind (as many provider slots as units)."""
    return _weighted("weighted-4-2-1", weights={"w4": 4, "w2": 2, "w1": 1}, lane_capacity=capacity, slots=capacity,
                     runtime_per_unit=30.0, horizon=horizon, window=window, seed=seed)


def provider_bound_4_2_1(horizon: float = 480.0, lane_capacity: int = 200, slots: int = 6, runtime_per_unit: float = 10.0,
                         window: float = 120.0, seed: int = 421) -> Scenario:
    """Three PAID_SHARED tenants of weight 4, 2 and 1, all backlogged, where one provider account's
    max_concurrency (6) binds under a lane of 200 units: the deployment the issue "Fair shares where
    capacity really binds" measured at 0.33/0.34/0.33 through `aivedio serve`."""
    return _weighted("provider-bound-4-2-1", weights={"w4": 4, "w2": 2, "w1": 1}, lane_capacity=lane_capacity, slots=slots,
                     runtime_per_unit=runtime_per_unit, horizon=horizon, window=window, seed=seed)


MODEL_A, MODEL_B = "m-a", "m-b"


def two_accounts(horizon: float = 480.0, lane_capacity: int = 200, slots_a: int = 6, slots_b: int = 3,
                 runtime_per_unit: float = 10.0, window: float = 120.0, both_weight: int = 0, seed: int = 22) -> Scenario:
    """Two provider accounts of different sizes under one lane: account A (6 slots) serves model m-a,
    account B (3 slots) serves m-b. Tenants a-w4 and a-w2 order m-a, b-w2 and b-w1 order m-b, all
    backlogged; with both_weight > 0 a fifth tenant of that weight orders both, alternately. Within
    each account the shares should follow the weights of the tenants backlogged on it, and a tenant
    whose work fits only one account is not charged for the other's scarcity."""
    pools = {MODEL_A: ("sim-a", "acct-a", slots_a, {"a-w4": 4, "a-w2": 2}),
             MODEL_B: ("sim-b", "acct-b", slots_b, {"b-w2": 2, "b-w1": 1})}
    if both_weight:
        for _, _, _, w in pools.values():
            w["ab-both"] = both_weight
    tenants = {}
    per_pool: dict[str, dict[str, int]] = {}
    queues: dict[str, list[list[Arrival]]] = {}
    for model, (_, _, slots, weights) in pools.items():
        rate = min(lane_capacity, slots) / runtime_per_unit
        per = _backlog(rate, horizon, max(weights.values()) / sum(weights.values()))
        per_pool[model] = {n: per for n in weights}
        for n, w in weights.items():
            tenants.setdefault(n, TenantSpec(n, w, group=n))
            queues.setdefault(n, []).append([Arrival(0.0, n, with_model(BODY_1U, model), f"{n}-{model}-{i:06d}") for i in range(per)])
    arrivals = []
    for qs in queues.values():  # a tenant ordering both models submits them alternately
        arrivals += [q[i] for i in range(max(len(q) for q in qs)) for q in qs if i < len(q)]
    return Scenario(
        name="two-accounts",
        description=f"one PAID_SHARED lane of {lane_capacity} units over two provider accounts: acct-a ({slots_a} slots) "
                    f"serves {MODEL_A} for tenants a-w4, a-w2; acct-b ({slots_b} slots) serves {MODEL_B} for b-w2, b-w1"
                    + (f"; ab-both (weight {both_weight}) orders both" if both_weight else "")
                    + f"; all backlogged, 1-unit tasks of {runtime_per_unit:g} s, {horizon:.0f} s",
        config=platform_config({"PAID_SHARED": _lane(lane_capacity)}, 0,
                               providers=[provider(prov, [model], {acct: slots}) for model, (prov, acct, slots, _) in pools.items()]),
        tenants=list(tenants.values()), arrivals=arrivals, lanes=["PAID_SHARED"], horizon_seconds=horizon, window_seconds=window,
        runtime_per_unit=runtime_per_unit,
        parameters=dict(horizon_seconds=horizon, capacity_units=lane_capacity, slots_a=slots_a, slots_b=slots_b,
                        provider_slots=slots_a + slots_b, both_weight=both_weight, runtime_per_unit=runtime_per_unit,
                        backlog=per_pool, seed=seed),
        focus={"lane": "PAID_SHARED", "per_pool": True},
        notes=["Fairness is measured per provider account (`pools`): the water-filling fair share of each account's "
               "delivered units over the tenants with work for it, by weight. The lane-wide figure compares tenants "
               "whose work runs on different accounts, and is reported only for contrast."],
    )


def mixed_cost(horizon: float = 2400.0, capacity: int = 40, seed: int = 8) -> Scenario:
    """One tenant's tasks are 1080p 20 s (8 units, 240 s at the provider); two others submit 720p 5 s
    (1 unit, 30 s). Equal weights: each should get a third of the delivered units."""
    per_tenant_rate = capacity / 30.0 / 10.0  # units/s each when 4+4+4 tasks run (32 + 4 + 4 units)
    # The same number of tasks each, all queued at t=0: every tenant stays backlogged under DRR, and
    # FIFO (oldest first, so in effect by request) gives the 8-unit tenant 8/10 of the units.
    small = int(math.ceil(1.3 * per_tenant_rate * horizon)) + 20
    big = small
    tenants = [TenantSpec("big8x", 1, group="big8x"), TenantSpec("small-a", 1, group="small"), TenantSpec("small-b", 1, group="small")]
    arrivals = _flood("big8x", big, BODY_8U) + _flood("small-a", small, BODY_1U) + _flood("small-b", small, BODY_1U)
    return Scenario(
        name="mixed-cost",
        description=f"one tenant's tasks cost 8 units (1080p 20 s), two tenants' cost 1 (720p 5 s), equal weights, all "
                    f"backlogged; PAID_SHARED {capacity} units, {capacity} provider slots, {horizon:.0f} s",
        config=platform_config({"PAID_SHARED": _lane(capacity)}, capacity),
        tenants=tenants, arrivals=arrivals, lanes=["PAID_SHARED"], horizon_seconds=horizon, window_seconds=600,
        parameters=dict(horizon_seconds=horizon, capacity_units=capacity, provider_slots=capacity, big_backlog=big,
                        small_backlog=small, seed=seed),
        focus={"lane": "PAID_SHARED"},
    )


def enterprise_borrowing(return_at: float = 300.0, horizon: float = 900.0, paid_capacity: int = 40, ent_capacity: int = 40,
                         borrowable: int = 24, headroom: int = 8, burst: int = 150, seed: int = 5) -> Scenario:
    """PAID_SHARED is saturated and borrows the idle ENTERPRISE_RESERVED lane; at `return_at` the
    enterprise tenant's demand returns (a burst, then a steady trickle)."""
    rng = random.Random(seed)
    slots = paid_capacity + ent_capacity
    paid_rate = (paid_capacity + borrowable) / 30.0 * return_at / 30.0 + paid_capacity / 30.0 * (horizon - return_at) / 30.0
    per = int(math.ceil(1.2 * paid_rate * 30.0 / 3)) + 20
    tenants = [TenantSpec(f"paid-{i}", 1, group="paid") for i in range(3)] + [
        TenantSpec("enterprise", 1, service_class="ENTERPRISE_RESERVED", group="enterprise")]
    arrivals = []
    for t in tenants[:3]:
        arrivals += _flood(t.name, per, BODY_1U)
    arrivals += _flood("enterprise", burst, BODY_1U, at=return_at)
    arrivals += _poisson(rng, "enterprise", int((horizon - return_at) / 2.5), BODY_1U, start=return_at + 60, mean_gap=2.5, tag="-trickle")
    return Scenario(
        name="enterprise-borrowing",
        description=f"3 PAID_SHARED tenants saturate {paid_capacity} units and borrow the idle ENTERPRISE_RESERVED lane "
                    f"({ent_capacity} units, borrowable {borrowable}, min headroom {headroom}); at t={return_at:.0f} s the "
                    f"enterprise tenant submits {burst} tasks, then ~0.4/s",
        config=platform_config({"PAID_SHARED": _lane(paid_capacity),
                                "ENTERPRISE_RESERVED": _lane(ent_capacity, borrowable_units=borrowable, min_headroom_units=headroom)},
                               slots),
        tenants=tenants, arrivals=sorted(arrivals, key=lambda a: a.at), lanes=["ENTERPRISE_RESERVED", "PAID_SHARED"],
        horizon_seconds=horizon, window_seconds=200,
        parameters=dict(return_at=return_at, horizon_seconds=horizon, paid_capacity=paid_capacity, ent_capacity=ent_capacity,
                        borrowable_units=borrowable, min_headroom_units=headroom, burst=burst, provider_slots=slots,
                        paid_backlog_each=per, seed=seed),
        focus={"return_at": return_at, "lane": "PAID_SHARED"},
    )


def big_task_starvation(horizon: float = 1200.0, capacity: int = 40, others: int = 4, seed: int = 15) -> Scenario:
    """Four tenants keep PAID_SHARED full of 1-unit tasks; one tenant's head task needs 15 units
    (1080p 30 s with audio), with 1-unit tasks of its own queued behind it. Twice."""
    rate = capacity / 30.0
    per = int(math.ceil(1.2 * rate * horizon / (others + 1))) + 20
    tenants = [TenantSpec(f"other-{i}", 1, group="others") for i in range(others)] + [TenantSpec("bighead", 1, group="bighead")]
    arrivals = []
    for t in tenants[:others]:
        arrivals += _flood(t.name, per, BODY_1U)
    for k, at in enumerate((60.0, 600.0)):
        arrivals.append(Arrival(at, "bighead", BODY_15U, f"bighead-big-{k}"))
        arrivals += [Arrival(at + 0.001 * (i + 1), "bighead", BODY_1U, f"bighead-small-{k}-{i:03d}") for i in range(10)]
    return Scenario(
        name="big-task-starvation",
        description=f"{others} tenants keep PAID_SHARED ({capacity} units) full of 1-unit tasks; tenant 'bighead' submits a "
                    f"15-unit task (1080p 30 s + audio) followed by ten 1-unit tasks, at t=60 s and t=600 s",
        config=platform_config({"PAID_SHARED": _lane(capacity)}, capacity),
        tenants=tenants, arrivals=sorted(arrivals, key=lambda a: a.at), lanes=["PAID_SHARED"], horizon_seconds=horizon,
        window_seconds=300,
        parameters=dict(horizon_seconds=horizon, capacity_units=capacity, provider_slots=capacity, others=others,
                        others_backlog_each=per, big_task_units=15, seed=seed),
        focus={"lane": "PAID_SHARED", "big_keys": ["bighead-big-0", "bighead-big-1"],
               "small_prefix": {"bighead-big-0": "bighead-small-0-", "bighead-big-1": "bighead-small-1-"}},
    )


def many_tenants(tenants: int = 10_000, capacity: int = 400, heavy_tasks: int = 100, horizon: float = 120.0,
                 seed: int = 10) -> Scenario:
    """10,000 active tenants, each with one queued 1-unit task enqueued over the last ten minutes
    (written by bulk SQL), plus three tenants of weight 4, 2 and 1 with deeper backlogs admitted
    through admit(). The ring holds 10,003 tenants from the first pick."""
    weights = [4, 2, 1]
    arrivals, specs = [], []
    for w in weights:
        name = f"heavy-w{w}"
        specs.append(TenantSpec(name, w, group="heavy"))
        arrivals += _flood(name, heavy_tasks, BODY_1U)
    return Scenario(
        name="many-tenants",
        description=f"{tenants} active tenants (bulk SQL: one queued 1-unit task each, enqueued over the last 10 minutes) "
                    f"plus 3 tenants of weight 4/2/1 with {heavy_tasks} tasks each through admit(); PAID_SHARED {capacity} "
                    f"units, {capacity} provider slots, {horizon:.0f} s",
        config=platform_config({"PAID_SHARED": _lane(capacity)}, capacity),
        tenants=specs, arrivals=arrivals, lanes=["PAID_SHARED"], horizon_seconds=horizon, window_seconds=horizon,
        bulk=BulkSpec(tenants=tenants, tasks_per_tenant=1, weight_of=lambda i: 1, group_of=lambda i: "bulk",
                      body=BODY_1U, units=1, spread_seconds=600.0),
        parameters=dict(bulk_tenants=tenants, capacity_units=capacity, provider_slots=capacity, heavy_weights=weights,
                        heavy_tasks=heavy_tasks, horizon_seconds=horizon, seed=seed),
        focus={"lane": "PAID_SHARED", "bulk_group": "bulk"},
        notes=["The 10,000 tenants, their policies and users, and their queued tasks are written with set-based SQL "
               "(copies of a task admit() wrote), because 10,000 create_tenant() and admit() calls take longer than "
               "the scenario's time budget; those tasks have no wallet reservation, which the scheduler never reads. "
               "The three weighted tenants go through admit().",
               "The run covers the start of the first DRR round over 10,003 tenants (one round is ~10,000 claims, "
               "~12 minutes of simulated time at this capacity, more than the time budget allows). Over a part of a "
               "round, window fairness against 10,003 weights is not meaningful (most tenants have not had their turn "
               "yet); what is measured is the pick cost with 10,003 tenants on the ring, that no tenant is served more "
               "than one quantum per round, work conservation, and waits."],
    )


def littles_law(steady_rate: float, peak_rate: float, peak_seconds: float, mean_runtime: float, safe_slots: float) -> dict:
    """Ch. 18.17's capacity arithmetic, the one place it is computed (the peak-backlog scenario's
    prediction, its report and its check all read it). Rates are tasks/s, times seconds.

    18.17.1: in flight at steady state L = lambda x W (8 x 150 = 1,200). 18.17.2: the safe throughput
    mu_safe = safe_slots / W (1,500 / 150 = 10/s), so 8/s leaves 2/s of headroom. 18.17.3: a peak
    above mu_safe queues (peak - mu_safe) x duration ((12 - 10) x 300 = 600 tasks), which the headroom
    clears in backlog / (mu_safe - steady) (600 / 2 = 300 s). Where the steady rate is not below
    mu_safe the backlog never drains by itself (drain_seconds None): scale out or reject."""
    mu_safe = safe_slots / mean_runtime
    backlog = max(0.0, peak_rate - mu_safe) * peak_seconds
    surplus = mu_safe - steady_rate
    drain = 0.0 if backlog == 0 else backlog / surplus if surplus > 0 else None
    r = lambda x: None if x is None else round(x, 6)  # noqa: E731  (0.8 / 1.2 at scale 10 leave float dust)
    return {"steady_in_flight": r(steady_rate * mean_runtime), "safe_throughput_per_second": r(mu_safe),
            "recovery_headroom_per_second": r(surplus), "backlog_tasks": r(backlog), "drain_seconds": r(drain),
            "steady_slot_utilisation": r(min(1.0, steady_rate / mu_safe)), "peak_slot_utilisation": r(min(1.0, peak_rate / mu_safe))}


GOLDEN = (math.sqrt(5) - 1) / 2  # i x GOLDEN mod 1: the most even spread of draws over [0, 1) in order of i


def _steady(start: float, end: float, rate: float, tenants: list[str], first: int) -> list[Arrival]:
    """Arrivals evenly spaced at `rate` over [start, end), the tenants taking turns; numbered from `first`."""
    out, i = [], 0
    while (t := start + (i + 0.5) / rate) < end:
        n = first + i
        name = tenants[n % len(tenants)]
        out.append(Arrival(round(t, 3), name, BODY_1U, f"{name}-{n:06d}"))
        i += 1
    return out


def peak_backlog(steady_rate: float = 8.0, peak_rate: float = 12.0, peak_seconds: float = 300.0, mean_runtime: float = 150.0,
                 safe_slots: int = 1500, scale: int = 5, warmup_seconds: float | None = None,
                 after_seconds: float | None = None, tenants: int = 4, sample_seconds: float = 5.0, tolerance: float = 0.25,
                 jitter: float = 0.5) -> Scenario:
    """Ch. 18.17's capacity example replayed (issue 19 item 5). At full size: 8 tasks/s steady, a
    12 tasks/s peak for 5 minutes, 150 s mean generation time, 1,500 safe provider slots (18.17.2:
    2,000 raw slots at a 75 % target utilisation). Little's law (18.17.1) puts 8 x 150 = 1,200 tasks
    in flight at steady state; the safe throughput is 1,500 / 150 = 10 tasks/s (18.17.2); during the
    peak (12 - 10) x 300 = 600 tasks queue up, and afterwards, back at 8/s, the 10 - 8 = 2 tasks/s of
    headroom drain them in 600 / 2 = 300 s, about 5 minutes (18.17.3). `littles_law` computes these
    from the parameters; the report sets the measured backlog and drain beside them, and its check
    wants both within `tolerance` (25 %).

    Compressed scale: every count is divided by `scale` (default 5: 1.6 tasks/s steady, 2.4/s peak,
    300 slots, so a predicted backlog of 120), every time is kept (150 s runtimes, a 300 s peak, a
    300 s drain), so the ratios, the predicted drain time and the utilisations are the book's and the
    backlog is the book's / scale. The clock costs nothing (the engine's SimClock jumps from event to
    event): wall time goes with the number of tasks, about 1,900 at scale 5 (under a minute on two
    cores; scale 10 halves it, at the price of a noisier 60-task backlog). The tasks are 1-unit 720p
    5 s requests through the real admit(), claimed by the real scheduler on one provider account
    whose max_concurrency is the safe slots, under a lane of 4x as many units (the provider binds, as
    in 18.17.2), and run by the simulated provider for mean_runtime x U(1 - jitter, 1 + jitter).

    Arrivals are evenly spaced (a steady rate, not Poisson: the book's arithmetic is of rates, and at
    a backlog of 120 Poisson noise alone would be ~20 % of it), shared in turn by `tenants` tenants of
    equal weight; the runtime draws are spread evenly too, in order of arrival (GOLDEN), for the same
    reason. Phases: `warmup_seconds` at the steady rate (default 2 W, so in-flight work reaches
    L = lambda x W first), the peak, then the steady rate for `after_seconds` (default 1.5x the
    predicted drain, so a drain well past the tolerance is still seen). The run stops there."""
    if safe_slots % scale:
        raise ValueError(f"safe_slots {safe_slots} is not a multiple of scale {scale}")
    full = littles_law(steady_rate, peak_rate, peak_seconds, mean_runtime, safe_slots)
    slots = safe_slots // scale
    lam, peak = steady_rate / scale, peak_rate / scale
    pred = littles_law(lam, peak, peak_seconds, mean_runtime, slots)
    warmup = 2 * mean_runtime if warmup_seconds is None else float(warmup_seconds)
    if after_seconds is None:
        after = 1.5 * pred["drain_seconds"] if pred["drain_seconds"] else 2 * mean_runtime
    else:
        after = float(after_seconds)
    peak_start, peak_end = warmup, warmup + peak_seconds
    horizon = peak_end + after
    names = [f"t{i:02d}" for i in range(tenants)]
    arrivals = _steady(0.0, peak_start, lam, names, 0)
    arrivals += _steady(peak_start, peak_end, peak, names, len(arrivals))
    arrivals += _steady(peak_end, horizon, lam, names, len(arrivals))
    lane_capacity = 4 * slots
    drains = (f"drained in {pred['drain_seconds']:g} s" if pred["drain_seconds"] is not None
              else "that never drains (the steady rate is not below the safe throughput)")
    return Scenario(
        name="peak-backlog",
        description=f"ch. 18.17 at 1/{scale} of its counts: {lam:g} tasks/s steady, {peak:g}/s for {peak_seconds:.0f} s from "
                    f"t={peak_start:.0f} s, {mean_runtime:g} s mean generation, {slots} safe provider slots (full size "
                    f"{steady_rate:g}/s, {peak_rate:g}/s, {safe_slots} slots); Little's law predicts a backlog of "
                    f"{pred['backlog_tasks']:g} tasks ({full['backlog_tasks']:g} at full size) {drains}",
        config=platform_config({"PAID_SHARED": _lane(lane_capacity)}, slots),
        tenants=[TenantSpec(n, 1, group="load") for n in names], arrivals=arrivals, lanes=["PAID_SHARED"],
        horizon_seconds=horizon, window_seconds=peak_seconds, runtime_per_unit=mean_runtime, jitter=jitter,
        runtime_draws={a.key: (i * GOLDEN) % 1.0 for i, a in enumerate(arrivals)},
        parameters=dict(steady_rate=steady_rate, peak_rate=peak_rate, peak_seconds=peak_seconds, mean_runtime=mean_runtime,
                        safe_slots=safe_slots, scale=scale, provider_slots=slots, capacity_units=lane_capacity,
                        warmup_seconds=warmup, after_seconds=after, tenants=tenants, sample_seconds=sample_seconds,
                        tolerance=tolerance, jitter=jitter, arrivals=len(arrivals)),
        focus={"kind": "peak-backlog", "lane": "PAID_SHARED", "peak_start": peak_start, "peak_end": peak_end,
               "steady_from": min(peak_start, mean_runtime * (1 + jitter)), "sample_seconds": sample_seconds,
               "tolerance": tolerance, "scale": scale, "prediction": pred, "prediction_full_scale": full},
        policies=("drr",),
        notes=[f"Compressed by dividing every count by {scale} and keeping every time: backlogs and in-flight counts are "
               f"the book's / {scale}, drain times are the book's. The `x_scale` figures multiply back.",
               "Only DRR runs by default (the real scheduler): with equal tenants FIFO would schedule the same work, and "
               "the scenario is about capacity, not shares (--policy both runs FIFO too).",
               "The steady level the backlog drains back to is the most that was queued in the steady phase before the "
               "peak (after the warm-up transient); drained is the first moment after the peak ends at or below it.",
               "Why the measured figures come in under the book's (by ~15 %): its arithmetic is a fluid model with the "
               "slots full and 10 tasks/s out from the first second of the peak. In fact the peak starts with L = 1,200 "
               "of the 1,500 slots busy, so the first ~75 s of surplus fill the free slots instead of queueing, and that "
               "burst of starts finishes about one runtime later, so the drain sees more than 10 completions a second "
               "for a while. A queue model of this workload without the platform (same arrivals, FIFO, the same "
               "runtimes) gives ~515 tasks and ~255 s at full size: the rest of the gap is the workload, not the "
               "scheduler, whose share shows as slot utilisation while backlogged (1.0 is the book's assumption)."],
    )


SCENARIOS: dict[str, Callable[..., Scenario]] = {
    "whale-vs-small": whale_vs_small,
    "weighted-4-2-1": weighted_4_2_1,
    "provider-bound-4-2-1": provider_bound_4_2_1,
    "two-accounts": two_accounts,
    "whale-provider-bound": whale_provider_bound,
    "mixed-cost": mixed_cost,
    "enterprise-borrowing": enterprise_borrowing,
    "big-task-starvation": big_task_starvation,
    "many-tenants": many_tenants,
    "peak-backlog": peak_backlog,
}


def _flag(v) -> bool:
    if isinstance(v, str):
        if v.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"fresh_scheduler_per_tick: expected true or false, got {v!r}")
        return v.lower() in ("true", "1", "yes")
    return bool(v)


def _spread_backlog(arrivals: list[Arrival]) -> list[Arrival]:
    """The backlogs queued at t=0 become requests submitted 1 ms apart just before t=0, the tenants
    taking turns (as concurrent clients would), so every enqueue_at is distinct and FIFO's order,
    like each tenant's own order, is exactly the order of submission."""
    backlog = [a for a in arrivals if a.at == 0]
    if not backlog:
        return arrivals
    per: dict[str, list[Arrival]] = {}
    for a in backlog:
        per.setdefault(a.tenant, []).append(a)
    queues = list(per.values())
    order: list[Arrival] = []
    for i in range(max(len(q) for q in queues)):
        order += [q[i] for q in queues if i < len(q)]
    n = len(order)
    return [replace(a, at=round(-(n - j) * 0.001, 3)) for j, a in enumerate(order)] + [a for a in arrivals if a.at != 0]


def build(name: str, **params) -> Scenario:
    """The scenario `name` with its own parameters, plus three that every scenario takes:
    pool_shards (counter shards per pool), scheduler (a dict of SchedulerConfig overrides) and
    fresh_scheduler_per_tick (default true: a new Scheduler per tick, as the tick handler builds one per call)."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; scenarios are {', '.join(SCENARIOS)}")
    shards = params.pop("pool_shards", None)
    sched = params.pop("scheduler", None) or {}
    fresh = params.pop("fresh_scheduler_per_tick", None)
    sc = SCENARIOS[name](**params)
    if fresh is not None:
        sc.fresh_scheduler_per_tick = _flag(fresh)
    sc.parameters["fresh_scheduler_per_tick"] = sc.fresh_scheduler_per_tick
    sc.arrivals = _spread_backlog(sc.arrivals)
    cfg = sc.config
    if shards is not None:
        cfg = cfg.model_copy(update={"limits": cfg.limits.model_copy(update={"pool_shards": int(shards)})})
        sc.parameters["pool_shards"] = int(shards)
    if sched:
        cfg = cfg.model_copy(update={"scheduler": SchedulerConfig(**{**cfg.scheduler.model_dump(), **sched})})
        sc.parameters["scheduler"] = sched
    sc.config = cfg
    return sc
