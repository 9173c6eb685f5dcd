"""The operator's capacity changes (ch. 18.5, 18.19.4): lanes, pools, provider accounts and
admission switches, each validated, written as an override (the data of aivedio.policy.capacity),
applied to the pools claims check, and audited; and the reports an operator reads of them.

Where a change takes force:
- capacities that claims check live in resource_pool_shard, shared by every process: a change
  resizes the pool's shards in the same transaction that records it (resources.resize_pool), so
  the next claim anywhere obeys it. Lowering below what runs never cuts running work: the pool
  takes no new work until enough has drained, and never more than the new total after that.
  `resources.converge` (run by the scheduler tick) re-splits a resized pool as its work drains;
- figures read from the config come from policy.capacity.effective_config: seen everywhere within
  its cache's seconds, and at once in the process that made the change (`run_change` drops its cache);
- a process start applies the config through the same overrides (resources.ensure_platform_pools),
  so a restart never undoes an operator's change.

Every change validates first and raises InvalidRequest naming each bad field, having written
nothing; then it writes the override, resizes the pools and appends an audit_log row with the old
and new values and the reason (optional, never blank), in the caller's transaction. Who may change
capacities is the caller's concern: the admin API's gate checks the token's role (capacity.write,
switch.write); the CLI runs with the database's credentials and is trusted."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from aivedio import audit
from aivedio.config import LANES, PlatformConfig
from aivedio.errors import InvalidRequest
from aivedio.policy.capacity import (
    SELECT_OVERRIDE,
    Overrides,
    account_limit_of,
    account_override_key,
    apply_overrides,
    effective_config,
    invalidate,
    load_overrides,
    overrides,
    switch_name,
    switch_state,
)
from aivedio.policy.tenant_policy import POLICY_SET_LOCK
from aivedio.pricing.estimates import RESOURCE_CLASSES
from aivedio.scheduling.gauges import read_gauges
from aivedio.scheduling.resources import POOL_STATE, account_key, effective_pools, platform_pools, provider_key, resize_pool

MAX_UNITS = 2**31 - 1
MAX_REASON = 1000
LOCK_OVERRIDE_KEY = "select pg_advisory_xact_lock(hashtext('capacity_override:' || %s || ':' || %s))"
UPSERT_OVERRIDE = """insert into capacity_override (kind, key, settings, updated_by, reason, created_at, updated_at)
                     values (%(kind)s, %(key)s, %(settings)s, %(by)s, %(reason)s, %(now)s, %(now)s)
                     on conflict (kind, key) do update
                        set settings = excluded.settings, version = capacity_override.version + 1,
                            updated_by = excluded.updated_by, reason = excluded.reason, updated_at = excluded.updated_at
                     returning *"""
# A lane's capacity may not fall below what a tenant of it has reserved (the rule aivedio.policy.tenant_policy keeps too).
MOST_RESERVED = """select tenant_id, reserved_units from tenant_scheduling_policy where service_class = %s
                    order by reserved_units desc limit 1"""


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
    audit.append(conn, operator=operator, action=action, target=target, old=old, new=new, reason=reason)


def _resize(conn, config: PlatformConfig, ov: Overrides, keys: list[str]) -> None:
    pools = effective_pools(config, ov)
    for key in sorted(keys):  # key order, as claims lock them
        if key in pools:
            resize_pool(conn, key, *pools[key])


def _now(now: datetime | None) -> datetime:
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
        # policies, by tenant_policy.set_policy against the lanes. Both take the policy-set lock
        # first (then the override key, the shards, the audit chain head), so each sees the other
        # committed, never a state the other is about to change.
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
    before = switch_state(config, load_overrides(conn), name)
    row = _upsert(conn, kind="SWITCH", key=name, settings={"open": open}, operator=operator, reason=reason, now=_now(now))
    _audit(conn, operator=operator, action="switch.set", target=f"switch:{name}", old={"open": before},
           new={"open": open}, reason=reason)
    return {"switch": name, "kind": "lane" if lane is not None else "resource_class",
            "name": lane if lane is not None else resource_class, "open": open, "override_version": int(row["version"])}


def switch_report(config: PlatformConfig, ov: Overrides) -> list[dict]:
    """Every admission switch: each lane's, then each resource class's, open or closed, and by whom."""
    names = [("lane", lane) for lane in config.lanes] + [("resource_class", rc) for rc in RESOURCE_CLASSES]
    return [{"switch": f"{kind}:{value}", "kind": kind, "name": value,
             "open": switch_state(config, ov, f"{kind}:{value}"), "override": ov.meta("SWITCH", f"{kind}:{value}")}
            for kind, value in names]


def run_change(platform, fn) -> dict:
    """fn(conn) in one transaction, then this process's overrides dropped so it sees the change now."""
    doc = platform.db.transaction(fn)
    invalidate(platform)
    return doc

