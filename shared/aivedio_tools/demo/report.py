"""The demo's report: one document (JSON-able) built from PostgreSQL, the simulators' ground truth and
the progress samples; printed as text and written as ONE self-contained HTML file with inline SVG
plots. matplotlib (the `demo` extra) is imported only by the plotting code here; without it the
page has its tables and verdicts and says that the plots need `pip install -e '.[demo]'`.

VERDICTS, each an invariant with its figure; any that fails makes `aivedio demo` exit 1:
- ledger_balanced: no ledger transaction whose entries do not sum to zero;
- snapshots_equal_ledger: the wallet check (aivedio.invariants.wallet_findings, read-only) finds
  every wallet's snapshot equal to its ledger, its reservations and its lots;
- no_capacity_exceeded: no simulated provider account ran more jobs at once than the platform's
  max_concurrency for it (the simulators are given 10x, so an overshoot shows in their own peak);
- no_duplicate_generation: no task had two jobs delivered by providers, and every duplicate submit
  was answered with the first submit's task;
- every_task_terminal: every admitted task ended SUCCEEDED, FAILED, CANCELLED or MEDIA_INGEST_FAILED;
- nothing_left_reserved: no terminal task holds an ACTIVE capacity reservation or an open part of a
  credit reservation."""
from __future__ import annotations

import html as _html
import io
from collections import Counter, defaultdict
from datetime import datetime, timedelta, timezone
from typing import Any

from aivedio import invariants, tasks
from aivedio.spend.costs import cost_report
from aivedio.spend.invoices import reconcile_day

# What the verdicts' figures say beside each invariant's count (aivedio.invariants decides each verdict).
LEDGER_TXNS = "select count(*)::int as n from ledger_transaction"
NOT_TERMINAL_BY_STATE = """select state, count(*)::int as n from generation_task
                            where (%(tasks)s::uuid[] is null or task_id = any(%(tasks)s::uuid[])) and state <> all(%(terminal)s)
                            group by state"""
OPEN_CREDIT_ON_TERMINAL = """select coalesce(sum(c.reserved_amount - c.settled_amount - c.released_amount), 0)::bigint as amount
                              from credit_reservation c join generation_task t using (task_id)
                             where t.state = any(%(terminal)s) and c.reserved_amount - c.settled_amount - c.released_amount > 0
                               and (%(tasks)s::uuid[] is null or t.task_id = any(%(tasks)s::uuid[]))"""
RUN_TASKS = """
select t.task_id::text as task_id, t.tenant_id::text as tenant_id, t.queue_class as lane, t.fairness_units, t.state,
       t.resolution, t.created_at, t.updated_at, t.selected_provider,
       (select min(a.created_at) from task_attempt a where a.task_id = t.task_id) as claimed_at,
       (select count(*) from task_attempt a where a.task_id = t.task_id)::int as attempts
  from generation_task t where t.tenant_id = any(%s::uuid[])
"""
RUN_MEDIA_JOBS = """select tenant_id::text as tenant_id, task_id::text as task_id, resource_class, slot_units, created_at, started_at,
                           finished_at from media_job where tenant_id = any(%s::uuid[]) and output_version = 1"""
WALLETS = """select w.tenant_id::text as tenant_id, w.available_amount, w.reserved_amount, w.consumed_amount, w.frozen,
                    (select coalesce(sum(-e.amount_delta), 0) from ledger_entry e join ledger_transaction x using (ledger_txn_id)
                      where x.wallet_id = w.wallet_id and x.event_type = 'GRANT' and e.bucket = 'ISSUED')::bigint as granted
               from wallet_account w where w.tenant_id = any(%s::uuid[])"""
TXN_TYPES = """select event_type, count(*)::int as n from ledger_transaction where tenant_id = any(%s::uuid[])
                group by 1 order by 1"""


# --- shares ----------------------------------------------------------------------------------------------------

