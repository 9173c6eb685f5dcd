"""Capacities and admission switches an operator changes at run time (issue 16; ch. 18.5, 18.19.4).

The config file says what a deployment starts with: each lane's capacity_units, borrowable_units,
min_headroom_units, max_queue_units and admission_open, the worker and model pools, each provider
account's max_concurrency. An operator overrides any of them, one row of capacity_override
(migration 0170) per lane, pool, provider account or switch, holding only the fields overridden:

- kind LANE, key the lane: {"capacity_units", "borrowable_units", "min_headroom_units", "max_queue_units"};
- kind POOL, key a pool's resource key (worker:cpu, worker:gpu, cost:platform, model:<model>): {"capacity_units"};
- kind PROVIDER_ACCOUNT, key "<provider>/<account_id>": {"max_concurrency"};
- kind SWITCH, key "lane:<lane>" or "resource_class:<class>": {"open": bool}. A closed lane or
  resource class makes admission answer 403 REJECT_RESOURCE_CLASS_DISABLED; work already queued runs.

Where the change takes force:
- capacities that claims check live in resource_pool_shard, shared by every process: a change
  resizes the pool's shards in the same transaction that records it (resources.resize_pool), so
  the next claim anywhere obeys it. Lowering below what runs never cuts running work: the pool
  takes no new work until enough has drained, and never more than the new total after that.
  `converge` (run by the scheduler tick) re-splits a resized pool as its work drains;
- figures read from the config (a lane's switch, borrowing, headroom, queue limit) come from
  `effective_config(platform)`: the config with the overrides applied, cached per process for
  CACHE_SECONDS platform seconds (so a change is seen everywhere within seconds), and dropped at
  once in the process that made the change (`invalidate`);
- a process start applies the config through the same overrides (resources.ensure_platform_pools),
  so a restart never undoes an operator's change.

Every change validates first and raises InvalidRequest naming each bad field, having written
nothing; then it writes the override, resizes the pools and appends an audit_log row with the old
and new values and the reason (optional, never blank), in the caller's transaction. The caller checks the permission
(capacity.write, switch.write): the admin API's gate, or the trusted CLI."""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from aivedio.pricing.estimates import RESOURCE_CLASSES
from aivedio.config import LANES, PlatformConfig
from aivedio.errors import InvalidRequest
from aivedio.observability import logger
from aivedio.scheduling.resources import account_key, platform_pools, pool_settled, provider_key, resize_pool

KINDS = ("LANE", "POOL", "PROVIDER_ACCOUNT", "SWITCH")
LANE_FIELDS = ("capacity_units", "borrowable_units", "min_headroom_units", "max_queue_units")
MAX_UNITS = 2**31 - 1
MAX_REASON = 1000
# Platform seconds another process may act on the overrides it read before a change (each process
# re-reads the table at most this often, but never more often than MIN_CACHE_REAL_SECONDS).
CACHE_SECONDS = 2.0
MIN_CACHE_REAL_SECONDS = 0.1
# Platform seconds between two passes of `converge` in one process.
CONVERGE_SECONDS = 5.0

SELECT_OVERRIDES = """select kind, key, settings, version, updated_by, reason, updated_at from capacity_override
                       order by kind, key"""
LOCK_OVERRIDE_KEY = "select pg_advisory_xact_lock(hashtext('capacity_override:' || %s || ':' || %s))"
SELECT_OVERRIDE = "select * from capacity_override where kind = %s and key = %s"
UPSERT_OVERRIDE = """insert into capacity_override (kind, key, settings, updated_by, reason, created_at, updated_at)
                     values (%(kind)s, %(key)s, %(settings)s, %(by)s, %(reason)s, %(now)s, %(now)s)
                     on conflict (kind, key) do update
                        set settings = excluded.settings, version = capacity_override.version + 1,
                            updated_by = excluded.updated_by, reason = excluded.reason, updated_at = excluded.updated_at
                     returning *"""
# A lane's capacity may not fall below what a tenant of it has reserved (the policy rule of admin.policy).
MOST_RESERVED = """select tenant_id, reserved_units from tenant_scheduling_policy where service_class = %s
                    order by reserved_units desc limit 1"""
# The pools' shard rows, locked in the order claims lock them (key, then shard).
LOCK_SHARDS = """select 1 from resource_pool_shard where resource_key = any(%s) order by resource_key, shard_no
                  for update"""
