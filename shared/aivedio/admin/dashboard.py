"""What the live operations dashboard shows (issue 16 part 6, docs/admin-api.md "The
dashboard"), assembled from PostgreSQL in one read-only snapshot: lanes, tenants' delivered shares
against their weights, providers' health and breakers, SUBMIT_UNKNOWN and manual reviews,
reconciliation health and the recent audit trail. No HTTP here: the admin API's
routes/dashboard.py serves it as JSON, and the page polls that every couple of seconds.

Every statement is bounded (a LIMIT, or a GROUP BY over a handful of lanes and providers) and
rides an index that exists for another reader, so a few open dashboards cost next to nothing:
- queued work: idx_task_schedulable / idx_task_queued_age (state = 'QUEUED');
- running and borrowed units: idx_resource_reservation_pool (ACTIVE reservations of the lane pools);
- tenants' shares: aivedio.admin.fair_share.lane_shares (claims in the window by the BRIN index of
  migration 0180), the table cut to TENANT_ROWS rows;
- providers' health and breakers: aivedio.scheduling.router.provider_stats, the very figures route()
  filters on (cached a second per process);
- SUBMIT_UNKNOWN and MANUAL_REVIEW: idx_task_attempt_state_check, idx_task_inflight;
- reconciliation: idx_reconciliation_run_day, idx_reconciliation_item_open, uq_wallet_discrepancy_open;
- audit: its primary key, newest first.
The whole snapshot runs under a statement timeout, so a slow database shows as an error on the page
rather than piling up requests."""
from __future__ import annotations

from datetime import date, datetime
from decimal import Decimal
from typing import Any

import psycopg

from aivedio.admin import fair_share
from aivedio.caching import cached
from aivedio.policy import capacity
from aivedio.scheduling import router
from aivedio.scheduling.resources import account_key

AUDIT_ROWS = 20  # the recent audit trail shown
TENANT_ROWS = 50  # (tenant, lane) rows of the fair-share table, most delivered first
STATEMENT_TIMEOUT_MS = 2000
CACHE_KEY = "dashboard_snapshot"  # several viewers polling one process share one snapshot a second

LANE_QUEUED = """select queue_class as lane, count(*)::bigint as tasks, coalesce(sum(fairness_units), 0)::bigint as units,
                        min(enqueue_at) as oldest
                   from generation_task where state = 'QUEUED' group by queue_class"""

# Each claim reserves exactly one lane pool: its own lane's, or the lender's when it borrows (then
# also lane:<lender>:lent). Grouped by the task's own lane, so borrowed work counts where it came from.
LANE_RUNNING = """select t.queue_class as lane, count(*)::bigint as tasks, sum(r.reserved_units)::bigint as units,
                         coalesce(sum(r.reserved_units) filter (where r.resource_key <> 'lane:' || t.queue_class), 0)::bigint
                             as borrowed_units
                    from resource_reservation r join generation_task t on t.task_id = r.task_id
                   where r.state = 'ACTIVE' and r.resource_key = any(%(keys)s::text[])
                   group by t.queue_class"""

# Live capacity (what claims check: least(capacity, limit)), so a change made through the admin API
# shows at once, whatever the config file says.
POOLS = """select resource_key, sum(used_units)::bigint as used,
                  sum(least(capacity_units, coalesce(limit_units, capacity_units)))::bigint as capacity
             from resource_pool_shard where resource_key = any(%(keys)s::text[]) group by resource_key"""

# The fair-share table (aivedio.admin.fair_share.lane_shares gives every backlogged tenant's delivered
# units against its weight, per lane): the names and queued work of the rows shown.
TENANT_NAMES = "select tenant_id, name, service_class from tenant where tenant_id = any(%s)"
QUEUED_BY_TENANT = """select tenant_id, queue_class as lane, count(*)::bigint as tasks, sum(fairness_units)::bigint as units
                        from generation_task where state = 'QUEUED' and tenant_id = any(%s) group by tenant_id, queue_class"""

ATTEMPTS_BY_STATE = """select provider, state, count(*)::bigint as n from task_attempt
                        where state in ('SUBMIT_UNKNOWN', 'MANUAL_REVIEW') group by provider, state"""
