"""What a finished run left in PostgreSQL: the task records the metrics are computed from, and the
invariants checked against the database itself (the reservations are the facts; counters, task
states and DRR rows must agree with them), and measured figures against a scenario's prediction."""
from __future__ import annotations

import psycopg

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


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


def database_invariants(conn: psycopg.Connection) -> dict:
    q = lambda sql: conn.execute(sql).fetchone()  # noqa: E731
    out = {}
    r = q("""select count(*) as n, coalesce(min(used_units), 0) as min_used,
                    count(*) filter (where used_units > capacity_units) as over
               from resource_pool_shard where used_units < 0 or used_units > capacity_units""")
    out["shard_counters_within_0_and_capacity"] = _check(r["n"] == 0, bad_shards=r["n"])
    r = q("""with truth as (
                 select s.resource_key, s.shard_no, s.used_units, coalesce(sum(r.reserved_units), 0) as active
                   from resource_pool_shard s
                   left join resource_reservation r on r.resource_key = s.resource_key and r.shard_no = s.shard_no
                                                   and r.state = 'ACTIVE'
                  group by s.resource_key, s.shard_no, s.used_units)
             select count(*) filter (where used_units <> active) as n from truth""")
    out["shard_counters_equal_active_reservations"] = _check(r["n"] == 0, mismatched_shards=r["n"])
    r = q("""select count(*) as n from resource_reservation r join generation_task t using (task_id)
              where r.state = 'ACTIVE' and t.state in ('SUCCEEDED', 'FAILED', 'CANCELLED')""")
    out["no_active_reservation_for_finished_task"] = _check(r["n"] == 0, reservations=r["n"])
    r = q("""select count(*) as n from resource_reservation r
               join task_attempt a using (attempt_id) join generation_task t on t.task_id = r.task_id
              where r.state = 'ACTIVE' and (a.state in ('SUCCEEDED', 'FAILED', 'CANCELLED') or t.current_attempt_id <> a.attempt_id)""")
    out["active_reservations_belong_to_live_attempts"] = _check(r["n"] == 0, reservations=r["n"])
    r = q("""select count(*) as n from generation_task t
              where t.state in ('DISPATCHING', 'RUNNING')
                and not exists (select 1 from resource_reservation r where r.attempt_id = t.current_attempt_id
                                  and r.state = 'ACTIVE' and r.resource_key like 'lane:%%')""")
    out["running_tasks_hold_a_lane_reservation"] = _check(r["n"] == 0, tasks=r["n"])
    r = q("select count(*) as n, coalesce(min(deficit), 0) as min_deficit from drr_lane_tenant where deficit < 0 or fairness_debt < 0")
    out["drr_deficits_nonnegative"] = _check(r["n"] == 0, rows=r["n"])
    r = q("select count(*) as n from (select task_id from task_attempt group by task_id having count(*) > 1) x")
    out["one_attempt_per_task"] = _check(r["n"] == 0, tasks_with_several_attempts=r["n"])
    r = q("""select count(*) as n from generation_task
              where (state = 'SUCCEEDED' and (started_at is null or finished_at is null or finished_at < started_at))
                 or (state = 'QUEUED' and current_attempt_id is not null)""")
    out["task_rows_consistent"] = _check(r["n"] == 0, tasks=r["n"])
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