# What claims obey now per pool: the capacity within each shard's limit, and the units in use.
POOL_STATE = """select resource_key, count(*)::int as shards, sum(used_units)::bigint as used,
                       sum(least(capacity_units, coalesce(limit_units, capacity_units)))::bigint as in_force,
                       bool_or(limit_units is not null) as limited,
                       array_agg(capacity_units order by shard_no) as capacities
                  from resource_pool_shard where resource_key = any(%s) group by resource_key"""


# --- the overrides and the effective config -------------------------------------------------------

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
    (pure; pool overrides apply to platform_pools, see effective_pools)."""
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


def effective_pools(config: PlatformConfig, ov: Overrides) -> dict[str, tuple[int, int]]:
    """platform_pools of the effective config, with the POOL overrides: key -> (capacity, shards)."""
    pools = platform_pools(apply_overrides(config, ov))
    for key, s in ov.of_kind("POOL").items():
        if key in pools and "capacity_units" in s:
            pools[key] = (int(s["capacity_units"]), pools[key][1])
    return pools


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


# --- validation -------------------------------------------------------------------------------------

def _units(value: Any, field: str, bad: dict[str, str], *, minimum: int = 0) -> int | None:
    if value is None:
        return None
    if type(value) is not int:  # bool is an int to Python, never a capacity
        bad[field] = "an integer"
        return None
    if not minimum <= value <= MAX_UNITS:
        bad[field] = f"from {minimum} to {MAX_UNITS}"
        return None
    return value


def _reason(reason: Any, bad: dict[str, str]) -> str | None:
    """Why (kept in the audit log): optional, but never blank."""
    if reason is None:
        return None
    if not isinstance(reason, str) or not reason.strip():
        bad["reason"] = "a non-empty text: why the change is made"
        return None
    if len(reason) > MAX_REASON:
        bad["reason"] = f"at most {MAX_REASON} characters"
        return None
    return reason.strip()


def _raise(bad: dict[str, str], what: str) -> None:
    if bad:
        raise InvalidRequest(f"invalid {what}: {', '.join(sorted(bad))}", bad)


def _upsert(conn, *, kind: str, key: str, settings: dict, operator: str, reason: str | None, now: datetime) -> dict:
    return conn.execute(UPSERT_OVERRIDE, {"kind": kind, "key": key, "settings": Jsonb(settings), "by": operator,
                                          "reason": reason, "now": now}).fetchone()


def _locked_settings(conn, kind: str, key: str) -> dict:
    conn.execute(LOCK_OVERRIDE_KEY, (kind, key))
    row = conn.execute(SELECT_OVERRIDE, (kind, key)).fetchone()
    return dict(row["settings"]) if row else {}


def _audit(conn, *, operator: str, action: str, target: str, old: dict, new: dict, reason: str | None) -> None:
    from aivedio.policy import roles as rbac

    rbac.audit(conn, operator=operator, action=action, target=target, old=old, new=new, reason=reason)


def _resize(conn, config: PlatformConfig, ov: Overrides, keys: list[str]) -> None:
    pools = effective_pools(config, ov)
    for key in sorted(keys):  # key order, as claims lock them
        if key in pools:
            resize_pool(conn, key, *pools[key])


def _now(now: datetime | None) -> datetime:
    from datetime import timezone

    return now or datetime.now(timezone.utc)


# --- lanes ------------------------------------------------------------------------------------------

def _lane_doc(lane: str, lc) -> dict:
    return {"lane": lane, "capacity_units": lc.capacity_units, "borrowable_units": lc.borrowable_units,
            "min_headroom_units": lc.min_headroom_units, "max_queue_units": lc.max_queue_units,
            "admission_open": lc.admission_open}


def set_lane(conn: psycopg.Connection, config: PlatformConfig, *, operator: str, lane: Any, reason: Any = None,
             capacity_units: Any = None, borrowable_units: Any = None, min_headroom_units: Any = None,
             max_queue_units: Any = None, now: datetime | None = None) -> dict:
    """Override a lane's capacity and borrowing figures (those given; the rest stay as they are).
    The lane's pool (and the enterprise lane's lending pool) is resized at once."""
    bad: dict[str, str] = {}
    if not isinstance(lane, str) or lane not in config.lanes:
        bad["lane"] = f"unknown lane; lanes are {', '.join(LANES)}"
    given = {f: _units(v, f, bad) for f, v in (("capacity_units", capacity_units), ("borrowable_units", borrowable_units),
                                               ("min_headroom_units", min_headroom_units),
                                               ("max_queue_units", max_queue_units)) if v is not None}
    reason = _reason(reason, bad)
    if not given and not bad:
        bad["capacity_units"] = "give at least one of capacity_units, borrowable_units, min_headroom_units, max_queue_units"
    _raise(bad, "lane change")
    if "capacity_units" in given:
        # The rule reserved_units <= the lane's capacity is checked by both sides: here against the
        # policies, by admin.policy.set_policy against the lanes. Both take the policy-set lock
        # first (then the override key, the shards, the audit chain head), so each sees the other
        # committed, never a state the other is about to change.
        from aivedio.policy.tenant_policy import POLICY_SET_LOCK

        conn.execute(POLICY_SET_LOCK)
    current = _locked_settings(conn, "LANE", lane)
    ov = load_overrides(conn)
    before = apply_overrides(config, ov).lanes[lane]
    after = before.model_copy(update=given)
    if after.borrowable_units > after.capacity_units:
        bad["borrowable_units" if "borrowable_units" in given else "capacity_units"] = \
            f"borrowable_units ({after.borrowable_units}) may not exceed capacity_units ({after.capacity_units})"
    if after.min_headroom_units > after.capacity_units:
        bad["min_headroom_units" if "min_headroom_units" in given else "capacity_units"] = \
            f"min_headroom_units ({after.min_headroom_units}) may not exceed capacity_units ({after.capacity_units})"
    if "capacity_units" in given and "capacity_units" not in bad:
        top = conn.execute(MOST_RESERVED, (lane,)).fetchone()
        if top is not None and top["reserved_units"] > after.capacity_units:
            bad["capacity_units"] = (f"below the reserved_units ({top['reserved_units']}) of tenant {top['tenant_id']} "
                                     f"in this lane; lower its policy first")
    _raise(bad, "lane change")
    row = _upsert(conn, kind="LANE", key=lane, settings={**current, **given}, operator=operator, reason=reason,
                  now=_now(now))
    ov = load_overrides(conn)
    _resize(conn, config, ov, [f"lane:{lane}", f"lane:{lane}:lent"])
    if after.borrowable_units == 0 and before.borrowable_units > 0:
        resize_pool(conn, f"lane:{lane}:lent", 0, 1)  # no longer in platform_pools: emptied, never lent again
    old, new = _lane_doc(lane, before), _lane_doc(lane, after)
    _audit(conn, operator=operator, action="lane.set", target=f"lane:{lane}", old=old, new=new, reason=reason)
    return {**new, "override_version": int(row["version"])}


def lane_report(platform) -> list[dict]:
    """Per lane, in the scheduler's order: the capacity in force (capacity_units, borrowable_units,
    min_headroom_units, max_queue_units, admission_open, with the operator's override if any),
    queued tasks and units, running and borrowed units, the oldest wait (platform seconds), and
    in_force_units: what claims obey now (below capacity_units while lowered capacity drains)."""
    from aivedio.scheduling.gauges import read_gauges

    cfg = effective_config(platform)
    ov = overrides(platform)
    gauges = read_gauges(platform)["lanes"]
    keys = [f"lane:{lane}" for lane in cfg.lanes]
    with platform.db.connection() as conn:
        state = {r["resource_key"]: r for r in conn.execute(POOL_STATE, (keys,)).fetchall()}
    order = [lane for lane in cfg.scheduler.lane_order if lane in cfg.lanes]
    order += [lane for lane in cfg.lanes if lane not in order]
    out = []
    for lane in order:
        lc, g, st = cfg.lanes[lane], gauges.get(lane, {}), state.get(f"lane:{lane}")
        out.append({**_lane_doc(lane, lc),
                    "queued_tasks": int(g.get("queued_tasks", 0)), "queued_units": int(g.get("queued_units", 0)),
                    "running_units": int(st["used"]) if st else int(g.get("running_units", 0)),
                    "borrowed_units": int(g.get("borrowed_units", 0)),
                    "oldest_wait_seconds": float(g.get("oldest_wait_seconds", 0.0)),
                    "in_force_units": int(st["in_force"]) if st else 0,
                    "override": _override_meta(ov, ("LANE", lane), ("SWITCH", f"lane:{lane}"))})
    return out


def _override_meta(ov: Overrides, *keys: tuple[str, str]) -> dict | None:
    """The newest change among these override rows, or None when none is overridden."""
    metas = [m for k in keys if (m := ov.meta(*k)) is not None]
    return max(metas, key=lambda m: m["updated_at"] or "") if metas else None


# --- pools ------------------------------------------------------------------------------------------

def operator_pools(config: PlatformConfig) -> list[str]:
    """The pools set with `set_pool`: every pool but the lanes' and the provider accounts' (those
    are set as lanes and accounts)."""
    return [k for k in platform_pools(config) if not k.startswith(("lane:", "provider:", "provider-account:"))]


def set_pool(conn: psycopg.Connection, config: PlatformConfig, *, operator: str, key: Any, capacity_units: Any,
             reason: Any = None, now: datetime | None = None) -> dict:
    """Override one resource pool's capacity (worker:cpu, worker:gpu, cost:platform, model:<model>)."""
    bad: dict[str, str] = {}
    known = operator_pools(config)
    if not isinstance(key, str) or key not in known:
        bad["key"] = f"unknown pool; pools are {', '.join(sorted(known))} (lanes and provider accounts are set as such)"
    if capacity_units is None:
        bad["capacity_units"] = "required"
    units = _units(capacity_units, "capacity_units", bad)
    reason = _reason(reason, bad)
    _raise(bad, "pool change")
    _locked_settings(conn, "POOL", key)
    ov = load_overrides(conn)
    before = effective_pools(config, ov)[key][0]
    row = _upsert(conn, kind="POOL", key=key, settings={"capacity_units": units}, operator=operator, reason=reason,
                  now=_now(now))
    _resize(conn, config, load_overrides(conn), [key])
    _audit(conn, operator=operator, action="pool.set", target=f"pool:{key}", old={"capacity_units": before},
           new={"capacity_units": units}, reason=reason)
    return {"key": key, "capacity_units": units, "configured_units": platform_pools(config)[key][0],
            "override_version": int(row["version"])}


