"""Fair shares where the provider's capacity really binds (issue "Fair shares where capacity really
binds", item 4), end to end through the local platform as `aivedio serve` runs it.

One provider, one account of max_concurrency 6, short jobs (no failures, no misbehaviour), and three
PAID_SHARED tenants made through the admin path at weights 4, 2 and 1, whose admission and running
limits are all opened, so the provider account is the only thing that binds. Each tenant's tasks
(all the same size) are submitted over the HTTP API before the loops start, so all three are
backlogged from the first claim on; then the whole platform runs (API, outbox relay, queue
indexer, scheduler tick, dispatch, attempt workflows, webhooks back to the API) against the
built-in provider simulator.

What is measured comes from the simulator's own record (its `truth`): when each provider job
started, mapped to its tenant through client_request_id (the task id). The window is from the first
start to the start of the last job of the first tenant to run out of work, so every tenant had
queued work throughout it. In that window each tenant's share of the job starts is compared with its
weight share (4/7, 2/7, 1/7):

- fairness error = max over tenants of |share - weight share| (target <= 0.03, the issue's);
- Armada's error, the project's figure (aivedio_tools.simulate.metrics: the shortfall below the fair share
  as a fraction of what was delivered; every tenant here is backlogged, so water-filling gives the
  plain weight shares) is printed beside it; with three tenants it never exceeds the max error;
- the account's concurrency never exceeds max_concurrency (the simulator's peak, and the peak of
  its jobs' intervals), and the provider stays busy while everyone is backlogged: the mean number of
  jobs on the account over the window (printed beside it, not asserted: the longest stretch with
  fewer than max_concurrency - 1, the fraction of the window with at least that many, and how soon
  a freed slot was taken again).

Everything is asserted at once at the end, after the figures are printed.

Run with -s to see the figures."""
from __future__ import annotations

import time
import uuid
from collections import Counter
from datetime import datetime

import httpx
import pytest

from aivedio.admin.tenants import create_tenant
from aivedio.config import PlatformConfig, ProviderAccount, ProviderConfig, SimulatorBehaviour, Timers
from aivedio_tools.local.runtime import LocalRuntime
from tests.scheduler_support import OPEN, UNCAPPED

# With the chaos runs and the attempt invariants (tests/reliability, LOAD_GROUP), never beside them:
# a whole platform on 2 cores beside another one's chaos measured refills of 2 s and idle stretches of 4 s.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("attempt-invariants")]

PROVIDER = "provider-a"
ACCOUNT = "account-01"
MAX_CONCURRENCY = 6
WEIGHTS = {"heavy": 4, "middle": 2, "light": 1}
TASKS_PER_TENANT = 48
TIME_SCALE = 20.0  # platform seconds per real second
LATENCY_SECONDS = (8.0, 10.0)  # platform seconds a job runs: 0.4-0.5 real seconds
BODY = {"model": "video-model-x", "mode": "text_to_video", "duration_seconds": 5, "resolution": "480p"}

FAIRNESS_TARGET = 0.03  # max |share - weight share|, the target
# Mean jobs on the account over the window, as a fraction of max_concurrency: ~0.7 when the test runs
# alone on 2 cores, ~0.55 beside another whole platform.
MEAN_BUSY_MIN = 0.4
# The longest stretch with fewer than max_concurrency - 1 jobs and the freed-slot refill times are
# printed, not asserted: they are wall-clock speed, which CI's load moves (3.6 s and 3.9 s stretches
# in two CI runs whose shares were exact), and speed is the bench's (`aivedio bench`, freed-slot
# latency). The mean above is the floor of work conservation that holds under that load.

SUBMIT_TIMEOUT_SECONDS = 60.0  # real seconds, every bounded wait below
RUN_TIMEOUT_SECONDS = 60.0


def fairness_config() -> PlatformConfig:
    sim = SimulatorBehaviour(queue_seconds_min=0, queue_seconds_max=0, latency_seconds_min=LATENCY_SECONDS[0],
                             latency_seconds_max=LATENCY_SECONDS[1], failure_rate=0.0, accept_then_timeout_rate=0.0,
                             server_error_rate=0.0, burst_429_rate=0.0, webhook_drop_rate=0.0, webhook_duplicate_rate=0.0,
                             webhook_delay_seconds_max=0.0)
    provider = ProviderConfig(name=PROVIDER, accounts=[ProviderAccount(account_id=ACCOUNT, max_concurrency=MAX_CONCURRENCY)],
                              submit_timeout_seconds=5.0, simulator=sim)
    return PlatformConfig(time_scale=TIME_SCALE, providers=[provider], timers=Timers(scheduler_tick_seconds=1.0))


