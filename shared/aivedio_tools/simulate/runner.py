"""Runs a scenario: one scratch database is prepared (tenants, platform pools, and the backlog that
is queued at t=0, admitted through admit()), then each policy runs on its own copy of it (CREATE
DATABASE ... TEMPLATE), so DRR and FIFO start from the same rows. Redis, when given, is used under a
unique key prefix per run and emptied afterwards. Every scratch database is dropped at the end."""
from __future__ import annotations

import logging
import multiprocessing as mp
import time
import uuid
from contextlib import contextmanager
from typing import Iterator
from urllib.parse import urlsplit

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from aivedio.admin.tenants import POLICY_DEFAULTS, create_tenant, initial_burst_credit
from aivedio.bootstrap import apply_config
from aivedio.config import Settings
from aivedio.context import build_platform
from aivedio.db.migrate import migrate
from aivedio.observability import logger
from aivedio_tools.bench.pgbench import with_database
from aivedio_tools.simulate import checks, metrics
from aivedio_tools.simulate.engine import T0, SimClock, SimTenant, Simulation, admit_arrival
from aivedio_tools.simulate.scenarios import OPEN_LIMITS, Scenario, build

log = logging.getLogger("aivedio_tools.simulate")


@contextmanager
def scratch_database(admin_url: str, label: str, template: str | None = None) -> Iterator[str]:
    """A database of its own on admin_url's server; migrated, or cloned from `template`. Commits
    need not wait for the disk (synchronous_commit off): the data is thrown away afterwards."""
    name = f"aivedio_sim_{label}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url, autocommit=True) as c:
        if template:
            c.execute(sql.SQL("create database {} template {}").format(sql.Identifier(name), sql.Identifier(template)))
        else:
            c.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
        c.execute(sql.SQL("alter database {} set synchronous_commit = off").format(sql.Identifier(name)))
    url = with_database(admin_url, name)
    try:
        if not template:
            migrate(url)
        yield url
    finally:
        with psycopg.connect(admin_url, autocommit=True) as c:
            c.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