def _pool_doc(key: str, configured: int, capacity: int, st: dict | None, meta: dict | None) -> dict:
    return {"key": key, "configured_units": configured, "capacity_units": capacity,
            "in_force_units": int(st["in_force"]) if st else 0, "used_units": int(st["used"]) if st else 0,
            "shards": int(st["shards"]) if st else 0, "limited": bool(st["limited"]) if st else False,
            "override": meta}


def pool_report(conn: psycopg.Connection, config: PlatformConfig, ov: Overrides, key: str | None = None) -> list[dict]:
    """Each operator-set pool (or just `key`): configured and effective capacity, what claims obey
    now, the units in use, and the override if any."""
    keys = operator_pools(config)
    if key is not None:
        if key not in keys:
            raise InvalidRequest("unknown pool", {"key": f"unknown pool; pools are {', '.join(sorted(keys))}"})
        keys = [key]
    configured, effective = platform_pools(config), effective_pools(config, ov)
    state = {r["resource_key"]: r for r in conn.execute(POOL_STATE, (keys,)).fetchall()}
    return [_pool_doc(k, configured[k][0], effective[k][0], state.get(k), ov.meta("POOL", k)) for k in sorted(keys)]


# --- provider accounts --------------------------------------------------------------------------------

def set_provider_account(conn: psycopg.Connection, config: PlatformConfig, *, operator: str, provider: Any,
                         account_id: Any, max_concurrency: Any, reason: Any = None, now: datetime | None = None) -> dict:
    """Override a provider account's max_concurrency: its account pool and each of its
    provider:<account>:<region>:<model> pools are resized at once (lowered: running jobs finish,
    new claims wait until fewer than the new limit run)."""
    bad: dict[str, str] = {}
    p = config.provider(provider) if isinstance(provider, str) else None
    account = None
    if p is None:
        bad["provider"] = f"unknown provider; providers are {', '.join(q.name for q in config.providers)}"
    else:
        account = next((a for a in p.accounts if a.account_id == account_id), None)
        if account is None:
            bad["account_id"] = f"unknown account of {p.name}; accounts are {', '.join(a.account_id for a in p.accounts)}"
    if max_concurrency is None:
        bad["max_concurrency"] = "required"
    limit = _units(max_concurrency, "max_concurrency", bad, minimum=1)
    reason = _reason(reason, bad)
    _raise(bad, "provider account change")
    okey = account_override_key(p.name, account.account_id)
    _locked_settings(conn, "PROVIDER_ACCOUNT", okey)
    before = account_limit_of(apply_overrides(config, load_overrides(conn)), p.name, account.account_id)
    row = _upsert(conn, kind="PROVIDER_ACCOUNT", key=okey, settings={"max_concurrency": limit}, operator=operator,
                  reason=reason, now=_now(now))
    keys = [account_key(p.name, account.account_id)] + [provider_key(p.name, account.account_id, account.region, m)
                                                        for m in p.models]
    _resize(conn, config, load_overrides(conn), keys)
    _audit(conn, operator=operator, action="provider_account.set", target=f"provider_account:{okey}",
           old={"max_concurrency": before}, new={"max_concurrency": limit}, reason=reason)
    return {"provider": p.name, "account_id": account.account_id, "region": account.region, "max_concurrency": limit,
            "configured_max_concurrency": account.max_concurrency, "override_version": int(row["version"])}