def contended_shares(items: list[dict], weights: dict[str, int]) -> dict[str, Any]:
    """The shares that weights promise, where they can be seen: every claim made while at least two
    tenants had work waiting is divided, by weight, among the tenants waiting at that moment (their
    entitlement), and set beside what each was actually given. Cumulative shares also count the
    stretches where a tenant had nothing waiting, so they follow what was submitted. Each item is
    one piece of queued work: {id, tenant, units, queued_at, claimed_at (None: never), left_at (left
    the queue: claimed, cancelled, ended; None: still there)}."""
    queued: dict[str, list[tuple]] = {n: [] for n in weights}
    for it in items:
        queued[it["tenant"]].append((it["queued_at"], it["left_at"], it["id"]))
    delivered: Counter = Counter()
    entitled: dict[str, float] = {n: 0.0 for n in weights}
    for it in items:
        at = it["claimed_at"]
        if at is None:
            continue
        waiting = [n for n in weights if n == it["tenant"]
                   or any(q <= at and (left is None or left > at) and i != it["id"] for q, left, i in queued[n])]
        if len(waiting) < 2:
            continue
        total_w = sum(weights[n] for n in waiting)
        for n in waiting:
            entitled[n] += int(it["units"]) * weights[n] / total_w
        delivered[it["tenant"]] += int(it["units"])
    total = sum(delivered.values())
    if not total:
        return {"claims_units": 0, "delivered": None, "entitled": None, "error": None}
    d = {n: round(delivered[n] / total, 4) for n in weights}
    e = {n: round(entitled[n] / total, 4) for n in weights}
    return {"claims_units": total, "delivered": d, "entitled": e, "error": round(max(abs(d[n] - e[n]) for n in weights), 4)}


def _contended_text(c: dict) -> str:
    if not c["delivered"]:
        return ""
    return (f"; while contended ({c['claims_units']} units, error {c['error']:.2f}), given vs entitled: "
            + ", ".join(f"{n} {c['delivered'][n]:.2f} vs {c['entitled'][n]:.2f}" for n in c["delivered"]))


def task_queue_items(lane_tasks: list[dict], name_of) -> list[dict]:
    """A lane's tasks as queued work: queued from admission until claimed (or cancelled while queued)."""
    return [{"id": t["task_id"], "tenant": name_of(t), "units": t["fairness_units"], "queued_at": t["created_at"],
             "claimed_at": t["claimed_at"],
             "left_at": t["claimed_at"] or (t["updated_at"] if t["state"] in tasks.TERMINAL else None)} for t in lane_tasks]


def media_queue_items(jobs: list[dict], name_of) -> list[dict]:
    """A media class's jobs as queued work: pending from the provider's success until a worker slot
    was claimed (a job never claimed left the queue when it ended)."""
    return [{"id": j["task_id"], "tenant": name_of(j), "units": j["slot_units"], "queued_at": j["created_at"],
             "claimed_at": j["started_at"], "left_at": j["started_at"] or j["finished_at"]} for j in jobs]


# --- verdicts --------------------------------------------------------------------------------------------------


def _verdict(name: str, ok: bool, figure: str, **detail: Any) -> dict:
    return {"name": name, "ok": bool(ok), "figure": figure, **({"detail": detail} if detail else {})}


def database_verdicts(platform, task_ids: list[str] | None) -> list[dict]:
    """The verdicts PostgreSQL alone decides (aivedio.invariants): over `task_ids` (None: every task
    in the database)."""
    q = {"tasks": task_ids, "terminal": invariants.TERMINAL_STATES}
    with platform.db.connection() as conn:
        unbalanced = invariants.broken(conn, invariants.LEDGER_BALANCED)
        txns = conn.execute(LEDGER_TXNS).fetchone()["n"]
        wallet_ids = [r["wallet_id"] for r in conn.execute("select wallet_id from wallet_account order by wallet_id").fetchall()]
        not_terminal = invariants.broken(conn, invariants.EVERY_TASK_TERMINAL, task_ids)
        by_state = {r["state"]: r["n"] for r in conn.execute(NOT_TERMINAL_BY_STATE, q).fetchall()}
        active = invariants.broken(conn, invariants.NOTHING_HELD_BY_TERMINAL_TASKS, task_ids)
        open_credit = invariants.broken(conn, invariants.NO_OPEN_CREDIT_ON_TERMINAL_TASKS, task_ids)
        credit_amount = conn.execute(OPEN_CREDIT_ON_TERMINAL, q).fetchone()["amount"]
    mismatched = []
    for wid in wallet_ids:  # read-only: a demo never freezes a wallet; the scheduled check does that
        def check(conn, wid=wid):
            w = conn.execute("select * from wallet_account where wallet_id = %s", (wid,)).fetchone()
            return invariants.wallet_findings(conn, w)

        found = platform.db.transaction(check)
        if found:
            mismatched.append({"wallet_id": str(wid), "findings": found})
    n_tasks = len(task_ids) if task_ids is not None else None
    return [
        _verdict("ledger_balanced", unbalanced == 0, f"{unbalanced} of {txns} ledger transactions unbalanced"),
        _verdict("snapshots_equal_ledger", not mismatched, f"{len(mismatched)} of {len(wallet_ids)} wallets differ from their ledger",
                 **({"wallets": mismatched[:5]} if mismatched else {})),
        _verdict("every_task_terminal", not_terminal == 0,
                 f"{not_terminal} of {n_tasks if n_tasks is not None else 'all'} tasks not terminal"
                 + (f" ({', '.join(f'{k} {v}' for k, v in sorted(by_state.items()))})" if by_state else "")),
        _verdict("nothing_left_reserved", active == 0 and open_credit == 0,
                 f"{active} capacity reservations ACTIVE and {open_credit} credit reservations open "
                 f"({credit_amount} credits) on terminal tasks"),
    ]


