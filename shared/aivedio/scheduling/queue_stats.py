"""What the queues look like: per-lane depth and active weight, the measured lane service rate μ,
and the expected wait they give (ch. 18.11.3), which admission answers with and why-waiting
explains. Lane-wide figures are approximate by nature, so each process caches them for a short
while (aivedio.caching)."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

from aivedio.caching import cached
from aivedio.policy.capacity import effective_config
from aivedio.pricing.estimates import PROVIDER_SECOND_BASE


@dataclass(frozen=True)
class LaneStats:
    queued_units: int
    queued_tasks: int
    active_weight: int
    mu_units_per_second: float  # real seconds
    measured: bool


def lane_stats(platform, lane: str, conn=None) -> LaneStats:
    """`conn`: read on this connection (the caller's transaction) instead of taking one from the
    pool; a caller holding row locks must not wait for the pool, or concurrent callers deadlock."""
    def load() -> LaneStats:
        window = platform.clock.real_seconds(platform.config.timers.throughput_window_seconds)
        now = platform.clock.now()
        with (nullcontext(conn) if conn is not None else platform.db.connection()) as c:
            q = c.execute(
                """select coalesce(sum(fairness_units), 0)::bigint as units, count(*) as tasks
                     from generation_task where state = 'QUEUED' and queue_class = %s""",
                (lane,),
            ).fetchone()
            w = c.execute(
                """select coalesce(sum(p.weight), 0)::bigint as weight from tenant_scheduling_policy p
                    where exists (select 1 from generation_task t
                                   where t.tenant_id = p.tenant_id and t.state = 'QUEUED' and t.queue_class = %s)""",
                (lane,),
            ).fetchone()
            done = c.execute(
                """select coalesce(sum(fairness_units), 0)::bigint as units, count(*) as n from generation_task
                    where queue_class = %s and state = 'SUCCEEDED' and finished_at > %s""",
                (lane, now - platform.clock.delta(platform.config.timers.throughput_window_seconds)),
            ).fetchone()
        capacity = effective_config(platform, conn).lanes[lane].capacity_units
        # Without recent completions, assume the lane's capacity turns over once per unit-time.
        fallback = capacity / float(PROVIDER_SECOND_BASE) * platform.clock.time_scale
        measured = done["n"] >= 5
        mu = done["units"] / window if measured else fallback
        return LaneStats(int(q["units"]), int(q["tasks"]), int(w["weight"]), mu, measured)

    return cached(platform, f"lane:{lane}", load)


def expected_wait_seconds(stats: LaneStats, *, tenant_weight: int, tenant_queued_units: int, tenant_active: bool, units: int) -> float:
    """Real seconds until this task could start: the lesser of the whole lane ahead at μ, and the
    tenant's own queue at its weighted DRR share of μ. Admission computes it under the wallet lock in
    SQL, aivedio_expected_wait (migration 0190): the same arithmetic, which a test compares."""
    mu = stats.mu_units_per_second
    if mu <= 0:
        return float("inf")
    lane_wait = stats.queued_units / mu
    total_weight = stats.active_weight + (0 if tenant_active else tenant_weight)
    share = tenant_weight / total_weight if total_weight > 0 else 1.0
    tenant_wait = (tenant_queued_units + units) / (mu * share) - units / mu
    return max(0.0, min(lane_wait, tenant_wait))


def position_level(wait_seconds: float, max_wait_seconds: float) -> str:
    if wait_seconds < 0.25 * max_wait_seconds:
        return "LOW"
    if wait_seconds < 0.75 * max_wait_seconds:
        return "MEDIUM"
    return "HIGH"
