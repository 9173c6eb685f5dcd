"""Capacities and admission switches an operator overrides at run time, as data (ch. 18.5,
18.19.4): what the scheduler, the claims and admission read. aivedio.admin.capacity is the
operator's side: the validated, audited changes and the reports.

The config file says what a deployment starts with: each lane's capacity_units, borrowable_units,
min_headroom_units, max_queue_units and admission_open, the worker and model pools, each provider
account's max_concurrency. An operator overrides any of them, one row of capacity_override
(migration 0170) per lane, pool, provider account or switch, holding only the fields overridden:

- kind LANE, key the lane: {"capacity_units", "borrowable_units", "min_headroom_units", "max_queue_units"};
- kind POOL, key a pool's resource key (worker:cpu, worker:gpu, cost:platform, model:<model>): {"capacity_units"};
- kind PROVIDER_ACCOUNT, key "<provider>/<account_id>": {"max_concurrency"};
- kind SWITCH, key "lane:<lane>" or "resource_class:<class>": {"open": bool}. A closed lane or
  resource class makes admission answer 403 REJECT_RESOURCE_CLASS_DISABLED; work already queued runs.

Figures read from the config (a lane's switch, borrowing, headroom, queue limit) come from
`effective_config(platform)`: the config with the overrides applied, cached per process for
CACHE_SECONDS platform seconds (so a change is seen everywhere within seconds), and dropped at once
in the process that made the change (`invalidate`). Capacities that claims check live in
resource_pool_shard (aivedio.scheduling.resources), resized in the transaction that records a change."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import psycopg

from aivedio.config import PlatformConfig
from aivedio.observability import logger

KINDS = ("LANE", "POOL", "PROVIDER_ACCOUNT", "SWITCH")
LANE_FIELDS = ("capacity_units", "borrowable_units", "min_headroom_units", "max_queue_units")
# Platform seconds another process may act on the overrides it read before a change (each process
# re-reads the table at most this often, but never more often than MIN_CACHE_REAL_SECONDS).
CACHE_SECONDS = 2.0
MIN_CACHE_REAL_SECONDS = 0.1

SELECT_OVERRIDES = """select kind, key, settings, version, updated_by, reason, updated_at from capacity_override
                       order by kind, key"""
SELECT_OVERRIDE = "select * from capacity_override where kind = %s and key = %s"


@dataclass(frozen=True)
class Overrides:
    """The capacity_override rows: (kind, key) -> {settings, version, updated_by, reason, updated_at}."""

    rows: dict[tuple[str, str], dict]

    def settings(self, kind: str, key: str) -> dict:
        row = self.rows.get((kind, key))
        return dict(row["settings"]) if row else {}

    def meta(self, kind: str, key: str) -> dict | None:
        row = self.rows.get((kind, key))
        if row is None:
            return None
        return {"version": int(row["version"]), "updated_by": row["updated_by"], "reason": row["reason"],
                "updated_at": row["updated_at"].isoformat() if row["updated_at"] else None}

    def switch(self, name: str) -> bool | None:
        return self.settings("SWITCH", name).get("open")

    def of_kind(self, kind: str) -> dict[str, dict]:
        return {key: dict(r["settings"]) for (k, key), r in self.rows.items() if k == kind}


NO_OVERRIDES = Overrides({})


def load_overrides(conn: psycopg.Connection) -> Overrides:
    return Overrides({(r["kind"], r["key"]): r for r in conn.execute(SELECT_OVERRIDES).fetchall()})


def account_override_key(provider: str, account_id: str) -> str:
    return f"{provider}/{account_id}"


def apply_overrides(config: PlatformConfig, ov: Overrides) -> PlatformConfig:
    """The config with the operator's overrides of lanes, switches and provider accounts applied
    (pure; pool overrides apply to the pools, aivedio.scheduling.resources.effective_pools)."""
    if not ov.rows:
        return config
    lanes = {}
    for name, lc in config.lanes.items():
        update = {k: v for k, v in ov.settings("LANE", name).items() if k in LANE_FIELDS}
        if (sw := ov.switch(f"lane:{name}")) is not None:
            update["admission_open"] = sw
        lanes[name] = lc.model_copy(update=update) if update else lc
    providers = []
    for p in config.providers:
        accounts = [a.model_copy(update={"max_concurrency": v})
                    if (v := ov.settings("PROVIDER_ACCOUNT", account_override_key(p.name, a.account_id)).get("max_concurrency"))
                    is not None else a for a in p.accounts]
        providers.append(p.model_copy(update={"accounts": accounts}) if accounts != p.accounts else p)
    # model_copy skips validation on purpose: the overrides were validated when they were written.
    return config.model_copy(update={"lanes": lanes, "providers": providers})


_CACHE = "capacity_overrides"  # platform.extras: (read at, Overrides, effective config)


def _cached(platform, conn: psycopg.Connection | None = None) -> tuple[float, Overrides, PlatformConfig]:
    hit = platform.extras.get(_CACHE)
    now = time.monotonic()
    ttl = max(MIN_CACHE_REAL_SECONDS, platform.clock.real_seconds(CACHE_SECONDS))
    if hit is not None and now - hit[0] < ttl:
        return hit
    try:
        if conn is not None:
            ov = load_overrides(conn)
        else:
            with platform.db.connection() as c:
                ov = load_overrides(c)
    except psycopg.Error as e:
        # A caller's own transaction may be aborted by this; callers pass a conn only outside one
        # that must survive. Without a read yet, the config alone (the overrides cannot be known).
        logger.warning("capacity overrides unreadable; using the last read", extra={"error": repr(e)[:200]})
        if hit is None:
            hit = (now, NO_OVERRIDES, platform.config)
            platform.extras[_CACHE] = hit  # tried again after the ttl, not on every call
        return hit
    entry = (now, ov, apply_overrides(platform.config, ov))
    platform.extras[_CACHE] = entry
    return entry


def overrides(platform, conn: psycopg.Connection | None = None) -> Overrides:
    return _cached(platform, conn)[1]


def effective_config(platform, conn: psycopg.Connection | None = None) -> PlatformConfig:
    """platform.config with the operator's overrides, at most CACHE_SECONDS old. `conn`: read on it
    when the cache is stale (a caller holding a connection must not wait for another)."""
    return _cached(platform, conn)[2]


def invalidate(platform) -> None:
    """Forget this process's overrides: the next read sees a change just committed here."""
    platform.extras.pop(_CACHE, None)


def resource_class_open(platform, resource_class: str) -> bool:
    return overrides(platform).switch(f"resource_class:{resource_class}") is not False


def account_limit(platform, provider: str, account_id: str) -> int | None:
    """A provider account's effective max_concurrency (None for an account the config lacks)."""
    p = effective_config(platform).provider(provider)
    a = next((a for a in p.accounts if a.account_id == account_id), None) if p else None
    return a.max_concurrency if a else None


def account_limit_of(config: PlatformConfig, provider: str, account_id: str) -> int | None:
    p = config.provider(provider)
    a = next((a for a in p.accounts if a.account_id == account_id), None) if p else None
    return a.max_concurrency if a else None


# --- switches ---------------------------------------------------------------------------------------

def switch_name(*, lane: Any = None, resource_class: Any = None) -> str:
    return f"lane:{lane}" if lane is not None else f"resource_class:{resource_class}"


def switch_state(config: PlatformConfig, ov: Overrides, name: str) -> bool:
    sw = ov.switch(name)
    if sw is not None:
        return sw
    kind, _, value = name.partition(":")
    return config.lanes[value].admission_open if kind == "lane" else True