def provider_verdicts(platform, truths: dict[str, dict], workload) -> list[dict]:
    limits = {(p.name, a.account_id): a.max_concurrency for p in platform.config.providers for a in p.accounts}
    over = [f"{name}/{acct} ran {v['peak']} at once (limit {limits.get((name, acct))})"
            for name, t in truths.items() for acct, v in t["accounts"].items() if v["peak"] > limits.get((name, acct), 0)]
    peaks = ", ".join(f"{name}/{acct} {v['peak']}/{limits.get((name, acct))}"
                      for name, t in truths.items() for acct, v in t["accounts"].items())
    delivered: Counter = Counter()
    jobs: Counter = Counter()
    for t in truths.values():
        for j in t["jobs"]:
            jobs[j["client_request_id"]] += 1
            if j["status"] == "succeeded":
                delivered[j["client_request_id"]] += 1
    twice = [tid for tid, n in delivered.items() if n > 1]
    extra_jobs = sum(n - 1 for n in jobs.values() if n > 1)
    dup_ok = workload.duplicates_same_task == workload.duplicates
    return [
        _verdict("no_capacity_exceeded", not over, f"peak jobs at once per account (platform limit): {peaks}",
                 **({"exceeded": over} if over else {})),
        _verdict("no_duplicate_generation", not twice and dup_ok,
                 f"{len(twice)} tasks delivered twice; {extra_jobs} extra provider jobs (contained: cancelled or failed); "
                 f"{workload.duplicates_same_task} of {workload.duplicates} duplicate submits answered with the first task",
                 **({"tasks": twice[:10]} if twice else {})),
    ]


# --- the document ----------------------------------------------------------------------------------------------

def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(q * len(v)))], 1)