def _ts(iso: str | None) -> float | None:
    return None if iso is None else datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def submit_all(platform) -> dict[str, str]:
    """Create the tenants (admin path) and submit every task over the HTTP API with only the API up
    (no loops yet), interleaved across tenants. Returns task id -> tenant name."""
    run = uuid.uuid4().hex[:6]
    keys = {}
    for name, weight in WEIGHTS.items():
        t = create_tenant(platform, name=f"fair-{name}-{run}", service_class="PAID_SHARED", weight=weight, credits=1_000_000,
                          policy_overrides={**OPEN, **UNCAPPED})
        keys[name] = t.api_key
    tenant_of: dict[str, str] = {}
    rt = LocalRuntime(platform, port=0, loops=[]).start()
    try:
        with httpx.Client(base_url=rt.base_url, timeout=30) as http:
            deadline = time.monotonic() + SUBMIT_TIMEOUT_SECONDS
            for i in range(TASKS_PER_TENANT):
                for name in WEIGHTS:
                    assert time.monotonic() < deadline, f"submitting took over {SUBMIT_TIMEOUT_SECONDS}s"
                    r = http.post("/v1/generations", json={**BODY, "prompt": f"a fox in snow, take {i}"},
                                  headers={"Authorization": f"Bearer {keys[name]}", "Idempotency-Key": f"fair-{run}-{name}-{i}",
                                           "Content-Type": "application/json"})
                    assert r.status_code == 202, r.text
                    doc = r.json()
                    assert doc["decision"] == "ACCEPTED" and doc["queue_class"] == "PAID_SHARED", doc
                    tenant_of[doc["task_id"]] = name
    finally:
        rt.stop()
    return tenant_of


def first_starts(truth: dict, tenant_of: dict[str, str]) -> list[tuple[float, str, str]]:
    """(start time, tenant, task id) of each task's first provider job that started, in start order."""
    first: dict[str, float] = {}
    for j in truth["jobs"]:
        task, start = j["client_request_id"], _ts(j["started_at"])
        if task in tenant_of and start is not None and (task not in first or start < first[task]):
            first[task] = start
    return sorted((s, tenant_of[task], task) for task, s in first.items())


def window_end(starts: list[tuple[float, str, str]]) -> float | None:
    """The start of the last task of the first tenant whose every task has started, or None."""
    n_started = Counter(t for _, t, _ in starts)
    done = [max(s for s, t, _ in starts if t == name) for name in WEIGHTS if n_started[name] == TASKS_PER_TENANT]
    return min(done) if done else None


def occupancy(truth: dict, t0: float, t1: float, now: float) -> dict:
    """How many jobs held the account (queued or running: from creation to finish, as the simulator
    counts them) over [t0, t1]: the time-weighted mean, the fraction of the time with at least
    max_concurrency - 1, the longest stretch with fewer, the most at once (over the whole run), and
    how long a slot a job freed stayed empty (each finish matched to the next unmatched creation)."""
    edges, created, finished = [], [], []
    for j in truth["jobs"]:
        if j["account_id"] != ACCOUNT:
            continue
        a, b = _ts(j["created_at"]), _ts(j["finished_at"]) or now
        edges += [(a, 1), (b, -1)]
        created.append(a)
        if j["finished_at"] is not None:
            finished.append(b)
    edges.sort(key=lambda e: (e[0], e[1]))  # a release at the same instant as a creation goes first
    level = peak = 0
    area = near_full = longest_low = low = 0.0
    prev = None
    for at, d in edges:
        if prev is not None:
            lo, hi = max(prev, t0), min(at, t1)
            if hi > lo:
                area += level * (hi - lo)
                if level >= MAX_CONCURRENCY - 1:
                    near_full += hi - lo
                    low = 0.0
                else:
                    low += hi - lo
                    longest_low = max(longest_low, low)
        level += d
        peak = max(peak, level)
        prev = at
    refills, pending = [], sorted(c for c in created if c >= t0)
    i = 0
    for f in sorted(f for f in finished if t0 <= f < t1):
        while i < len(pending) and pending[i] < f:
            i += 1
        if i < len(pending):
            refills.append(pending[i] - f)
            i += 1
    refills.sort()
    span = max(t1 - t0, 1e-9)
    pick = lambda q: refills[min(len(refills) - 1, int(q * len(refills)))] if refills else 0.0  # noqa: E731
    return {"mean": area / span, "near_full_fraction": near_full / span, "longest_low": longest_low, "peak": peak,
            "refill_p50": pick(0.5), "refill_p90": pick(0.9), "refill_max": refills[-1] if refills else 0.0}