REVIEWS_BY_REASON = """select coalesce(error_code, 'UNKNOWN') as reason, count(*)::bigint as n, min(updated_at) as oldest
                         from generation_task where state = 'MANUAL_REVIEW' group by 1 order by 2 desc limit 20"""

# The latest run of each provider's latest reconciled day (idx_reconciliation_run_day per provider).
LATEST_RUNS = """
select p.provider, r.run_id, r.status, lower(r.billing_period) as billing_date, r.started_at, r.finished_at,
       r.incomplete_reasons
  from unnest(%(providers)s::text[]) as p(provider)
  left join lateral (select * from reconciliation_run rr where rr.provider = p.provider
                      order by lower(rr.billing_period) desc, rr.started_at desc limit 1) r on true"""
OPEN_ITEMS = """select coalesce(provider, '?') as provider, count(*)::bigint as n, min(billing_date) as oldest_day
                  from reconciliation_item where status = 'OPEN' group by 1 limit 100"""
WALLET_DISCREPANCIES = """select count(*)::bigint as n, min(found_at) as oldest
                            from wallet_discrepancy where status = 'OPEN'"""

RECENT_AUDIT = """select audit_id, operator, action, target, tenant_id, created_at
                    from audit_log order by audit_id desc limit %(limit)s"""
DEGRADED = "select mode, reason, since from degraded_mode order by mode limit 20"
OUTBOX = """select count(*) filter (where status = 'PENDING')::bigint as pending,
                   count(*) filter (where status = 'FAILED')::bigint as dead_letters,
                   min(created_at) filter (where status = 'PENDING') as oldest_pending
              from outbox_event where status in ('PENDING', 'FAILED')"""


def _iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts is not None else None


def _age(platform, now: datetime, ts: datetime | None) -> float:
    """Platform seconds since ts (0 without one)."""
    if ts is None:
        return 0.0
    return round(max(0.0, (now - ts).total_seconds() * platform.clock.time_scale), 1)


def _jsonable(v: Any) -> Any:
    if isinstance(v, Decimal):
        return str(v)
    if isinstance(v, (date, datetime)):
        return v.isoformat()
    return v


def snapshot(platform, *, conn: psycopg.Connection | None = None, fresh: bool = False) -> dict[str, Any]:
    """The dashboard's document. Cached for a second per process (several viewers, one query set)
    unless `fresh`; `conn`: read on this connection instead of the pool (tests)."""

    def load() -> dict[str, Any]:
        # The router's outcome statistics and the operator's capacity overrides come first: each
        # takes a pooled connection of its own (cached a moment per process), which must not be
        # waited for while this snapshot holds one.

        stats, config = router.provider_stats(platform), capacity.effective_config(platform)
        if conn is not None:
            return _read(platform, conn, config, stats)
        with platform.db.connection() as c:
            return _read(platform, c, config, stats)

    return load() if fresh or conn is not None else cached(platform, CACHE_KEY, load)