def build(platform, sims: dict, workload, tenants: list, sampler, *, run_id: str, elapsed_seconds: float) -> dict:
    scale = platform.clock.time_scale
    ids = [t.tenant_id for t in tenants]
    by_id = {t.tenant_id: t for t in tenants}

    by_key = {t.spec.key: t for t in tenants}

    def name_of(row: dict) -> str:
        return by_id[row["tenant_id"]].spec.key

    with platform.db.connection() as conn:
        tasks = [dict(r) for r in conn.execute(RUN_TASKS, (ids,)).fetchall()]
        media_jobs = [dict(r) for r in conn.execute(RUN_MEDIA_JOBS, (ids,)).fetchall()]
        wallets = {r["tenant_id"]: dict(r) for r in conn.execute(WALLETS, (ids,)).fetchall()}
        txn_types = {r["event_type"]: r["n"] for r in conn.execute(TXN_TYPES, (ids,)).fetchall()}
    start = min((t["created_at"] for t in tasks), default=platform.clock.now()) - timedelta(seconds=1)
    end = platform.clock.now() + timedelta(seconds=1)
    truths = {n: s.truth for n, s in sims.items()}

    # per tenant: states, waits (platform seconds from admission to the first claim), delivered units
    per_tenant: dict[str, dict[str, Any]] = {}
    waits: dict[str, list[float]] = defaultdict(list)
    for t in tasks:
        name = by_id[t["tenant_id"]].spec.key
        d = per_tenant.setdefault(name, {"tasks": 0, "states": Counter(), "claimed_units": 0, "lanes": Counter()})
        d["tasks"] += 1
        d["states"][t["state"]] += 1
        d["lanes"][t["lane"]] += 1
        if t["claimed_at"] is not None:
            d["claimed_units"] += int(t["fairness_units"])
            waits[f"{name}|{t['lane']}"].append((t["claimed_at"] - t["created_at"]).total_seconds() * scale)
    tenants_doc = []
    for spec_t in tenants:
        d = per_tenant.get(spec_t.spec.key, {"tasks": 0, "states": Counter(), "claimed_units": 0, "lanes": Counter()})
        w = [x for k, v in waits.items() if k.startswith(spec_t.spec.key + "|") for x in v]
        wal = wallets.get(spec_t.tenant_id, {})
        tenants_doc.append({"tenant": spec_t.spec.key, "name": spec_t.name, "tenant_id": spec_t.tenant_id,
                            "service_class": spec_t.spec.service_class, "weight": spec_t.spec.weight,
                            "users": len(spec_t.keys), "admitted": d["tasks"], "states": dict(d["states"]),
                            "lanes": dict(d["lanes"]), "claimed_units": d["claimed_units"],
                            "wait_p50": _pct(w, 0.5), "wait_p95": _pct(w, 0.95), "wait_max": _pct(w, 1.0),
                            "wallet": {k: int(wal[k]) for k in ("granted", "available_amount", "reserved_amount", "consumed_amount")}
                            if wal else {}})

    # shares over time, per lane: cumulative claimed units of each tenant against its weight share
    shares: dict[str, dict[str, Any]] = {}
    claims = sorted((t for t in tasks if t["claimed_at"] is not None), key=lambda t: t["claimed_at"])
    for lane in sorted({t["lane"] for t in claims}):
        lane_claims = [t for t in claims if t["lane"] == lane]
        names = sorted({by_id[t["tenant_id"]].spec.key for t in lane_claims})
        if len(names) < 2:
            continue
        weights = {n: by_key[n].spec.weight for n in names}
        t0 = (lane_claims[0]["claimed_at"] - start).total_seconds()
        cum: Counter = Counter()
        series: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
        for t in lane_claims:
            cum[by_id[t["tenant_id"]].spec.key] += int(t["fairness_units"])
            total = sum(cum.values())
            x = (t["claimed_at"] - start).total_seconds() * scale / 60
            for n in names:
                series[n].append((round(x, 2), round(cum[n] / total, 4)))
        shares[lane] = {"weights": weights, "weight_share": {n: round(w / sum(weights.values()), 4) for n, w in weights.items()},
                        "final_share": {n: round(cum[n] / sum(cum.values()), 4) for n in names}, "series": series,
                        "from_minute": round(t0 * scale / 60, 2),
                        "contended": contended_shares(task_queue_items([t for t in tasks if t["lane"] == lane], name_of), weights)}
    # The media slots, per class: where the demo's work waits longest on 2 cores, claimed by weight.
    media_shares: dict[str, dict[str, Any]] = {}
    for media_class in sorted({j["resource_class"] for j in media_jobs}):
        jobs = [j for j in media_jobs if j["resource_class"] == media_class]
        names = sorted({name_of(j) for j in jobs})
        if len(names) < 2:
            continue
        weights = {n: by_key[n].spec.weight for n in names}
        media_shares[media_class] = {"weights": weights, "contended": contended_shares(media_queue_items(jobs, name_of), weights)}

    costs = {}
    with platform.db.connection() as conn:
        for p in platform.config.providers:
            usd = cost_report(conn, start=start, end=end, provider=p.name)["currencies"].get("USD", {})
            costs[p.name] = {k: usd.get(k) for k in ("provider_cost", "cost_per_successful_video", "duplicate_generation_cost_rate",
                                                     "failed_cost", "duplicate_cost")}
            costs[p.name]["successful_videos"] = sum(
                1 for t in tasks if t["state"] == "SUCCEEDED" and t["selected_provider"] == p.name)
            costs[p.name]["price_per_second"] = p.cost_per_second
        overall = cost_report(conn, start=start, end=end)
    invoices = _invoices(platform)
    unknown = sampler.samples[-1]["submit_unknown"] if sampler.samples else {}
    verdicts = database_verdicts(platform, [t["task_id"] for t in tasks]) + provider_verdicts(platform, truths, workload)
    return {
        "run_id": run_id, "time_scale": scale, "elapsed_real_seconds": round(elapsed_seconds, 1),
        "elapsed_platform_minutes": round(elapsed_seconds * scale / 60, 1),
        "sent": workload.sent, "admitted": len(tasks), "duplicates": workload.duplicates, "cancels": dict(workload.cancels),
        "rejections": dict(workload.rejections), "decisions": dict(workload.decisions),
        "states": dict(Counter(t["state"] for t in tasks)),
        "tenants": tenants_doc,
        "waits": {k: {"n": len(v), "p50": _pct(v, 0.5), "p95": _pct(v, 0.95), "max": _pct(v, 1.0), "values": [round(x, 1) for x in v]}
                  for k, v in sorted(waits.items())},
        "shares": shares,
        "media_shares": media_shares,
        "lanes": _lane_series(sampler.samples, scale),
        "providers": {n: {"submits": t["submits"], "webhooks": t["webhooks"],
                          "jobs": len(t["jobs"]), "job_status": dict(Counter(j["status"] for j in t["jobs"])),
                          "output_faults": dict(Counter(j["output_fault"] for j in t["jobs"] if j["output_fault"])),
                          "accounts": t["accounts"], **costs[n]} for n, t in truths.items()},
        "costs": {"overall": overall["currencies"].get("USD", {}), "successful_videos": overall["successful_videos"]},
        "submit_unknown": unknown,
        "ledger": {"transactions_by_type": txn_types,
                   "granted": sum(t["wallet"].get("granted", 0) for t in tenants_doc),
                   "consumed": sum(t["wallet"].get("consumed_amount", 0) for t in tenants_doc),
                   "available": sum(t["wallet"].get("available_amount", 0) for t in tenants_doc),
                   "reserved": sum(t["wallet"].get("reserved_amount", 0) for t in tenants_doc)},
        "invoices": invoices,
        "verdicts": verdicts,
        "verdicts_passed": all(v["ok"] for v in verdicts),
    }