def account_limit_of(config: PlatformConfig, provider: str, account_id: str) -> int | None:
    p = config.provider(provider)
    a = next((a for a in p.accounts if a.account_id == account_id), None) if p else None
    return a.max_concurrency if a else None


def provider_account_report(conn: psycopg.Connection, config: PlatformConfig, ov: Overrides) -> list[dict]:
    """Each provider account: configured and effective max_concurrency, what claims obey now (the
    adaptive 429 limit included) and the slots in use."""
    eff = apply_overrides(config, ov)
    keys = [account_key(p.name, a.account_id) for p in config.providers for a in p.accounts]
    state = {r["resource_key"]: r for r in conn.execute(POOL_STATE, (keys,)).fetchall()}
    out = []
    for p, ep in zip(config.providers, eff.providers):
        for a, ea in zip(p.accounts, ep.accounts):
            st = state.get(account_key(p.name, a.account_id))
            out.append({"provider": p.name, "account_id": a.account_id, "region": a.region,
                        "configured_max_concurrency": a.max_concurrency, "max_concurrency": ea.max_concurrency,
                        "in_force_units": int(st["in_force"]) if st else 0, "used_units": int(st["used"]) if st else 0,
                        "limited": bool(st["limited"]) if st else False,
                        "override": ov.meta("PROVIDER_ACCOUNT", account_override_key(p.name, a.account_id))})
    return out