def _read(platform, conn: psycopg.Connection, config, stats: dict) -> dict[str, Any]:
    """config: the effective PlatformConfig (the file with the operator's capacity overrides)."""
    now = platform.clock.now()
    with conn.transaction():
        # One consistent picture: figures that add up (queued + running) come from one snapshot.
        conn.execute("set transaction isolation level repeatable read, read only")
        conn.execute(f"set local statement_timeout = {int(STATEMENT_TIMEOUT_MS)}")
        lanes = _lanes(platform, conn, config, now)
        tenants = _tenants(platform, conn)
        attempts = conn.execute(ATTEMPTS_BY_STATE).fetchall()
        reviews = conn.execute(REVIEWS_BY_REASON).fetchall()
        providers = _providers(platform, conn, config, attempts, stats)
        reconciliation = _reconciliation(platform, conn, config, now)
        audit = [{"audit_id": r["audit_id"], "operator": r["operator"], "action": r["action"], "target": r["target"],
                  "tenant_id": str(r["tenant_id"]) if r["tenant_id"] else None, "created_at": _iso(r["created_at"])}
                 for r in conn.execute(RECENT_AUDIT, {"limit": AUDIT_ROWS}).fetchall()]
        degraded = [{"mode": r["mode"], "reason": r["reason"], "since": _iso(r["since"])}
                    for r in conn.execute(DEGRADED).fetchall()]
        ob = conn.execute(OUTBOX).fetchone()
    for p in providers:
        if p["breaker"] == "open" and not any(d["mode"] == "provider_breaker" for d in degraded):
            degraded.append({"mode": "provider_breaker", "reason": f"circuit breaker open for {p['provider']}",
                             "since": None})
    unknown = {p["provider"]: p["submit_unknown_open"] for p in providers if p["submit_unknown_open"]}
    return {
        "generated_at": now.isoformat(),
        "time_scale": platform.clock.time_scale,
        "lanes": lanes,
        "tenants": tenants,
        "providers": providers,
        "submit_unknown": {"open": sum(unknown.values()), "by_provider": unknown},
        "manual_review": {"open": sum(int(r["n"]) for r in reviews),
                          "by_reason": [{"reason": r["reason"], "open": int(r["n"]), "oldest_wait_seconds": _age(platform, now, r["oldest"])}
                                        for r in reviews]},
        "reconciliation": reconciliation,
        "outbox": {"pending": int(ob["pending"]), "dead_letters": int(ob["dead_letters"]),
                   "oldest_pending_seconds": _age(platform, now, ob["oldest_pending"])},
        "degraded": degraded,
        "breakers_open": sorted(p["provider"] for p in providers if p["breaker"] == "open"),
        "audit": audit,
    }


def _lanes(platform, conn: psycopg.Connection, config, now: datetime) -> list[dict[str, Any]]:
    cfg = config.lanes
    lane_keys = [f"lane:{lane}" for lane in cfg]
    pool_keys = lane_keys + [f"lane:{lane}:lent" for lane, lc in cfg.items() if lc.borrowable_units]
    queued = {r["lane"]: r for r in conn.execute(LANE_QUEUED).fetchall()}
    running = {r["lane"]: r for r in conn.execute(LANE_RUNNING, {"keys": lane_keys}).fetchall()}
    pools = {r["resource_key"]: r for r in conn.execute(POOLS, {"keys": pool_keys}).fetchall()}
    out = []
    for lane, lc in cfg.items():
        q, r, pool, lent = queued.get(lane), running.get(lane), pools.get(f"lane:{lane}"), pools.get(f"lane:{lane}:lent")
        capacity = int(pool["capacity"]) if pool else lc.capacity_units
        used = int(pool["used"]) if pool else 0
        out.append({
            "lane": lane,
            "capacity_units": capacity,
            "used_units": used,  # of this lane's pool, work borrowed from it included
            "utilisation_percent": round(100.0 * used / capacity, 1) if capacity else 0.0,
            "borrowable_units": int(lent["capacity"]) if lent else lc.borrowable_units,
            "lent_units": int(lent["used"]) if lent else 0,
            "queued_tasks": int(q["tasks"]) if q else 0,
            "queued_units": int(q["units"]) if q else 0,
            "running_tasks": int(r["tasks"]) if r else 0,
            "running_units": int(r["units"]) if r else 0,  # this lane's tasks, wherever they run
            "borrowed_units": int(r["borrowed_units"]) if r else 0,  # of those, on the lender's capacity
            "oldest_wait_seconds": _age(platform, now, q["oldest"] if q else None),
            "admission_open": lc.admission_open,
        })
    return out