def _lane_series(samples: list[dict], scale: float) -> dict[str, dict[str, list]]:
    out: dict[str, dict[str, list]] = {}
    for s in samples:
        x = round(s["t"] * scale / 60, 2)
        for lane in s["lanes"]:
            d = out.setdefault(lane["lane"], {"minute": [], "utilisation_percent": [], "borrowed_units": [], "lent_units": [],
                                              "queued_units": [], "capacity_units": lane["capacity_units"]})
            d["minute"].append(x)
            d["utilisation_percent"].append(lane["utilisation_percent"])
            d["borrowed_units"].append(lane["borrowed_units"])
            d["lent_units"].append(lane["lent_units"])
            d["queued_units"].append(lane["queued_units"])
    for lane, d in out.items():
        d["peak_utilisation_percent"] = max(d["utilisation_percent"], default=0)
        d["peak_borrowed_units"] = max(d["borrowed_units"], default=0)
    return {k: v for k, v in out.items() if v["peak_utilisation_percent"] or max(v["queued_units"], default=0)}


def _invoices(platform) -> dict[str, Any]:
    """Today's invoice reconciliation per provider (the daily job reconciles closed days; the demo runs
    today's so the page shows it). Its status is reported as it is: a day still open is INCOMPLETE."""
    today = datetime.now(timezone.utc).date()
    out = {}
    for p in platform.config.providers:
        try:
            r = reconcile_day(platform, p.name, today)
            d = r.document
            out[p.name] = {"day": today.isoformat(), "status": d.get("status"), "new_items": d.get("new_items"),
                           "open_items": d.get("open_items"), "figures": d.get("figures"),
                           "incomplete": [x.get("code") for x in d.get("incomplete_reasons") or []]}
        except Exception as e:  # noqa: BLE001 - the page says why there is none
            out[p.name] = {"day": today.isoformat(), "status": "NOT_RUN", "error": f"{type(e).__name__}: {e}"[:300]}
    return out


# --- text -----------------------------------------------------------------------------------------------------------

