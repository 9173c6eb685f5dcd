"""An adaptive concurrency limit per provider account (AIMD): a 429 cuts the account's limit to a
share of what it was, each accepted submit gives a little back until the configured capacity is
reached and the limit is lifted. The limit lives on the account's resource_pool_shard rows, so the
scheduler's conditional increments obey it: 429s throttle the claims, not just the submits.

Each change runs in its own short transaction, never inside a task's transaction, so it cannot
join a task lock and a shard lock in the opposite order of a claim."""
from __future__ import annotations

from aivedio.metrics_catalog import PROVIDER_LIMIT_DECREASED
from aivedio.observability import logger, publish
from aivedio.scheduling.resources import account_key, set_limit

_STATE = """select coalesce(sum(capacity_units), 0)::bigint as capacity,
                   coalesce(sum(coalesce(limit_units, capacity_units)), 0)::bigint as effective,
                   bool_or(limit_units is not null) as limited, max(updated_at) as changed_at
              from resource_pool_shard where resource_key = %s"""


def decrease(platform, provider: str, account: str) -> int | None:
    """Multiplicative decrease after a 429. Returns the new limit."""
    limits = platform.config.limits
    key = account_key(provider, account)

    now = platform.clock.now()
    cooldown = platform.clock.delta(limits.aimd_cooldown_seconds)

    def tx(conn) -> int | None:
        row = conn.execute(_STATE, (key,)).fetchone()
        if not row["capacity"]:
            return None
        if row["limited"] and row["changed_at"] is not None and now - row["changed_at"] < cooldown:
            return None  # this burst already cut the limit
        new = max(limits.aimd_min_units, row["effective"] * limits.aimd_decrease_pct // 100)
        if new < row["effective"]:
            set_limit(conn, key, new)
            conn.execute("update resource_pool_shard set updated_at = %s where resource_key = %s", (now, key))
        return new

    new = platform.db.transaction(tx)
    if new is not None:
        publish(PROVIDER_LIMIT_DECREASED, provider=provider)
        logger.info("provider account limit lowered after 429", extra={"provider": provider, "account": account, "limit": new})
    return new


def increase(platform, provider: str, account: str) -> int | None:
    """Additive increase after an accepted submit; lifts the limit once it reaches capacity. A
    read-only query when the account is not limited, which is the usual case."""
    limits = platform.config.limits
    key = account_key(provider, account)
    with platform.db.connection() as conn:
        row = conn.execute(_STATE, (key,)).fetchone()
    if not row["limited"]:
        return None

    def tx(conn) -> int | None:
        row = conn.execute(_STATE, (key,)).fetchone()
        if not row["limited"]:
            return None
        new = row["effective"] + limits.aimd_increase_units
        set_limit(conn, key, None if new >= row["capacity"] else new)
        return new

    return platform.db.transaction(tx)