# --- switches ---------------------------------------------------------------------------------------

def switch_name(*, lane: Any = None, resource_class: Any = None) -> str:
    return f"lane:{lane}" if lane is not None else f"resource_class:{resource_class}"


def set_switch(conn: psycopg.Connection, config: PlatformConfig, *, operator: str, open: Any, reason: Any = None,
               lane: Any = None, resource_class: Any = None, now: datetime | None = None) -> dict:
    """Open or close admission to a lane or a resource class. Closed, admission answers
    REJECT_RESOURCE_CLASS_DISABLED (403); tasks already queued or running are left alone."""
    bad: dict[str, str] = {}
    if (lane is None) == (resource_class is None):
        bad["lane" if lane is not None else "resource_class"] = "give exactly one of lane and resource_class"
    elif lane is not None and (not isinstance(lane, str) or lane not in config.lanes):
        bad["lane"] = f"unknown lane; lanes are {', '.join(LANES)}"
    elif resource_class is not None and (not isinstance(resource_class, str) or resource_class not in RESOURCE_CLASSES):
        bad["resource_class"] = f"unknown resource class; classes are {', '.join(RESOURCE_CLASSES)}"
    if type(open) is not bool:
        bad["open"] = "true or false"
    reason = _reason(reason, bad)
    _raise(bad, "switch change")
    name = switch_name(lane=lane, resource_class=resource_class)
    _locked_settings(conn, "SWITCH", name)
    before = _switch_state(config, load_overrides(conn), name)
    row = _upsert(conn, kind="SWITCH", key=name, settings={"open": open}, operator=operator, reason=reason, now=_now(now))
    _audit(conn, operator=operator, action="switch.set", target=f"switch:{name}", old={"open": before},
           new={"open": open}, reason=reason)
    return {"switch": name, "kind": "lane" if lane is not None else "resource_class",
            "name": lane if lane is not None else resource_class, "open": open, "override_version": int(row["version"])}