def test_weighted_shares_of_provider_starts_while_the_account_binds(make_platform):
    platform = make_platform(fairness_config())
    tenant_of = submit_all(platform)
    rt = LocalRuntime(platform, port=0)
    try:
        t_started = time.monotonic()
        rt.start()
        sim = platform.extras["provider_simulators"][PROVIDER]
        deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
        end = None
        while time.monotonic() < deadline:
            end = window_end(first_starts(sim.truth, tenant_of))
            if end is not None:
                break
            time.sleep(0.2)
        truth = sim.truth
        t_run = time.monotonic() - t_started
    finally:
        rt.stop()

    starts = first_starts(truth, tenant_of)
    by_tenant = Counter(t for _, t, _ in starts)
    assert end is not None, (f"no tenant had all {TASKS_PER_TENANT} tasks started within {RUN_TIMEOUT_SECONDS}s: "
                             f"started {dict(by_tenant)}, simulator submits {truth['submits']}")
    t0 = starts[0][0]
    window = [(s, t) for s, t, _ in starts if s <= end]
    counts = Counter(t for _, t in window)
    n = len(window)
    total_weight = sum(WEIGHTS.values())
    ideal = {name: w / total_weight for name, w in WEIGHTS.items()}
    share = {name: counts[name] / n for name in WEIGHTS}
    error = max(abs(share[name] - ideal[name]) for name in WEIGHTS)
    armada = sum(max(0.0, ideal[name] - share[name]) for name in WEIGHTS)
    occ = occupancy(truth, t0, end, time.time())
    acct = truth["accounts"][ACCOUNT]
    jobs_per_task = Counter(j["client_request_id"] for j in truth["jobs"])

    print(f"\nprovider-bound fairness: {n} starts in the window ({end - t0:.2f}s real, run {t_run:.1f}s), "
          f"{len(starts)} started in all, {len(truth['jobs'])} provider jobs")
    for name in WEIGHTS:
        print(f"  {name:<7} weight {WEIGHTS[name]}  starts {counts[name]:>3}  share {share[name]:.3f}  ideal {ideal[name]:.3f}"
              f"  diff {share[name] - ideal[name]:+.3f}")
    print("  first starts: " + "".join(t[0].upper() for _, t, _ in starts[:70]))
    print(f"  fairness error max|share-ideal| = {error:.3f} (target <= {FAIRNESS_TARGET}); Armada shortfall = {armada:.3f}")
    print(f"  account: peak {acct['peak']} of {MAX_CONCURRENCY}; over the window mean {occ['mean']:.2f} jobs "
          f"({occ['mean'] / MAX_CONCURRENCY:.0%}), >= {MAX_CONCURRENCY - 1} for {occ['near_full_fraction']:.0%} of it, "
          f"longest stretch below {MAX_CONCURRENCY - 1} {occ['longest_low']:.2f}s; freed slot refilled in "
          f"p50 {occ['refill_p50']:.3f}s p90 {occ['refill_p90']:.3f}s max {occ['refill_max']:.3f}s; "
          f"429s {truth['submits']['rate_limited']}, tasks with more than one job "
          f"{sum(1 for v in jobs_per_task.values() if v > 1)}")

    problems = []
    if acct["peak"] > MAX_CONCURRENCY or occ["peak"] > MAX_CONCURRENCY:
        problems.append(f"the account ran {max(acct['peak'], occ['peak'])} jobs at once, over {MAX_CONCURRENCY}")
    if occ["mean"] < MEAN_BUSY_MIN * MAX_CONCURRENCY:
        problems.append(f"the provider idled while all were backlogged: mean {occ['mean']:.2f} jobs of {MAX_CONCURRENCY}")
    if error > FAIRNESS_TARGET:
        problems.append(f"fairness error {error:.3f} > {FAIRNESS_TARGET}: shares "
                        + ", ".join(f"{k} {share[k]:.3f} (ideal {ideal[k]:.3f})" for k in WEIGHTS))
    assert not problems, "; ".join(problems)