def _db_name(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


def _platform(db_url: str, redis_url: str | None, scenario: Scenario, prefix: str, pool_size: int = 4):
    settings = Settings(database_url=db_url, redis_url=redis_url or "none", redis_prefix=prefix)
    return build_platform(settings, scenario.config, clock=SimClock(T0, scenario.config.time_scale), pool_size=pool_size)


def _close(platform) -> None:
    if platform.cache is not None:
        try:
            platform.cache.delete_prefix()
        except Exception as e:  # best effort: the prefix is unique to this run anyway
            log.warning("could not empty redis prefix %s: %s", platform.settings.redis_prefix, e)
    platform.close()


# -- preparing the shared starting point ---------------------------------------------------------------

def prepare(db_url: str, redis_url: str | None, scenario: Scenario) -> dict:
    """Tenants, pools and the t=0 backlog. Returns what the runs need to know about the tenants.
    The pools (every lane's units, every provider account's max_concurrency) and the price book come
    from the scenario's config through `apply_config`, as a deployment derives them."""
    t0 = time.monotonic()
    p = _platform(db_url, redis_url, scenario, f"simprep{uuid.uuid4().hex[:8]}", pool_size=6)
    try:
        tenants: dict[str, SimTenant] = {}
        for spec in scenario.tenants:
            c = create_tenant(p, name=spec.name, service_class=spec.service_class, weight=spec.weight, credits=10**12,
                              operator="simulate", policy_overrides=OPEN_LIMITS, trusted=True)
            tenants[spec.name] = SimTenant(c.tenant_id, c.user_id, spec.name, spec.group, spec.weight, spec.service_class)
        backlog = [a for a in scenario.arrivals if a.at <= 0]
        # The price version opens at the first admission's time (the backlog is admitted just before t=0).
        p.clock.set(min([0.0] + [a.at for a in backlog]))
        with p.db.connection() as conn:
            apply_config(conn, scenario.config, p.clock)
        outcomes = _admit_backlog(p, tenants, backlog)
        admitted = sum(n for k, n in outcomes.items() if k.startswith("ACCEPTED"))
        rejected = {k: n for k, n in outcomes.items() if not k.startswith("ACCEPTED")}
        admit_seconds = time.monotonic() - t0
        bulk_seconds = 0.0
        bulk: dict[str, SimTenant] = {}
        if scenario.bulk is not None:
            b0 = time.monotonic()
            bulk = _bulk(p, scenario)
            tenants.update(bulk)
            bulk_seconds = time.monotonic() - b0
        with p.db.connection() as conn:
            conn.execute("vacuum analyze generation_task")
            conn.execute("analyze")
    finally:
        _close(p)
    totals: dict[str, int] = {}
    by_name = {t.tenant_id: t for t in tenants.values()}
    for a in scenario.arrivals:
        g = tenants[a.tenant].group
        totals[g] = totals.get(g, 0) + 1
    for t in bulk.values():
        totals[t.group] = totals.get(t.group, 0) + scenario.bulk.tasks_per_tenant
    return {"tenants": tenants, "by_id": by_name, "group_totals": totals,
            "prefill": {"admitted_before_start": admitted, "rejected_before_start": rejected,
                        "admit_wall_seconds": round(admit_seconds, 2), "bulk_sql_wall_seconds": round(bulk_seconds, 2),
                        "admits_per_second": round(admitted / admit_seconds, 1) if admit_seconds and admitted else None}}


def _admit_backlog(p, tenants: dict[str, SimTenant], arrivals: list) -> dict[str, int]:
    """Admit the backlog queued before t=0 through admit(), one by one at its own time."""
    outcomes: dict[str, int] = {}
    for a in arrivals:
        p.clock.set(a.at)
        outcome, _ = admit_arrival(p, tenants[a.tenant], a, None)  # the run rebuilds the ring
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


def _bulk(p, scenario: Scenario) -> dict[str, SimTenant]:
    """Tenants, policies, users and one queued task each, written set-based. Each task copies the
    normalised columns of a task that admit() wrote, so it is what admission would have produced."""
    b = scenario.bulk
    names = [f"bulk-{i:05d}" for i in range(b.tenants)]
    weights = [b.weight_of(i) for i in range(b.tenants)]
    groups = {n: b.group_of(i) for i, n in enumerate(names)}
    policy = {**POLICY_DEFAULTS["PAID_SHARED"], **OPEN_LIMITS, "burst_rounds": 4}
    template = p.db.fetchone("select * from generation_task order by enqueue_at, task_id limit 1")
    if template is None:
        raise RuntimeError("bulk tasks copy an admitted task; the scenario admits none before t=0")

    def tx(conn) -> list[dict]:
        now = p.clock.now()
        rows = conn.execute(
            """insert into tenant (name, service_class) select n, 'PAID_SHARED' from unnest(%s::text[]) as n
               returning tenant_id, name""", (names,)).fetchall()
        ids = {r["name"]: r["tenant_id"] for r in rows}
        cols = ["tenant_id", "service_class", "weight", "policy_version", "updated_at", "initial_burst_credit", *policy]
        conn.execute(
            f"""insert into tenant_scheduling_policy ({', '.join(cols)})
                select t.tenant_id, 'PAID_SHARED', w.weight, 1, %s, {initial_burst_credit(p.config, 1)} * w.weight, {', '.join(['%s'] * len(policy))}
                  from unnest(%s::text[], %s::int[]) as w(name, weight) join tenant t on t.name = w.name""",
            (now, *policy.values(), names, weights))
        users = conn.execute(
            """insert into app_user (tenant_id, name, role)
               select t.tenant_id, t.name || '-owner', 'OWNER' from tenant t where t.name = any(%s)
               returning tenant_id, user_id""", (names,)).fetchall()
        conn.execute("select setseed(0.4242)")
        task_cols = ["queue_class", "priority_band", "base_priority_band", "resource_class", "model_code", "fairness_units",
                     "provider_slot_units", "estimated_cost_units", "policy_version", "estimate_version", "mode", "prompt",
                     "duration_seconds", "resolution", "with_audio", "interactive", "inputs", "normalized_params", "gpu_units",
                     "media_units", "admission_decision"]
        for k in range(b.tasks_per_tenant):
            conn.execute(
                f"""insert into generation_task (task_id, tenant_id, user_id, state, enqueue_at, next_eligible_at, created_at,
                                                 updated_at, idempotency_key, {', '.join(task_cols)})
                    select gen_random_uuid(), u.tenant_id, u.user_id, 'QUEUED', e.at, e.at, e.at, e.at,
                           'bulk-' || u.tenant_id::text || '-' || %s, {', '.join('tpl.' + c for c in task_cols)}
                      from unnest(%s::uuid[], %s::uuid[]) as u(tenant_id, user_id)
                     cross join lateral (select %s::timestamptz - make_interval(secs => %s * random()) as at) e
                     cross join (select * from generation_task where task_id = %s) tpl""",
                (k, [u["tenant_id"] for u in users], [u["user_id"] for u in users], now, b.spread_seconds, template["task_id"]))
        return [{"name": n, "tenant_id": ids[n]} for n in names]

    created = p.db.transaction(tx)
    users = {r["tenant_id"]: r["user_id"] for r in p.db.fetchall(
        "select tenant_id, user_id from app_user where tenant_id in (select tenant_id from tenant where name like 'bulk-%%')")}
    return {r["name"]: SimTenant(r["tenant_id"], users[r["tenant_id"]], r["name"], groups[r["name"]],
                                 weights[i], "PAID_SHARED") for i, r in enumerate(created)}


# -- one policy -------------------------------------------------------------------------------------------

def run_policy(db_url: str, redis_url: str | None, scenario: Scenario, policy: str, prep: dict) -> dict:
    p = _platform(db_url, redis_url, scenario, f"sim{policy}{uuid.uuid4().hex[:8]}")
    try:
        sim = Simulation(p, scenario, policy, prep["tenants"], prep["group_totals"], seed=scenario.name)
        stats = sim.run()
        with psycopg.connect(db_url, row_factory=dict_row) as conn:
            data = checks.collect(conn, p.clock, stats)
            invariants = checks.database_invariants(conn)
    finally:
        _close(p)
    result = metrics.analyse(scenario, prep, data, stats)
    result["invariants"] = {**invariants, **result.pop("sweep_invariants")}
    result["invariants_ok"] = all(v["ok"] for v in result["invariants"].values())
    result["run"] = stats.as_dict()
    return result


def _run_policy_in_process(args: tuple) -> dict:
    db_url, redis_url, name, params, policy, prep = args
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    _quiet_platform_logs()
    return run_policy(db_url, redis_url, build(name, **params), policy, prep)


def _quiet_platform_logs() -> None:
    """Admission logs every task and the starvation detector every intervention; a simulation makes
    thousands of both, so only errors of the platform's own logger reach stderr. The simulation's
    own progress goes to the `aivedio_tools.simulate` logger."""
    logger.setLevel("ERROR")


# -- a scenario -------------------------------------------------------------------------------------------

def run_scenario(name: str, *, admin_url: str, redis_url: str | None = None, policies: tuple[str, ...] | None = None,
                 params: dict | None = None, parallel: bool = True, quiet: bool = True) -> dict:
    """Run `name` under each policy (by default the scenario's: both, unless it says otherwise) and
    return the report (one JSON-able dict)."""
    params = params or {}
    scenario = build(name, **params)
    policies = tuple(policies or scenario.policies)
    if quiet:
        _quiet_platform_logs()
    started = time.monotonic()
    log.info("scenario %s: preparing", name)
    runs: dict[str, dict] = {}
    with scratch_database(admin_url, "prep") as prep_url:
        prep = prepare(prep_url, redis_url, scenario)
        log.info("scenario %s: prepared in %.1fs (%s)", name, time.monotonic() - started, prep["prefill"])
        template = _db_name(prep_url)
        with _clones(admin_url, template, policies) as urls:
            if parallel and len(policies) > 1:
                ctx = mp.get_context("spawn")
                with ctx.Pool(len(policies)) as pool:
                    outs = pool.map(_run_policy_in_process,
                                    [(urls[pol], redis_url, name, params, pol, prep) for pol in policies])
                runs = dict(zip(policies, outs))
            else:
                for pol in policies:
                    runs[pol] = run_policy(urls[pol], redis_url, scenario, pol, prep)
    report = metrics.report(scenario, prep, runs)
    report["wall_seconds"] = round(time.monotonic() - started, 2)
    return report


@contextmanager
def _clones(admin_url: str, template: str, policies: tuple[str, ...]):
    stack = []
    urls = {}
    try:
        for pol in policies:
            cm = scratch_database(admin_url, pol, template=template)
            urls[pol] = cm.__enter__()
            stack.append(cm)
        yield urls
    finally:
        for cm in reversed(stack):
            cm.__exit__(None, None, None)