def text(doc: dict) -> str:
    lines = [f"AiVedio demo report (run {doc['run_id']}): {doc['elapsed_real_seconds']:g}s real = "
             f"{doc['elapsed_platform_minutes']:g} platform minutes at time_scale {doc['time_scale']:g}",
             f"  submissions {doc['sent']}, admitted {doc['admitted']}, duplicate submits {doc['duplicates']}, "
             f"cancels {sum(doc['cancels'].values())}; rejected by code: "
             + (", ".join(f"{k} {v}" for k, v in sorted(doc["rejections"].items())) or "none"),
             "  states: " + ", ".join(f"{k} {v}" for k, v in sorted(doc["states"].items())),
             f"  {'tenant':<12} {'class':<20} {'weight':>6} {'admitted':>8} {'units':>6} {'wait p50':>9} {'p95':>7}  states"]
    for t in doc["tenants"]:
        lines.append(f"  {t['tenant']:<12} {t['service_class']:<20} {t['weight']:>6} {t['admitted']:>8} {t['claimed_units']:>6} "
                     f"{_s(t['wait_p50']):>9} {_s(t['wait_p95']):>7}  " + ", ".join(f"{k} {v}" for k, v in sorted(t["states"].items())))
    for lane, s in doc["shares"].items():
        lines.append(f"  {lane} shares (delivered vs weight): "
                     + ", ".join(f"{n} {s['final_share'][n]:.2f} vs {s['weight_share'][n]:.2f}" for n in s["final_share"])
                     + _contended_text(s["contended"]))
    for media_class, s in doc.get("media_shares", {}).items():
        lines.append(f"  media {media_class} slots" + (_contended_text(s["contended"]) or ": never contended"))
    lines.append(f"  {'provider':<10} {'price/s':>8} {'videos':>7} {'cost':>10} {'per video':>10} {'dup rate':>9}")
    for n, p in doc["providers"].items():
        lines.append(f"  {n:<10} {p['price_per_second']:>8} {p['successful_videos']:>7} {_s(p['provider_cost']):>10} "
                     f"{_s(p['cost_per_successful_video']):>10} {_s(p['duplicate_generation_cost_rate']):>9}")
    lines.append("  SUBMIT_UNKNOWN: " + (", ".join(f"{k} {v}" for k, v in sorted(doc["submit_unknown"].items())) or "none"))
    led = doc["ledger"]
    lines.append(f"  ledger: granted {led['granted']}, consumed {led['consumed']}, available {led['available']}, "
                 f"reserved {led['reserved']}; " + ", ".join(f"{k} {v}" for k, v in led["transactions_by_type"].items()))
    lines.append("  invoices today: " + ", ".join(f"{n} {i['status']}" for n, i in doc["invoices"].items()))
    lines.append("VERDICTS")
    for v in doc["verdicts"]:
        lines.append(f"  {'PASS' if v['ok'] else 'FAIL'}  {v['name']:<26} {v['figure']}")
    lines.append(f"report: {doc.get('report_path', '(not written)')}")
    return "\n".join(lines)


def _s(v: Any) -> str:
    return "-" if v is None else str(v)


# --- HTML -----------------------------------------------------------------------------------------------------------

_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{margin-bottom:0}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ddd;padding:.25em .6em;text-align:right}
th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}.pass{color:#0a7a2f;font-weight:bold}
.fail{color:#b00020;font-weight:bold}.muted{color:#777}figure{margin:.5em 0}svg{max-width:100%;height:auto}"""


def _e(v: Any) -> str:
    return _html.escape("-" if v is None else str(v))


def _table(head: list[str], rows: list[list[Any]]) -> str:
    return ("<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{c if isinstance(c, _Raw) else _e(c)}</td>" for c in r) + "</tr>" for r in rows)
            + "</table>")


class _Raw(str):
    pass


