"""`aivedio simulate --scenario NAME [--json] [--policy drr|fifo|both]`: one JSON document on stdout
with --json (a short summary without it); progress logs on stderr. `--param
fresh_scheduler_per_tick=false` keeps one Scheduler for the whole run instead of a new one per tick
(the tick handler builds one per call, and `aivedio serve` calls it once a tick)."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from aivedio.config import settings_from_env
from aivedio.context import resolve_urls
from aivedio_tools.cli.common import emit
from aivedio_tools.local.embedded import with_embedded_servers
from aivedio_tools.simulate.runner import run_scenario
from aivedio_tools.simulate.scenarios import SCENARIOS


def _param(s: str) -> tuple[str, object]:
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {s!r}")
    k, v = s.split("=", 1)
    try:
        return k, json.loads(v)
    except json.JSONDecodeError:
        return k, v


def _simulate(args: argparse.Namespace) -> int:
    logging.getLogger("aivedio_tools.simulate").setLevel(logging.INFO)
    settings = settings_from_env()
    if args.redis == "none":
        settings = settings.model_copy(update={"redis_url": "none"})
    db_url, redis_url = resolve_urls(with_embedded_servers(settings))
    policies = None if args.policy is None else ("drr", "fifo") if args.policy == "both" else (args.policy,)
    doc = run_scenario(args.scenario, admin_url=db_url, redis_url=redis_url, policies=policies, params=dict(args.param or []),
                       parallel=not args.serial, quiet=not args.verbose)
    if args.json:
        emit(doc, True)
    else:
        _summary(doc)
    if args.check and not all(t["met"] for t in doc["targets"] if t["met"] is not None):
        return 1
    return 0


def _summary(doc: dict) -> None:
    w = sys.stdout.write
    w(f"{doc['scenario']}: {doc['description']}\n")
    for t in doc["targets"]:
        vals = {k: v for k, v in t.items() if k not in ("name", "target", "met")}
        w(f"  [{'ok' if t['met'] else 'MISSED' if t['met'] is False else '--'}] {t['name']}: {vals}  (target {t['target']})\n")
    w(f"  scheduler: {'a new Scheduler per tick' if doc['simulation']['fresh_scheduler_per_tick'] else 'one Scheduler for the run'}\n")
    for pol, r in doc["runs"].items():
        w(f"  {pol}: {r['run']['stop_reason']} at t={r['end_seconds']:.0f}s, utilisation of the binding capacity "
          f"{r['utilisation']['when_work_queued']}, interventions {r['interventions']}\n")
        for lane, ld in r["lanes"].items():
            w(f"    {lane}: fairness_error {ld['fairness_error']} jain {ld['jain_index']} "
              f"saturated {ld['saturated_windows']}/{ld['windows']} waits {ld['wait_seconds']}\n")
            _tenant_lines(w, ld, "      ")
            for pool, pd in r.get("pools", {}).get(lane, {}).items():
                if pd.get("same_as_lane"):
                    continue
                w(f"      pool {pool}: fairness_error {pd['fairness_error']} jain {pd['jain_index']} "
                  f"saturated {pd['saturated_windows']}/{pd['windows']} waits {pd['wait_seconds']}\n")
                _tenant_lines(w, pd, "        ")
        if "backlog_series" in r.get("focus", {}):
            _peak_backlog_lines(w, r["focus"])
    w(f"  wall {doc['wall_seconds']} s; --json for every figure\n")


def _peak_backlog_lines(w, fo: dict, every: float = 30.0, width: int = 50) -> None:
    """Ch. 18.17's prediction beside what was measured, and the backlog over time as bars."""
    p, full, m, k = fo["prediction"], fo["prediction_full_scale"], fo["measured"], fo["scale"]
    drain = "never" if p["drain_seconds"] is None else f"{p['drain_seconds']:g} s"
    w(f"    Little's law (ch. 18.17) at 1/{k} of its counts: predicted | measured\n")
    w(f"      peak backlog:        {p['backlog_tasks']:g} tasks ({full['backlog_tasks']:g} at full size) | "
      f"{m['peak_backlog_tasks']} at t={m['peak_backlog_at']} s (x{k} = {m['peak_backlog_tasks_x_scale']}); "
      f"{m['backlog_at_peak_end']} when the peak ended\n")
    w(f"      drain after the peak: {drain} | "
      f"{'not drained within the run' if m['drain_seconds'] is None else str(m['drain_seconds']) + ' s'} "
      f"(back to the steady level of {m['steady_level']} queued)\n")
    w(f"      in flight, steady:   L = lambda x W = {p['steady_in_flight']:g} | {m['steady_in_flight_mean']} on average\n")
    w(f"      slot utilisation:    {p['peak_slot_utilisation']:g} in the peak, {p['steady_slot_utilisation']:g} steady | "
      f"{m['slot_utilisation_during_peak']} over the peak, {m['slot_utilisation_while_backlogged']} while backlogged, "
      f"{m['slot_utilisation_steady']} steady\n")
    s = fo["backlog_series"]
    stride = max(1, int(round(every / s["sample_seconds"])))
    top = max(s["queued"], default=0) or 1
    ph = fo["phases"]
    w(f"    queued / in flight every {every:g} s (peak from t={ph['peak_start']:g} to {ph['peak_end']:g} s):\n")
    for t, q, f in list(zip(s["t"], s["queued"], s["in_flight"]))[::stride]:
        mark = "*" if ph["peak_start"] <= t < ph["peak_end"] else " "
        w(f"      {mark}t={t:6.0f}s queued {q:5d} in flight {f:5d} |{'#' * int(round(width * q / top))}\n")


def _tenant_lines(w, doc: dict, indent: str) -> None:
    for name, tr in (doc.get("tenants") or {}).items():
        w(f"{indent}{name}: w={tr['weight']} share {tr['share']} fair {tr['fair_share']} waits {tr['wait_seconds']}\n")


def register(sub) -> None:
    s = sub.add_parser("simulate", help="measure fairness (DRR against FIFO) or capacity (peak-backlog): "
                                        "a scenario through the real scheduler")
    s.add_argument("--scenario", required=True, choices=sorted(SCENARIOS), help="the workload to run (docs/testing.md describes each)")
    s.add_argument("--policy", choices=["drr", "fifo", "both"], default=None,
                   help="default: the scenario's (both, except peak-backlog: drr)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--param", type=_param, action="append", metavar="NAME=VALUE",
                   help="override a scenario parameter, e.g. --param whale_tasks=1000 or --param fresh_scheduler_per_tick=false")
    s.add_argument("--redis", choices=["auto", "none"], default="auto",
                   help="none: run without Redis (the scheduler's conservative mode on the PostgreSQL ring)")
    s.add_argument("--serial", action="store_true", help="run the policies one after the other, not in two processes")
    s.add_argument("--verbose", action="store_true", help="keep the platform's per-task logs")
    s.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    s.set_defaults(fn=_simulate)
