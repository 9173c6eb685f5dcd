"""`aivedio demo`: the whole platform at work (aivedio_tools.demo.run): tenants, providers, a workload
over the HTTP API, live progress, the report, then (with --serve, which `make run` uses) left
serving until Ctrl-C. `--verify` only checks the database verdicts of the database in the
environment."""
from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

from aivedio.config import PlatformConfig, settings_from_env
from aivedio.context import build_platform
from aivedio_tools.cli.common import emit
from aivedio_tools.demo import report
from aivedio_tools.demo.run import DEFAULT_TIME_SCALE, Options, run
from aivedio_tools.local.embedded import stop_embedded, with_embedded_servers


def register(sub) -> None:
    s = sub.add_parser("demo", help="the whole platform at work: tenants, providers, a workload over the API, a report")
    s.add_argument("--tasks", type=int, default=None, help="steady submissions, besides the whale's flood (default 160; --short: 20)")
    s.add_argument("--short", action="store_true", help="a small, quick run (for tests): 20 tasks submitted over 4 s")
    s.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE, help="platform seconds per real second")
    s.add_argument("--submit-seconds", type=float, default=None, help="real seconds the submissions are spread over")
    s.add_argument("--timeout", type=float, default=None, help="real seconds to wait for every task to finish")
    s.add_argument("--seed", type=int, default=7)
    s.add_argument("--report", type=Path, default=None, help="the HTML report's path (default: <AIVEDIO_HOME>/demo-report.html)")
    s.add_argument("--serve", action="store_true", help="keep serving after the report until Ctrl-C (make run)")
    s.add_argument("--no-workload", action="store_true", help="with --serve: only serve (make run DEMO=0)")
    s.add_argument("--port", type=int, default=None, help="the API's port (default 8080 with --serve, else any free one)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")
    s.add_argument("--verify", action="store_true", help="only check the invariants of the database in the environment")
    s.add_argument("--json", action="store_true", help="the report document as JSON on stdout")
    s.set_defaults(fn=_demo)


def _demo(args) -> int:
    if args.verify:
        return _verify(args)
    tasks = args.tasks if args.tasks is not None else (20 if args.short else 160)
    if tasks < 1 or args.time_scale <= 0:
        sys.stderr.write("aivedio demo: --tasks must be >= 1 and --time-scale > 0\n")
        return 2
    opts = Options(tasks=tasks, time_scale=args.time_scale, seed=args.seed, report_path=args.report, host=args.host,
                   submit_seconds=args.submit_seconds if args.submit_seconds is not None else (4.0 if args.short else 90.0),
                   timeout_seconds=args.timeout if args.timeout is not None else (120.0 if args.short else 420.0),
                   port=args.port if args.port is not None else (8080 if args.serve else 0),
                   serve=args.serve, workload=not args.no_workload, rich=False if args.plain or args.json else None)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code, doc = run(opts, stop)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if doc is not None and args.json:
        emit(doc, True)
    return code


def _verify(args) -> int:
    """The invariants of the report's VERDICTS section that need no run, over the whole database."""
    platform = build_platform(with_embedded_servers(settings_from_env()), PlatformConfig(), migrate=True)
    try:
        verdicts = report.database_verdicts(platform, task_ids=None)
    finally:
        platform.close()
        stop_embedded()
    ok = all(v["ok"] for v in verdicts)
    if args.json:
        sys.stdout.write(json.dumps({"verdicts": verdicts, "verdicts_passed": ok}, indent=2) + "\n")
    else:
        for v in verdicts:
            sys.stdout.write(f"{'PASS' if v['ok'] else 'FAIL'}  {v['name']:<28} {v['figure']}\n")
    return 0 if ok else 1