def html(doc: dict) -> str:
    plots = _plots(doc)
    v_rows = [[v["name"], _Raw(f"<span class='{'pass' if v['ok'] else 'fail'}'>{'PASS' if v['ok'] else 'FAIL'}</span>"), v["figure"]]
              for v in doc["verdicts"]]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>AiVedio demo report {_e(doc['run_id'])}</title>"
             f"<style>{_CSS}</style></head><body>",
             f"<h1>AiVedio demo report</h1><p class='muted'>run {_e(doc['run_id'])}: {doc['elapsed_real_seconds']:g} s real = "
             f"{doc['elapsed_platform_minutes']:g} platform minutes at time_scale {doc['time_scale']:g}; {doc['sent']} submissions, "
             f"{doc['admitted']} admitted, {doc['duplicates']} duplicate submits, {sum(doc['cancels'].values())} cancels</p>",
             "<h2 id='verdicts'>Verdicts</h2>",
             f"<p class='{'pass' if doc['verdicts_passed'] else 'fail'}'>"
             f"{'Every invariant holds.' if doc['verdicts_passed'] else 'An invariant is violated: the demo exits 1.'}</p>",
             _table(["invariant", "verdict", "figure"], v_rows),
             "<h2 id='tenants'>Tenants</h2>",
             _table(["tenant", "class", "weight", "users", "admitted", "units claimed", "wait p50 (s)", "p95", "max", "states"],
                    [[t["tenant"], t["service_class"], t["weight"], t["users"], t["admitted"], t["claimed_units"], t["wait_p50"],
                      t["wait_p95"], t["wait_max"], ", ".join(f"{k} {v}" for k, v in sorted(t["states"].items()))]
                     for t in doc["tenants"]]),
             "<p>Rejected at admission, by code: " + _e(", ".join(f"{k} {v}" for k, v in sorted(doc["rejections"].items())) or "none")
             + ". SUBMIT_UNKNOWN, by how each resolved: "
             + _e(", ".join(f"{k} {v}" for k, v in sorted(doc["submit_unknown"].items())) or "none") + ".</p>",
             "<h2 id='shares'>Delivered share of cost units against weight</h2>",
             "<p>Per lane with more than one tenant: each tenant's cumulative share of the units claimed (solid) against its "
             "weight's share (dashed), over platform minutes.</p>",
             "<p>The last two columns count only the claims made while two or more of the lane's tenants had work "
             "waiting: each such claim is divided by weight among the tenants waiting at that moment (entitled), beside "
             "what each was given (given). Cumulative shares follow what was submitted when a tenant had nothing waiting.</p>",
             _table(["lane", "tenant", "weight", "weight share", "delivered share", "given while contended", "entitled"],
                    [[lane, n, s["weights"][n], s["weight_share"][n], s["final_share"][n],
                      *((s["contended"]["delivered"][n], s["contended"]["entitled"][n]) if s["contended"]["delivered"] else ("-", "-"))]
                     for lane, s in doc["shares"].items() for n in s["final_share"]]),
             plots.get("shares", ""),
             "<p>The media worker slots, per class, where finished provider work waits for a worker (media jobs are "
             "claimed in weighted fair order): the same reading, over the claims made while two or more tenants had media "
             "work of the class waiting.</p>",
             _table(["media class", "tenant", "weight", "given while contended", "entitled"],
                    [[c, n, s["weights"][n], *((s["contended"]["delivered"][n], s["contended"]["entitled"][n])
                                               if s["contended"]["delivered"] else ("-", "-"))]
                     for c, s in doc.get("media_shares", {}).items() for n in s["weights"]]),
             "<h2 id='waits'>Wait distributions per tenant and lane</h2>",
             "<p>Platform seconds from admission to the first claim.</p>",
             _table(["tenant | lane", "tasks", "p50", "p95", "max"],
                    [[k, w["n"], w["p50"], w["p95"], w["max"]] for k, w in doc["waits"].items()]),
             plots.get("waits", ""),
             "<h2 id='lanes'>Lane utilisation and borrowing</h2>",
             _table(["lane", "capacity units", "peak utilisation %", "peak borrowed units"],
                    [[lane, d["capacity_units"], d["peak_utilisation_percent"], d["peak_borrowed_units"]]
                     for lane, d in doc["lanes"].items()]),
             plots.get("lanes", ""),
             "<h2 id='costs'>Cost per successful video, per provider</h2>",
             _table(["provider", "price / s", "jobs", "successful videos", "provider cost (USD)", "per successful video",
                     "duplicate-generation cost rate", "429s", "accept-then-timeout", "webhooks dropped", "output faults"],
                    [[n, p["price_per_second"], p["jobs"], p["successful_videos"], p["provider_cost"], p["cost_per_successful_video"],
                      p["duplicate_generation_cost_rate"], p["submits"].get("rate_limited", 0), p["submits"].get("accept_then_timeout", 0),
                      p["webhooks"].get("dropped", 0), ", ".join(f"{k} {v}" for k, v in sorted(p["output_faults"].items())) or "none"]
                     for n, p in doc["providers"].items()]),
             f"<p>All providers: {_e(doc['costs']['overall'].get('provider_cost'))} USD for {doc['costs']['successful_videos']} "
             f"successful videos ({_e(doc['costs']['overall'].get('cost_per_successful_video'))} each); duplicate-generation cost "
             f"rate {_e(doc['costs']['overall'].get('duplicate_generation_cost_rate'))}.</p>",
             plots.get("costs", ""),
             "<h2 id='ledger'>Ledger summary</h2>",
             _table(["tenant", "granted", "consumed", "available", "reserved"],
                    [[t["tenant"], t["wallet"].get("granted"), t["wallet"].get("consumed_amount"), t["wallet"].get("available_amount"),
                      t["wallet"].get("reserved_amount")] for t in doc["tenants"]]
                    + [["all demo tenants", doc["ledger"]["granted"], doc["ledger"]["consumed"], doc["ledger"]["available"],
                        doc["ledger"]["reserved"]]]),
             _table(["ledger transactions", "count"], [[k, v] for k, v in doc["ledger"]["transactions_by_type"].items()]),
             "<h2 id='invoices'>Invoice reconciliation (today)</h2>",
             _table(["provider", "day", "status", "new items", "open items", "incomplete because"],
                    [[n, i.get("day"), i.get("status"), i.get("new_items"), i.get("open_items"),
                      ", ".join(i.get("incomplete") or []) or i.get("error", "")] for n, i in doc["invoices"].items()]),
             plots.get("note", ""),
             "</body></html>"]
    return "\n".join(parts)


