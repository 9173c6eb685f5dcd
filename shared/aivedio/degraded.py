"""Degraded modes (ch. 18.18, ch. 20.12): what the platform does while a dependency fails. Each mode
is listed in /healthz (`degraded`: the mode, why, since when) and is the DegradedMode gauge
(dimension `mode`: 1 while active, 0 once it ends).

| mode              | found by                                   | meanwhile                                              |
|-------------------|--------------------------------------------|--------------------------------------------------------|
| database          | the health probe; any API request          | fail closed: every request answers 503                 |
|                   |                                            | REJECT_DATABASE_UNAVAILABLE, nothing is admitted, and  |
|                   |                                            | nothing is claimed (a claim is a PostgreSQL write)     |
| redis             | the health probe, the scheduler tick, the  | conservative scheduling from PostgreSQL (the           |
|                   | rate limits                                | conservative batch, BEST_EFFORT and EXPENSIVE paused), |
|                   |                                            | rate limits in PostgreSQL; when Redis answers again    |
|                   |                                            | the tick (and the redis-index service) rebuild each    |
|                   |                                            | lane's ring from PostgreSQL                            |
| outbox_backlog    | admission (cached a second), the probe     | the oldest PENDING event is older than                 |
|                   |                                            | Limits.outbox_backlog_max_age_seconds, or more than    |
|                   |                                            | outbox_backlog_reject_threshold are pending: admission |
|                   |                                            | answers REJECT_PLATFORM_OVERLOADED until it drains     |
| provider_breaker  | the router's outcome statistics            | the provider gets no new attempts; attempts it already |
|                   |                                            | accepted stay with it (never migrated)                 |
| pricing           | admission's read of the price book         | the last price version this process read, within       |
|                   |                                            | BillingConfig.price_snapshot_max_age_seconds and under |
|                   |                                            | price_snapshot_max_task_amount, else                   |
|                   |                                            | REJECT_PRICING_UNAVAILABLE (aivedio.pricing.price_book)|
| capacity_counters | the capacity-counters service              | a shard counter disagrees with its ACTIVE reservations:|
|                   |                                            | conservative scheduling until the repair commits       |

Most modes are seen by each process for itself (a probe, or the code that met the fault); their
`since` is when this process first saw them, or, for the outbox, when the oldest event crossed the
threshold. capacity_counters is found by one service and must hold every scheduler back, so it is
a row of degraded_mode (migration 0140) until the repair that ends it commits.

This module is the registry of modes; aivedio.health holds the probes that find them."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from aivedio.caching import cached
from aivedio.metrics_catalog import DEGRADED_MODE
from aivedio.observability import logger, publish

DATABASE, REDIS, OUTBOX_BACKLOG, PROVIDER_BREAKER, PRICING, CAPACITY_COUNTERS = (
    "database", "redis", "outbox_backlog", "provider_breaker", "pricing", "capacity_counters")
MODES = (DATABASE, REDIS, OUTBOX_BACKLOG, PROVIDER_BREAKER, PRICING, CAPACITY_COUNTERS)
# What a process can decide for itself at any time (the gauges each run of the redis-index service
# publishes): pricing is known only to the process whose price read failed.
PROBED = (DATABASE, REDIS, OUTBOX_BACKLOG, PROVIDER_BREAKER, CAPACITY_COUNTERS)

# Stored modes (degraded_mode, migration 0140).
ENTER_STORED = """insert into degraded_mode (mode, reason, detail) values (%(mode)s, %(reason)s, %(detail)s)
                  on conflict (mode) do update set reason = excluded.reason, detail = excluded.detail, updated_at = now()
                  returning since"""
LEAVE_STORED = "delete from degraded_mode where mode = %s returning since"
STORED = "select mode, reason, detail, since from degraded_mode order by mode"
STORED_ONE = "select 1 from degraded_mode where mode = %s"


@dataclass(frozen=True)
class Mode:
    mode: str
    reason: str
    since: datetime
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "reason": self.reason, "since": self.since.isoformat(), "detail": self.detail}


_lock = threading.Lock()


def _registry(platform) -> dict[str, Mode]:
    return platform.extras.setdefault("degraded", {})


def enter(platform, mode: str, reason: str, *, since: datetime | None = None, **detail: Any) -> Mode:
    """Mode `mode` is active in this process. `since` when the facts say when it began (else: the
    first time this process saw it). The gauge goes to 1 and a warning is logged on the way in."""
    assert mode in MODES, mode
    with _lock:
        reg = _registry(platform)
        old = reg.get(mode)
        m = Mode(mode, reason, since or (old.since if old else platform.clock.now()), detail)
        reg[mode] = m
    if old is None:
        publish(DEGRADED_MODE, 1, mode=mode)
        logger.warning("degraded mode entered", extra={"mode": mode, "reason": reason, **_loggable(detail)})
    return m


def leave(platform, mode: str) -> bool:
    """Mode `mode` ended; True when it was active. The gauge goes to 0."""
    with _lock:
        old = _registry(platform).pop(mode, None)
    if old is None:
        return False
    publish(DEGRADED_MODE, 0, mode=mode)
    lasted = (platform.clock.now() - old.since).total_seconds() * platform.clock.time_scale
    logger.info("degraded mode ended", extra={"mode": mode, "lasted_seconds": round(lasted, 1)})
    return True


def active(platform, mode: str) -> bool:
    return mode in _registry(platform)


def active_modes(platform) -> list[Mode]:
    """The modes active in this process, in the order of MODES."""
    with _lock:
        return sorted(_registry(platform).values(), key=lambda m: MODES.index(m.mode))


def _loggable(detail: dict) -> dict:
    return {k: v for k, v in detail.items() if isinstance(v, (str, int, float, bool))}


# --- stored modes ---------------------------------------------------------------------------------

def enter_stored(conn, mode: str, reason: str, **detail: Any) -> datetime:
    """Record a mode every process must see (commit it before the work that may end it)."""
    return conn.execute(ENTER_STORED, {"mode": mode, "reason": reason, "detail": json.dumps(detail, default=str)}).fetchone()["since"]


def leave_stored(conn, mode: str) -> bool:
    return conn.execute(LEAVE_STORED, (mode,)).fetchone() is not None


def capacity_suspect(platform) -> bool:
    """Whether a capacity counter is known to be wrong (the scheduler ticks conservatively);
    cached a second per process, like the other figures admission and the tick read."""
    def load() -> bool:
        with platform.db.connection() as conn:
            return conn.execute(STORED_ONE, (CAPACITY_COUNTERS,)).fetchone() is not None

    return cached(platform, "capacity_suspect", load)


def database_down(platform) -> None:
    enter(platform, DATABASE, "PostgreSQL unreachable: new work is refused (fail closed) and nothing is scheduled")


def redis_down(platform, error: str) -> None:
    enter(platform, REDIS, "Redis unreachable: conservative scheduling from PostgreSQL (smaller batches, BEST_EFFORT "
                           "and EXPENSIVE paused), rate limits in PostgreSQL; the index is rebuilt when it answers",
          error=error[:200])