def _switch_state(config: PlatformConfig, ov: Overrides, name: str) -> bool:
    sw = ov.switch(name)
    if sw is not None:
        return sw
    kind, _, value = name.partition(":")
    return config.lanes[value].admission_open if kind == "lane" else True


def switch_report(config: PlatformConfig, ov: Overrides) -> list[dict]:
    """Every admission switch: each lane's, then each resource class's, open or closed, and by whom."""
    names = [("lane", lane) for lane in config.lanes] + [("resource_class", rc) for rc in RESOURCE_CLASSES]
    return [{"switch": f"{kind}:{value}", "kind": kind, "name": value,
             "open": _switch_state(config, ov, f"{kind}:{value}"), "override": ov.meta("SWITCH", f"{kind}:{value}")}
            for kind, value in names]


# --- convergence ------------------------------------------------------------------------------------

_CONVERGED = "capacity_converged_at"  # platform.extras: time.monotonic() of this process's last pass


def overridden_pool_keys(config: PlatformConfig, ov: Overrides) -> list[str]:
    """The pool keys that operator overrides set."""
    keys: list[str] = []
    for lane in ov.of_kind("LANE"):
        keys += [f"lane:{lane}", f"lane:{lane}:lent"]
    keys += list(ov.of_kind("POOL"))
    for okey in ov.of_kind("PROVIDER_ACCOUNT"):
        provider, _, account_id = okey.partition("/")
        p = config.provider(provider)
        a = next((a for a in p.accounts if a.account_id == account_id), None) if p else None
        if a is not None:
            keys += [account_key(p.name, a.account_id)] + [provider_key(p.name, a.account_id, a.region, m) for m in p.models]
    return keys


def converge(platform, *, force: bool = False) -> int:
    """Re-split each overridden pool that a resize left unsettled (lowered below what ran, the
    shards hold back more than needed as that work drains). At most once per CONVERGE_SECONDS per
    process; a read when nothing is overridden or every pool is settled. Returns pools resized."""
    now = time.monotonic()
    if not force and now - platform.extras.get(_CONVERGED, float("-inf")) < platform.clock.real_seconds(CONVERGE_SECONDS):
        return 0
    platform.extras[_CONVERGED] = now
    ov = overrides(platform)
    if not ov.rows:
        return 0
    pools = effective_pools(platform.config, ov)
    keys = [k for k in overridden_pool_keys(platform.config, ov) if k in pools]
    if not keys:
        return 0
    with platform.db.connection() as conn:
        todo = [r["resource_key"] for r in conn.execute(POOL_STATE, (keys,)).fetchall()
                if not pool_settled(list(r["capacities"]), pools[r["resource_key"]][0])]
    if not todo:
        return 0

    def tx(conn) -> int:
        # The cached overrides above only pick candidates: they may predate a change another process
        # just made, and re-splitting to them would put an old capacity back. Under the shards' locks
        # (which every set_* holds while it writes its override and resizes), the overrides read
        # now are the ones in force, and no change can commit between that read and the resize.
        conn.execute(LOCK_SHARDS, (sorted(todo),))
        fresh = effective_pools(platform.config, load_overrides(conn))
        state = {r["resource_key"]: r for r in conn.execute(POOL_STATE, (todo,)).fetchall()}
        return sum(resize_pool(conn, k, *fresh[k], keep_adaptive=True) for k in sorted(todo)
                   if k in fresh and k in state and not pool_settled(list(state[k]["capacities"]), fresh[k][0]))

    try:
        return platform.db.transaction(tx)
    except psycopg.Error as e:  # the next pass tries again
        logger.warning("capacity convergence failed", extra={"error": repr(e)[:200]})
        return 0


def run_change(platform, fn) -> dict:
    """fn(conn) in one transaction, then this process's overrides dropped so it sees the change now."""
    doc = platform.db.transaction(fn)
    invalidate(platform)
    return doc

