"""`aivedio chaos`:
- `aivedio chaos --seed S [--duration D] [--break SAFEGUARD] [--target SAFEGUARD] [--dir DIR] [--json]`:
  one run (aivedio_tools.chaos.runner); the plan is printed first; exit 1 when a checker fired.
- `aivedio chaos check DIR [--json]`: the checkers again, offline, on a run's recorded files.
- `aivedio chaos plan --seed S [--duration D] [--target SAFEGUARD]`: the plan alone, as JSON.
- `aivedio chaos soak [--seconds N] [--duration D]`: seeds one after another for N seconds
  (0: until Ctrl-C), the known failing seeds first; a seed that fails is added to that file.
- `aivedio chaos rates [--seeds N]`: each switch on N seeds not aimed at it; how often its checker fired.
- `aivedio chaos safeguards`: the switches and the failpoints, and what each disables."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from aivedio.config import settings_from_env
from aivedio.faults import failpoints, safeguards
from aivedio.faults.safeguards import SAFEGUARDS
from aivedio_tools.chaos import checkers, plan, records, runner, sweep
from aivedio_tools.chaos.checkers import describe_verdict
from aivedio_tools.local.embedded import with_embedded_servers


def _echo(quiet: bool):
    return (lambda s: None) if quiet else (lambda s: (sys.stderr.write(s + "\n"), sys.stderr.flush()))


def _print_verdict(v: dict, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(v, indent=1, default=str) + "\n")
        return

    sys.stdout.write("\n".join(describe_verdict(v)) + "\n")


def _admin_url() -> str:
    return with_embedded_servers(settings_from_env().model_copy(update={"redis_url": "none"})).database_url


def cmd_run(args: argparse.Namespace) -> int:
    out = Path(args.dir or f".aivedio/chaos/{args.seed}")
    breaks = tuple(args.break_ or ())
    v = runner.run(args.seed, args.duration, out, admin_url=_admin_url(), target=args.target, breaks=breaks,
                   keep_db=args.keep_db, echo=_echo(args.json))
    _print_verdict(v, args.json)
    return 0 if v["ok"] else 1


def cmd_check(args: argparse.Namespace) -> int:
    v = checkers.verdict(records.Run.load(Path(args.dir)))
    _print_verdict(v, args.json)
    return 0 if v["ok"] else 1


def cmd_plan(args: argparse.Namespace) -> int:
    sys.stdout.write(json.dumps(plan.make_plan(args.seed, args.duration, target=args.target), indent=1) + "\n")
    return 0


def cmd_soak(args: argparse.Namespace) -> int:
    report = sweep.soak(args.seconds, args.duration, Path(args.dir), admin_url=_admin_url(), echo=_echo(False))
    sys.stdout.write(json.dumps(report, indent=1, default=str) + "\n")
    return 0 if not report["failing_seeds"] else 1


def cmd_rates(args: argparse.Namespace) -> int:
    seeds = [args.first_seed + i for i in range(args.seeds)]
    report = sweep.switch_rates(seeds, args.duration, Path(args.dir), admin_url=_admin_url(), echo=_echo(False),
                                switches=args.switch or None)
    sys.stdout.write(json.dumps(report, indent=1) + "\n")
    return 0


def cmd_safeguards(args: argparse.Namespace) -> int:
    doc = {"safeguards": {n: {"disables": d, "checker": plan.TARGETS[n]["checker"]} for n, d in safeguards.SAFEGUARDS.items()},
           "failpoints": failpoints.FAILPOINTS,
           "enable": f"{safeguards.BREAK_ENV}=<names> with {safeguards.ALLOW_ENV}={safeguards.ALLOW_VALUE} (never in Lambda)"}
    sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    return 0


def register(sub) -> None:
    p = sub.add_parser("chaos", help="a seeded chaos run over the real stack, and its checkers")
    p.add_argument("--seed", type=int, default=None, help="the seed the whole run derives from (required to run)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load and faults (default 20)")
    p.add_argument("--break", dest="break_", action="append", choices=sorted(SAFEGUARDS),
                   help="switch this safeguard off (repeatable): its checker must fire")
    p.add_argument("--target", choices=sorted(SAFEGUARDS), default=None,
                   help="draw the plan aimed at this safeguard (implied by --break)")
    p.add_argument("--dir", default=None, help="the run directory (default .aivedio/chaos/<seed>)")
    p.add_argument("--keep-db", action="store_true", help="keep the run's database")
    p.add_argument("--json", action="store_true", help="the run's result as one JSON document on stdout")
    p.set_defaults(fn=_dispatch)
    cs = p.add_subparsers(dest="chaos_command")
    c = cs.add_parser("check", help="re-check a run directory offline")
    c.add_argument("dir", help="a run directory a chaos run wrote")
    c.add_argument("--json", action="store_true", help="the violations as one JSON document on stdout")
    c.set_defaults(fn=cmd_check)
    pl = cs.add_parser("plan", help="print a seed's plan")
    pl.add_argument("--seed", type=int, required=True, help="the seed whose plan to print")
    pl.add_argument("--duration", type=float, default=20.0, help="seconds of load and faults the plan covers")
    pl.add_argument("--target", choices=sorted(SAFEGUARDS), default=None, help="the plan aimed at this safeguard")
    pl.set_defaults(fn=cmd_plan)
    so = cs.add_parser("soak", help="seeds one after another, failing seeds first")
    so.add_argument("--seconds", type=float, default=0.0, help="how long (0: until Ctrl-C)")
    so.add_argument("--duration", type=float, default=20.0, help="seconds of load and faults per seed")
    so.add_argument("--dir", default=".aivedio/chaos/soak", help="where the seeds' run directories go")
    so.set_defaults(fn=cmd_soak)
    ra = cs.add_parser("rates", help="how often each switch's checker fires on seeds not aimed at it")
    ra.add_argument("--seeds", type=int, default=3, help="how many seeds per switch")
    ra.add_argument("--first-seed", type=int, default=1000, help="the first of the consecutive seeds")
    ra.add_argument("--duration", type=float, default=12.0, help="seconds of load and faults per seed")
    ra.add_argument("--switch", action="append", choices=sorted(SAFEGUARDS), help="a safeguard to count (repeatable; default: every one)")
    ra.add_argument("--dir", default=".aivedio/chaos/rates", help="where the seeds' run directories go")
    ra.set_defaults(fn=cmd_rates)
    sg = cs.add_parser("safeguards", help="the safeguard switches and failpoints")
    sg.set_defaults(fn=cmd_safeguards)


def _dispatch(args: argparse.Namespace) -> int:
    if args.seed is None:
        raise SystemExit("aivedio chaos: --seed is required (or a sub-command: check, plan, soak, safeguards)")
    return cmd_run(args)