def _tenants(platform, conn: psycopg.Connection) -> dict[str, Any]:
    window = int(platform.config.timers.throughput_window_seconds)
    shares = fair_share.lane_shares(platform, conn, window_seconds=window)
    rank = {lane: i for i, lane in enumerate(platform.config.lanes)}
    rows = sorted(((lane, tenant_id, r) for lane, s in shares.items() for tenant_id, r in s["tenants"].items()),
                  key=lambda x: (-x[2]["delivered_units"], -x[2]["weight"], rank.get(x[0], len(rank)), str(x[1])))[:TENANT_ROWS]
    ids = sorted({tenant_id for _, tenant_id, _ in rows})
    names = {r["tenant_id"]: r for r in conn.execute(TENANT_NAMES, (ids,)).fetchall()} if ids else {}
    queued = {(r["tenant_id"], r["lane"]): r for r in conn.execute(QUEUED_BY_TENANT, (ids,)).fetchall()} if ids else {}
    items = []
    for lane, tenant_id, r in rows:
        t, q = names.get(tenant_id), queued.get((tenant_id, lane))
        items.append({
            "tenant_id": str(tenant_id), "name": t["name"] if t else str(tenant_id), "service_class": t["service_class"] if t else None,
            "lane": lane, "weight": r["weight"], "delivered_units": r["delivered_units"], "claims": r["claims"],
            "entitled_units": r["entitled_units"], "queued_tasks": int(q["tasks"]) if q else 0,
            "queued_units": int(q["units"]) if q else 0,
            "share": r["share"],  # of the lane's delivered units
            "entitled_share": r["weight_share"],  # its weight over the lane's backlogged weight
            "usage_ratio": r["ratio"],  # delivered / entitled: 1.0 is exactly the fair share (null: nothing delivered)
        })
    return {"window_seconds": window, "items": items}


def _providers(platform, conn: psycopg.Connection, config, attempts: list[dict], stats: dict) -> list[dict[str, Any]]:
    keys = [account_key(p.name, a.account_id) for p in config.providers for a in p.accounts]
    pools = {r["resource_key"]: r for r in conn.execute(POOLS, {"keys": keys}).fetchall()}
    by_state: dict[tuple[str, str], int] = {(r["provider"], r["state"]): int(r["n"]) for r in attempts}
    out = []
    for p in config.providers:
        st = stats.get(p.name, router.DEFAULT_STATS)
        accounts = []
        for a in p.accounts:
            pool = pools.get(account_key(p.name, a.account_id))
            accounts.append({"account_id": a.account_id, "region": a.region,
                             "running": int(pool["used"]) if pool else 0,
                             "capacity": int(pool["capacity"]) if pool else a.max_concurrency})
        running, capacity = sum(a["running"] for a in accounts), sum(a["capacity"] for a in accounts)
        measured = p.name in stats
        out.append({
            "provider": p.name,
            "running": running,
            "capacity": capacity,
            "utilisation_percent": round(100.0 * running / capacity, 1) if capacity else 0.0,
            "samples": st.samples if measured else 0,
            "success_rate": round(st.success_rate, 3) if measured else None,
            "failure_rate": round(1 - st.success_rate, 3) if measured else None,
            # the router measures real seconds between timestamps; the page shows platform seconds
            "mean_latency_seconds": round(st.mean_latency_seconds * platform.clock.time_scale, 1) if measured else None,
            "breaker": "open" if st.breaker_open else "closed",
            "health": "down" if st.breaker_open else ("degraded" if measured and st.success_rate < 0.9 else "ok"),
            "submit_unknown_open": by_state.get((p.name, "SUBMIT_UNKNOWN"), 0),
            "manual_review_open": by_state.get((p.name, "MANUAL_REVIEW"), 0),
            "accounts": accounts,
        })
    return out


def _reconciliation(platform, conn: psycopg.Connection, config, now: datetime) -> dict[str, Any]:
    names = [p.name for p in config.providers]
    items = {r["provider"]: r for r in conn.execute(OPEN_ITEMS).fetchall()}
    runs = conn.execute(LATEST_RUNS, {"providers": names}).fetchall()
    wd = conn.execute(WALLET_DISCREPANCIES).fetchone()
    providers = []
    for r in runs:
        it = items.get(r["provider"])
        status = r["status"] or "NEVER_RUN"
        providers.append({
            "provider": r["provider"], "status": status,
            "billing_date": _jsonable(r["billing_date"]), "started_at": _iso(r["started_at"]),
            "finished_at": _iso(r["finished_at"]), "incomplete_reasons": r["incomplete_reasons"] or [],
            "open_items": int(it["n"]) if it else 0,
            "oldest_open_day": _jsonable(it["oldest_day"]) if it else None,
            # green only on a COMPLETE run with nothing open (INCOMPLETE is never green)
            "healthy": status == "COMPLETE" and not it,
        })
    return {"providers": providers, "open_items": sum(int(r["n"]) for r in items.values()),
            "wallet_discrepancies_open": int(wd["n"]),
            "oldest_wallet_discrepancy_seconds": _age(platform, now, wd["oldest"])}
