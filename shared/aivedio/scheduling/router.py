"""The provider router (ch. 18.3.5, ch. 20.9.3): hard filters first (capability matrix, circuit
breaker, free capacity), then a score per candidate (expected cost per success including billable
failures and duplicate risk, latency and reliability), weighted by the tenant's tier."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from decimal import Decimal

from aivedio.caching import cached
from aivedio.config import RESOLUTIONS, PlatformConfig
from aivedio.scheduling.resources import account_key

# Tier weights: (cost, latency, reliability). Free work leans on cost, enterprise on reliability.
TIER_WEIGHTS = {
    "ENTERPRISE_RESERVED": (0.2, 0.3, 0.5),
    "PAID_SHARED": (0.35, 0.4, 0.25),
    "STANDARD": (0.5, 0.25, 0.25),
    "BEST_EFFORT": (0.7, 0.1, 0.2),
    "EXPENSIVE": (0.4, 0.2, 0.4),
    "RECOVERY": (0.1, 0.2, 0.7),
}
BREAKER_MIN_SAMPLES = 20
BREAKER_FAILURE_RATE = 0.5


@dataclass(frozen=True)
class Route:
    provider: str
    account: str
    region: str
    model: str
    score: float
    expected_cost: Decimal
    currency: str


@dataclass(frozen=True)
class ProviderStats:
    success_rate: float
    billable_failure_rate: float
    duplicate_rate: float
    mean_latency_seconds: float
    samples: int

    @property
    def breaker_open(self) -> bool:
        return self.samples >= BREAKER_MIN_SAMPLES and (1 - self.success_rate) >= BREAKER_FAILURE_RATE


DEFAULT_STATS = ProviderStats(0.95, 0.02, 0.0, 60.0, 0)


def provider_stats(platform, conn=None) -> dict[str, ProviderStats]:
    """Recent outcomes per provider, from what PostgreSQL recorded; cached for a moment per process.
    `conn`: read on this connection (the caller's transaction) when the cache is stale, instead of
    taking one from the pool: a claim holding shard locks that waits for the pool, while the pool's
    connections wait for those locks (releases), hangs every caller until the pool's timeout."""

    def load() -> dict[str, ProviderStats]:
        since = platform.clock.now() - platform.clock.delta(platform.config.timers.throughput_window_seconds * 6)
        with (nullcontext(conn) if conn is not None else platform.db.connection()) as c:
            rows = c.execute(
            """select provider,
                      count(*) as n,
                      count(*) filter (where state in ('SUCCEEDED', 'PROVIDER_SUCCEEDED')) as ok,
                      count(*) filter (where state = 'FAILED' and billable_state <> 'NOT_BILLABLE') as billed_failures,
                      coalesce(avg(extract(epoch from (updated_at - submit_started_at)))
                               filter (where state in ('SUCCEEDED', 'PROVIDER_SUCCEEDED')), 60) as latency
                 from task_attempt
                where created_at > %s and state in ('SUCCEEDED', 'PROVIDER_SUCCEEDED', 'FAILED')
                group by provider""",
                (since,),
            ).fetchall()
        out = {}
        for r in rows:
            n = max(1, r["n"])
            out[r["provider"]] = ProviderStats(r["ok"] / n, r["billed_failures"] / n, 0.0, float(r["latency"]), r["n"])
        return out

    return cached(platform, "provider_stats", load)


def open_breakers(platform) -> dict[str, ProviderStats]:
    """The providers whose circuit breaker is open (ch. 18.18): route() offers none of their
    accounts, so they get no new attempts. What they already accepted is not touched: an attempt
    keeps the provider it was submitted to (no claim or lifecycle step re-routes a live attempt)."""
    return {name: st for name, st in provider_stats(platform).items() if st.breaker_open}


def candidates(config: PlatformConfig, model: str, resolution: str, duration_seconds: int) -> list[tuple]:
    """Hard filter by the capability matrix: (provider config, account) pairs able to run the job."""
    out = []
    for p in config.providers:
        if model not in p.models or duration_seconds > p.max_duration_seconds:
            continue
        if RESOLUTIONS.index(resolution) > RESOLUTIONS.index(p.max_resolution):
            continue
        for a in p.accounts:
            out.append((p, a))
    return out


def route(platform, task: dict, tier: str, free_by_key: dict[str, int] | None = None, conn=None) -> list[Route]:
    """Candidate routes for a task, best first. Accounts without free slots or behind an open
    breaker are left out; the claim still re-checks capacity with a conditional increment. `conn`:
    the caller's transaction, for provider_stats."""
    stats = provider_stats(platform, conn)
    w_cost, w_lat, w_rel = TIER_WEIGHTS.get(tier, TIER_WEIGHTS["STANDARD"])
    able = candidates(platform.config, task["model_code"], task["resolution"], task["duration_seconds"])
    # The cost term compares the candidates' expected cost per success with the cheapest list price
    # among them (ch. 20.9.3: not the list price alone, and not without it). Divided by each
    # provider's own price, as it was, the price cancelled out and only the success rate was left,
    # so a provider at a quarter of the price scored the same as a dear one.
    cheapest = min((Decimal(p.cost_per_second) for p, _ in able), default=Decimal(0)) * task["duration_seconds"]
    out = []
    for p, a in able:
        st = stats.get(p.name, DEFAULT_STATS)
        if st.breaker_open:
            continue
        if free_by_key is not None and free_by_key.get(account_key(p.name, a.account_id), 1) <= 0:
            continue
        unit_cost = Decimal(p.cost_per_second) * task["duration_seconds"]
        success = max(st.success_rate, 0.05)
        # ch. 20.9.3: billable failures and duplicates are paid for, and spread over the successes.
        expected = unit_cost * Decimal(str((1 + st.billable_failure_rate + st.duplicate_rate) / success))
        score = (w_cost * float(expected) / max(float(cheapest), 1e-9)
                 + w_lat * st.mean_latency_seconds / 60.0
                 + w_rel * (1 - success) * 10)
        out.append(Route(p.name, a.account_id, a.region, task["model_code"], score, expected.quantize(Decimal("0.00000001")), p.currency))
    out.sort(key=lambda r: (r.score, r.provider, r.account))
    return out