def _plots(doc: dict) -> dict[str, str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {"note": "<p class='muted'>The plots need matplotlib: <code>.venv/bin/pip install -e '.[demo]'</code>.</p>"}

    def svg(fig) -> str:
        buf = io.StringIO()
        fig.savefig(buf, format="svg", bbox_inches="tight")
        plt.close(fig)
        s = buf.getvalue()
        return "<figure>" + s[s.index("<svg"):] + "</figure>"

    out = {}
    if doc["shares"]:
        n = len(doc["shares"])
        fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 3.4), squeeze=False)
        for ax, (lane, s) in zip(axes[0], doc["shares"].items()):
            for i, (name, pts) in enumerate(sorted(s["series"].items())):
                color = f"C{i}"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, label=f"{name} (w{s['weights'][name]})")
                ax.axhline(s["weight_share"][name], color=color, linestyle="--", linewidth=1)
            ax.set_title(lane)
            ax.set_xlabel("platform minutes")
            ax.set_ylabel("share of units claimed")
            ax.set_ylim(0, 1)
            ax.legend(fontsize=7)
        out["shares"] = svg(fig)
    if doc["waits"]:
        keys = [k for k, w in doc["waits"].items() if w["values"]]
        fig, ax = plt.subplots(figsize=(10, 0.35 * len(keys) + 1.2))
        ax.boxplot([doc["waits"][k]["values"] for k in keys], vert=False, showfliers=True)
        ax.set_yticks(range(1, len(keys) + 1), [k.replace("|", " / ") for k in keys], fontsize=8)
        ax.set_xlabel("wait, platform seconds")
        out["waits"] = svg(fig)
    if doc["lanes"]:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.4))
        for lane, d in doc["lanes"].items():
            a1.plot(d["minute"], d["utilisation_percent"], label=lane)
            if max(d["borrowed_units"], default=0) or max(d["lent_units"], default=0):
                a2.plot(d["minute"], d["borrowed_units"], label=f"{lane} borrowed")
                a2.plot(d["minute"], d["lent_units"], linestyle="--", label=f"{lane} lent")
        a1.set_title("lane utilisation (% of capacity)")
        a1.set_xlabel("platform minutes")
        a1.legend(fontsize=7)
        a2.set_title("borrowing (units)")
        a2.set_xlabel("platform minutes")
        if a2.lines:
            a2.legend(fontsize=7)
        else:
            a2.text(0.5, 0.5, "no lane borrowed", ha="center", transform=a2.transAxes)
        out["lanes"] = svg(fig)
    provs = [(n, p) for n, p in doc["providers"].items()]
    if provs:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3))
        a1.bar([n for n, _ in provs], [float(p["cost_per_successful_video"] or 0) for _, p in provs], color="C0")
        a1.set_title("cost per successful video (USD)")
        a2.bar([n for n, _ in provs], [float(p["duplicate_generation_cost_rate"] or 0) for _, p in provs], color="C3")
        a2.set_title("duplicate-generation cost rate")
        out["costs"] = svg(fig)
    return out
