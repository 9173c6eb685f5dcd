"""Usage against fair share (issue 16): a tenant's delivered cost units over a trailing window, per
lane, against what its weight entitles it to (GET /admin/v1/tenants/{id}/fair-share, the dashboard).

- delivered: the fairness_units of every claim in the window, in the lane of the claimed task (the
  lane whose DRR turn paid for it, a borrowed claim included). A claim writes its task_attempt with
  created_at = the claim's time, so attempts are the claims; a task claimed again after a requeue
  counts again, as DRR charges it again.
- entitled: the lane's delivered units in the window x weight / the sum of the weights of the
  tenants backlogged in the lane during the window.

Approximations, both on the side of a simple indexed read: "backlogged during the window" is "had a
claim in the window (so it had queued work then), or has queued or running work in the lane now"
(work that was queued or running only inside the window and ended in it without a claim there is
missed; a tenant backlogged for a moment counts as backlogged throughout); weights are today's (a
weight changed during the window is not apportioned)."""
from __future__ import annotations

from collections import defaultdict
from uuid import UUID

import psycopg

from aivedio.errors import InvalidRequest, NotFound
from aivedio import tasks

MAX_WINDOW_SECONDS = 30 * 86400

# Claims per lane and tenant in (since, until]: the BRIN index of migration 0180 on created_at.
DELIVERED = """select t.queue_class as lane, a.tenant_id, sum(t.fairness_units)::bigint as units, count(*) as claims
                 from task_attempt a join generation_task t on t.tenant_id = a.tenant_id and t.task_id = a.task_id
                where a.created_at > %(since)s and a.created_at <= %(until)s
                  and (%(lane)s::text is null or t.queue_class = %(lane)s)
                group by t.queue_class, a.tenant_id"""
# Tenants with queued or running (live, not terminal) work per lane now, over the partial indexes
# of queued and in-flight tasks (idx_task_schedulable, idx_task_inflight).
PRESENT = f"""select distinct queue_class as lane, tenant_id from generation_task
              where state = 'QUEUED' and (%(lane)s::text is null or queue_class = %(lane)s)
             union
             select distinct queue_class as lane, tenant_id from generation_task
              where state not in ('QUEUED', {tasks.sql_list(tasks.TERMINAL)})
                and (%(lane)s::text is null or queue_class = %(lane)s)"""
WEIGHTS = "select tenant_id, weight from tenant_scheduling_policy where tenant_id = any(%s)"
TENANT_WEIGHT = "select weight from tenant_scheduling_policy where tenant_id = %s"


def _check(platform, window_seconds: int, lane: str | None) -> None:
    bad = {}
    if not isinstance(window_seconds, int) or isinstance(window_seconds, bool) or not 1 <= window_seconds <= MAX_WINDOW_SECONDS:
        bad["query.window_seconds"] = f"an integer from 1 to {MAX_WINDOW_SECONDS}"
    if lane is not None and lane not in platform.config.lanes:
        bad["query.lane"] = f"one of {', '.join(platform.config.lanes)}"
    if bad:
        raise InvalidRequest("invalid fair-share query", bad)


def lane_shares(platform, conn: psycopg.Connection, *, window_seconds: int, lane: str | None = None) -> dict[str, dict]:
    """Every backlogged tenant's usage against its fair share, per lane: {lane: {"total_delivered_units",
    "backlogged_weight", "tenants": {tenant_id: {delivered_units, claims, weight, entitled_units,
    share, weight_share, ratio}}}}. Reads only."""
    _check(platform, window_seconds, lane)
    until = platform.clock.now()
    params = {"since": until - platform.clock.delta(window_seconds), "until": until, "lane": lane}
    delivered: dict[str, dict[UUID, tuple[int, int]]] = defaultdict(dict)
    for r in conn.execute(DELIVERED, params).fetchall():
        delivered[r["lane"]][r["tenant_id"]] = (int(r["units"]), int(r["claims"]))
    backlogged: dict[str, set[UUID]] = defaultdict(set)
    for lane_, tenants in delivered.items():
        backlogged[lane_] |= set(tenants)
    for r in conn.execute(PRESENT, params).fetchall():
        backlogged[r["lane"]].add(r["tenant_id"])
    everyone = sorted({t for ts in backlogged.values() for t in ts})
    weight = {r["tenant_id"]: int(r["weight"]) for r in conn.execute(WEIGHTS, (everyone,)).fetchall()} if everyone else {}
    out = {}
    for lane_, tenants in backlogged.items():
        total = sum(u for u, _ in delivered[lane_].values())
        weights = sum(weight.get(t, 0) for t in tenants)
        rows = {}
        for t in tenants:
            units, claims = delivered[lane_].get(t, (0, 0))
            rows[t] = _row(units, claims, weight.get(t, 0), total, weights, backlogged=True)
        out[lane_] = {"total_delivered_units": total, "backlogged_weight": weights, "tenants": rows}
    return out


def _row(units: int, claims: int, weight: int, total: int, weights: int, *, backlogged: bool) -> dict:
    weight_share = weight / weights if backlogged and weights else 0.0
    entitled = total * weight_share
    return {"delivered_units": units, "claims": claims, "weight": weight, "backlogged": backlogged,
            "entitled_units": round(entitled, 3), "share": round(units / total, 4) if total else 0.0,
            "weight_share": round(weight_share, 4), "ratio": round(units / entitled, 4) if entitled > 0 else None}


def tenant_fair_share(platform, conn: psycopg.Connection, tenant_id: UUID, *, window_seconds: int, lane: str | None = None) -> dict:
    """{tenant_id, window_seconds, lanes: [{lane, delivered_units, entitled_units, share, weight_share,
    ratio, ...}]}: every lane where the tenant was backlogged in the window (or `lane` alone, zeros
    included). share is its part of the lane's delivered units, weight_share its part of the
    backlogged weight, ratio delivered / entitled (null when nothing was entitled)."""
    row = conn.execute(TENANT_WEIGHT, (tenant_id,)).fetchone()
    if row is None:
        raise NotFound("no such tenant", details={"tenant_id": str(tenant_id)})
    shares = lane_shares(platform, conn, window_seconds=window_seconds, lane=lane)
    lanes = []
    order = [n for n in platform.config.lanes if n in shares] + sorted(n for n in shares if n not in platform.config.lanes)
    for name in ([lane] if lane is not None else order):
        s = shares.get(name, {"total_delivered_units": 0, "backlogged_weight": 0, "tenants": {}})
        mine = s["tenants"].get(tenant_id) or _row(0, 0, int(row["weight"]), s["total_delivered_units"],
                                                   s["backlogged_weight"], backlogged=False)
        if lane is None and not mine["backlogged"]:
            continue
        lanes.append({"lane": name, **mine, "lane_delivered_units": s["total_delivered_units"],
                      "backlogged_tenants": len(s["tenants"]), "backlogged_weight": s["backlogged_weight"]})
    return {"tenant_id": str(tenant_id), "window_seconds": window_seconds, "lanes": lanes}
