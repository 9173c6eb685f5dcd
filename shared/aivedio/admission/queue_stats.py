"""What admission needs to know about queues: per-lane depth and active weight (for the expected
wait of ch. 18.11.3), the measured lane service rate μ, and the outbox backlog. Lane-wide figures
are approximate by nature, so each process caches them for a short while."""
from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime

from aivedio.admission.estimates import PROVIDER_SECOND_BASE

CACHE_SECONDS = 1.0


@dataclass(frozen=True)
class LaneStats:
    queued_units: int
    queued_tasks: int
    active_weight: int
    mu_units_per_second: float  # real seconds
    measured: bool


class _TTLCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, tuple[float, object]] = {}

    def get(self, key: str, load):
        now = time.monotonic()
        with self._lock:
            hit = self._data.get(key)
            if hit and now - hit[0] < CACHE_SECONDS:
                return hit[1]
        value = load()
        with self._lock:
            self._data[key] = (now, value)
        return value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()


def _cache(platform) -> _TTLCache:
    return platform.extras.setdefault("admission_cache", _TTLCache())


def cached(platform, key: str, load):
    """A per-process value reloaded at most every CACHE_SECONDS."""
    return _cache(platform).get(key, load)


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
        from aivedio.admin.capacity import effective_config  # it imports this package

        capacity = effective_config(platform, conn).lanes[lane].capacity_units
        # Without recent completions, assume the lane's capacity turns over once per unit-time.
        fallback = capacity / float(PROVIDER_SECOND_BASE) * platform.clock.time_scale
        measured = done["n"] >= 5
        mu = done["units"] / window if measured else fallback
        return LaneStats(int(q["units"]), int(q["tasks"]), int(w["weight"]), mu, measured)

    return _cache(platform).get(f"lane:{lane}", load)


# The backlog and the age of its oldest event in one statement (both from the partial index of
# migration 0140). Ages are measured on the database's clock, which wrote created_at.
OUTBOX_STATE = """select count(*) as n, min(created_at) as oldest,
                         coalesce(extract(epoch from now() - min(created_at)), 0)::float8 as age
                    from outbox_event where status = 'PENDING'"""


@dataclass(frozen=True)
class OutboxState:
    pending: int
    oldest_age_seconds: float  # platform seconds (0 without a backlog)
    oldest_created_at: datetime | None


def outbox_state(platform) -> OutboxState:
    def load() -> OutboxState:
        row = platform.db.fetchone(OUTBOX_STATE)
        return OutboxState(int(row["n"]), max(0.0, float(row["age"])) * platform.clock.time_scale, row["oldest"])

    return _cache(platform).get("outbox_state", load)


def outbox_backlog(platform) -> int:
    return outbox_state(platform).pending


def outbox_overload(platform, state: OutboxState | None = None) -> str | None:
    """Why new work must wait for the outbox (the bus is down or the relay stalled: ch. 18.18,
    20.12.3), or None. Events keep being written meanwhile; only admission stops."""
    st = state or outbox_state(platform)
    limits = platform.config.limits
    if st.pending > limits.outbox_backlog_reject_threshold:
        return f"{st.pending} outbox events wait to be published (threshold {limits.outbox_backlog_reject_threshold})"
    if st.oldest_age_seconds > limits.outbox_backlog_max_age_seconds:
        return (f"the oldest unpublished outbox event is {st.oldest_age_seconds:.0f}s old "
                f"(threshold {limits.outbox_backlog_max_age_seconds:.0f}s)")
    return None


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
