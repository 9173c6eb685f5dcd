"""An adaptive concurrency limit per provider account (AIMD): a 429 cuts the account's limit to a
share of what it was, each accepted submit gives a little back until the configured capacity is
reached and the limit is lifted. The limit lives on the account's resource_pool_shard rows, so the
scheduler's conditional increments obey it: 429s throttle the claims, not just the submits.

Each change runs in its own short transaction, never inside a task's transaction, so it cannot
join a task lock and a shard lock in the opposite order of a claim. It locks the account's shards
first and then reads the operator's limit in force on its own connection (never a cached one, nor
a second pooled connection while it holds the first): an operator's resize holds the same locks,
so no change commits between that read and the new limit."""
from __future__ import annotations

from aivedio.metrics_catalog import PROVIDER_LIMIT_DECREASED
from aivedio.observability import logger, publish
from aivedio.policy.capacity import SELECT_OVERRIDE, account_limit_of, account_override_key
from aivedio.scheduling.resources import account_key, pool_settled, set_limit

_LOCK = "select 1 from resource_pool_shard where resource_key = %s order by shard_no for update"
_STATE = """select coalesce(sum(capacity_units), 0)::bigint as capacity,
                   coalesce(sum(coalesce(limit_units, capacity_units)), 0)::bigint as effective,
                   bool_or(limit_units is not null) as limited, max(updated_at) as changed_at,
                   array_agg(capacity_units order by shard_no) as capacities
              from resource_pool_shard where resource_key = %s"""


def _target(conn, platform, provider: str, account: str) -> int | None:
    """The account's max_concurrency in force: the operator's override as committed now, else the
    config's (None for an account the config lacks)."""
    row = conn.execute(SELECT_OVERRIDE, ("PROVIDER_ACCOUNT", account_override_key(provider, account))).fetchone()
    if row is not None and row["settings"].get("max_concurrency") is not None:
        return int(row["settings"]["max_concurrency"])
    return account_limit_of(platform.config, provider, account)


def _draining(conn, platform, provider: str, account: str, row: dict) -> bool:
    """An operator resized the account (aivedio.admin.capacity) and its shards are not yet the plain
    split of the new limit: lowered below what was running, they hold the drain's own limits, exact
    across shards, which an even split here would undo. The limit is left to that drain until it
    has converged."""
    target = _target(conn, platform, provider, account)
    return target is not None and (row["capacity"] > target or not pool_settled(list(row["capacities"] or []), target))


def decrease(platform, provider: str, account: str) -> int | None:
    """Multiplicative decrease after a 429. Returns the new limit."""
    limits = platform.config.limits
    key = account_key(provider, account)

    now = platform.clock.now()
    cooldown = platform.clock.delta(limits.aimd_cooldown_seconds)

    def tx(conn) -> int | None:
        conn.execute(_LOCK, (key,))
        row = conn.execute(_STATE, (key,)).fetchone()
        if not row["capacity"] or _draining(conn, platform, provider, account, row):
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
        conn.execute(_LOCK, (key,))
        row = conn.execute(_STATE, (key,)).fetchone()
        if not row["limited"] or _draining(conn, platform, provider, account, row):
            return None
        new = row["effective"] + limits.aimd_increase_units
        set_limit(conn, key, None if new >= row["capacity"] else new)
        return new

    return platform.db.transaction(tx)
