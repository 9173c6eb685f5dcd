"""`aivedio reconcile ...`: the reconciliations and the maintenance room, run on demand.

- `wallets`: every wallet's snapshot against its ledger, reservations and lots (aivedio.billing.wallet_checks);
- `invoices --provider P --date YYYY-MM-DD`: one provider's invoice for one UTC day
  (aivedio.spend.invoices); `--json` prints exactly the day's document (the report's archive keys
  go to stderr); a run an unexpected error stopped prints INVOICE_RUN_FAILED with its run id;
- `invoices-close --provider P --month YYYY-MM [--allow-incomplete --reason R]`: the month close;
- `tasks`: runs `unsettled-terminals` once, then reports the terminal tasks still not settled and
  why, and the recently settled ones whose charge disagrees with their reservation or the ledger
  (exit 0 whatever it finds; `clean` says whether it found anything);
- `run SERVICE` runs one service of aivedio.reconcile.room once; `list` shows them all with their tuning.
Each run is audited as the operator who asked for it."""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from aivedio import audit
from aivedio.reconcile import room, unsettled_terminals
from aivedio.spend import invoices
from aivedio_tools.cli import admin_credit
from aivedio_tools.cli.common import add_common, day, emit, month, operator, platform_for, run


def _list(args: argparse.Namespace) -> int:
    platform = platform_for(args)
    try:
        doc = [{"service": s.name, "function": s.function, "repairs": s.repairs, "never": s.never,
                "interval_seconds": s.interval_seconds(platform.config), "aws_every_minutes": s.defaults.aws_every_minutes,
                **{k: v for k, v in asdict(room.tuning(platform, s.name).defaults).items() if k != "interval_seconds"}}
               for s in room.SERVICES]
    finally:
        platform.close()
    if args.json:
        emit({"services": doc}, True)
    else:
        for d in doc:
            sys.stdout.write(f"{d['service']:<24} every {d['interval_seconds']:>8.0f}s  {d['repairs']}\n")
    return 0


def _audited(platform, args: argparse.Namespace, action: str, target: str) -> None:
    """Who asked for a run, committed before it starts (the run makes its own transactions)."""
    platform.db.transaction(lambda conn: audit.append(conn, operator=operator(args), action=action, target=target))


def _run_service(args: argparse.Namespace) -> int:
    def fn(platform, _) -> dict:
        _audited(platform, args, "maintenance.run", f"service:{args.service}")
        return room.run(platform, args.service).as_dict()

    return run(args, fn, transaction=False)


def _invoices(args: argparse.Namespace) -> int:
    def fn(platform, _) -> dict:
        _audited(platform, args, "invoice.reconcile", f"invoice:{args.provider}:{args.date.isoformat()}")
        result = invoices.reconcile_day(platform, args.provider, args.date)
        sys.stderr.write(f"aivedio: {result.document['status']}; report {result.report_key}, {result.report_html_key}\n")
        return result.document

    return run(args, fn, transaction=False)


def _invoices_close(args: argparse.Namespace) -> int:
    return run(args, lambda p, _: invoices.close_month(p, args.provider, args.month, operator=operator(args),
                                                       allow_incomplete=args.allow_incomplete, reason=args.reason),
               transaction=False)


def _tasks_lines(doc: dict) -> list[str]:
    r = doc["run"]
    lines = [f"unsettled-terminals: examined {r['examined']}, settled {r['repaired']}, "
             f"{'complete' if r['complete'] else 'more to do'}",
             f"terminal tasks not settled: {doc['unsettled_count']}"]
    lines += [f"  {u['task_id']}  {u['state']:<9}  finished {u['finished_at']}  ({u['why']})" for u in doc["unsettled"]]
    lines.append(f"settled tasks that disagree with the ledger: {doc['disagreement_count']}")
    lines += [f"  {d['task_id']}  charged {d['final_charge_amount']}, reservation settled {d['reservation_settled']}, "
              f"ledger consumed {d['ledger_consumed']}, still reserved {d['still_reserved']}" for d in doc["disagreements"]]
    return lines


def _tasks(args: argparse.Namespace) -> int:
    def fn(platform, _) -> dict:
        _audited(platform, args, "maintenance.run", "reconcile:tasks")
        report = room.run(platform, unsettled_terminals.NAME)
        found = unsettled_terminals.check(platform, since=unsettled_terminals.since_hours(platform, args.since_hours),
                                          limit=args.limit)
        return {"run": report.as_dict(), **found, "unsettled_count": len(found["unsettled"]),
                "disagreement_count": len(found["disagreements"]),
                "clean": not found["unsettled"] and not found["disagreements"]}

    return run(args, fn, transaction=False, human=_tasks_lines)


def register(sub) -> None:
    reconcile = sub.add_parser("reconcile", help="reconciliations and the maintenance room, run on demand").add_subparsers(
        dest="reconcile_command", required=True)
    admin_credit.register_reconcile(reconcile)
    ls = reconcile.add_parser("list", help="every repair the platform makes, with its schedule and tuning")
    ls.add_argument("--config", default=None, help="the platform's config file (default: AIVEDIO_CONFIG)")
    ls.add_argument("--json", action="store_true", help="one JSON document on stdout")
    ls.set_defaults(fn=_list)
    r = add_common(reconcile.add_parser("run", help="run one maintenance service now"))
    r.add_argument("service", choices=[s.name for s in room.SERVICES], help="the maintenance service to run")
    r.set_defaults(fn=_run_service)

    i = add_common(reconcile.add_parser("invoices", help="reconcile one provider's invoice for one UTC day"))
    i.add_argument("--provider", required=True)
    i.add_argument("--date", required=True, type=day, help="the UTC day, YYYY-MM-DD")
    i.set_defaults(fn=_invoices)
    c = add_common(reconcile.add_parser("invoices-close", help="freeze a provider's month of invoices"))
    c.add_argument("--provider", required=True)
    c.add_argument("--month", required=True, type=month, help="YYYY-MM, a month that is over")
    c.add_argument("--allow-incomplete", action="store_true", help="close although some days have no COMPLETE run")
    c.add_argument("--reason", default=None, help="why (required with --allow-incomplete)")
    c.set_defaults(fn=_invoices_close)

    t = add_common(reconcile.add_parser("tasks", help="task reconciliation: settle terminal tasks whose event was lost, "
                                                      "report what is still unsettled or disagrees"))
    t.add_argument("--since-hours", type=float, default=24.0, help="check charges settled this far back (default 24)")
    t.add_argument("--limit", type=int, default=100, help="at most this many of each finding")
    t.set_defaults(fn=_tasks)
