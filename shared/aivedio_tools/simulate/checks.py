"""What a finished run left in PostgreSQL: the task records the metrics are computed from, the
platform's invariants checked against the database itself (aivedio.invariants: the reservations are
the facts; counters, task states and DRR rows must agree with them), and measured figures against a
scenario's prediction."""
from __future__ import annotations

import psycopg

from aivedio import invariants


def collect(conn: psycopg.Connection, clock, stats) -> dict:
    s = clock.sim_seconds
    tasks = []
    for r in conn.execute(
        """select t.task_id, t.tenant_id, t.queue_class, t.fairness_units, t.provider_slot_units, t.enqueue_at, t.started_at,
                  t.finished_at, t.capacity_mode, t.state, t.idempotency_key, t.skip_count, t.aging_promotions, t.priority_band,
                  t.model_code, t.resolution, t.duration_seconds, a.provider, a.provider_account
             from generation_task t left join task_attempt a on a.attempt_id = t.current_attempt_id""").fetchall():
        start, end = s(r["started_at"]), s(r["finished_at"])
        runtime = stats.runtimes.get(r["task_id"])
        tasks.append({
            "task_id": r["task_id"], "tenant_id": r["tenant_id"], "lane": r["queue_class"], "units": int(r["fairness_units"]),
            "slots": int(r["provider_slot_units"]), "enqueue": s(r["enqueue_at"]), "start": start, "end": end,
            "runtime": runtime, "mode": r["capacity_mode"], "state": r["state"], "key": r["idempotency_key"],
            "skips": r["skip_count"], "aging": r["aging_promotions"], "band": r["priority_band"],
            "model": r["model_code"], "resolution": r["resolution"], "duration_seconds": r["duration_seconds"],
            "provider": r["provider"], "account": r["provider_account"],
        })
    interventions = [dict(r) for r in conn.execute(
        "select lane, tenant_id, task_id, kind, detail from scheduler_intervention order by intervention_id").fetchall()]
    drr = [dict(r) for r in conn.execute("select lane, tenant_id, deficit, fairness_debt, served_units, visits from drr_lane_tenant")]
    return {"tasks": tasks, "interventions": interventions, "drr": drr, "end": clock.t}


def _check(ok: bool, **detail) -> dict:
    return {"ok": bool(ok), **detail}


# A simulated run has no provider faults, so no task is ever tried twice (its own promise, beside
# the platform's invariants).
SEVERAL_ATTEMPTS = "select count(*)::int as n from (select task_id from task_attempt group by task_id having count(*) > 1) x"


def database_invariants(conn: psycopg.Connection) -> dict:
    """Every invariant that holds at any moment (aivedio.invariants.ALWAYS), and one attempt a task."""
    out = {}
    for inv in invariants.ALWAYS:
        n = invariants.broken(conn, inv)
        out[inv.name] = _check(n == 0, broken=n)
    several = conn.execute(SEVERAL_ATTEMPTS).fetchone()["n"]
    out["one_attempt_per_task"] = _check(several == 0, tasks_with_several_attempts=several)
    return out


def against_prediction(measured: dict, predicted: dict, tolerance: float) -> dict:
    """Each measured figure within `tolerance` (a fraction) of its prediction, e.g. peak-backlog's
    backlog and drain time against Little's law. A figure not measured (a backlog that never
    drained within the run) fails; a prediction of 0 needs a measurement of 0."""
    figures = {}
    for name, p in predicted.items():
        m = measured.get(name)
        if m is None or p is None:
            err, ok = None, False
        elif p == 0:
            err, ok = None, m == 0
        else:
            err = abs(m - p) / abs(p)
            ok = err <= tolerance
        figures[name] = {"measured": m, "predicted": p, "error": None if err is None else round(err, 4), "ok": ok}
    return _check(all(f["ok"] for f in figures.values()), tolerance=tolerance, figures=figures)
