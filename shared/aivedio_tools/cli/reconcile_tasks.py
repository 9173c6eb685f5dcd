"""`aivedio reconcile tasks` (ch. 20.10.2 layer 2, task reconciliation): runs `unsettled-terminals`
once, then reports the terminal tasks still not settled (and why: parked, an event that is still
PENDING, no facts to rebuild it from) and the tasks settled in the last --since-hours whose charge
disagrees with their reservation or the ledger's settle transaction. Needs maintenance.run, audited
like `aivedio reconcile run`. Exit 0 whatever it finds; `clean` says whether it found anything."""
from __future__ import annotations

import argparse
import sys


def _reconcile_tasks(args: argparse.Namespace) -> int:
    from aivedio.policy import roles as rbac
    from aivedio_tools.cli.admin_billing import _operator, _run
    from aivedio.reconcile import room, unsettled_terminals

    operator = _operator(args)

    def run(platform, _conn) -> dict:
        def authorize(conn) -> None:
            rbac.require(conn, operator, "maintenance.run")
            rbac.audit(conn, operator=operator, action="maintenance.run", target="reconcile:tasks")

        platform.db.transaction(authorize)
        report = room.run(platform, unsettled_terminals.NAME)
        found = unsettled_terminals.check(platform, since=unsettled_terminals.since_hours(platform, args.since_hours),
                                          limit=args.limit)
        return {"run": report.as_dict(), **found, "unsettled_count": len(found["unsettled"]),
                "disagreement_count": len(found["disagreements"]),
                "clean": not found["unsettled"] and not found["disagreements"]}

    if args.json:
        return _run(args, run, transaction=False)
    return _run_human(args, run)


def _run_human(args: argparse.Namespace, run) -> int:
    """What _run does, printing lines instead of the document."""
    from aivedio_tools.cli import _platform
    from aivedio.errors import DomainError

    platform = _platform(args)
    try:
        doc = run(platform, None)
    except DomainError as e:
        sys.stderr.write(f"aivedio: {e.code}: {e.message}\n")
        return 1
    finally:
        platform.close()
    r = doc["run"]
    out = sys.stdout
    out.write(f"unsettled-terminals: examined {r['examined']}, settled {r['repaired']}, "
              f"{'complete' if r['complete'] else 'more to do'}\n")
    out.write(f"terminal tasks not settled: {doc['unsettled_count']}\n")
    for u in doc["unsettled"]:
        out.write(f"  {u['task_id']}  {u['state']:<9}  finished {u['finished_at']}  ({u['why']})\n")
    out.write(f"settled tasks that disagree with the ledger: {doc['disagreement_count']}\n")
    for d in doc["disagreements"]:
        out.write(f"  {d['task_id']}  charged {d['final_charge_amount']}, reservation settled {d['reservation_settled']}, "
                  f"ledger consumed {d['ledger_consumed']}, still reserved {d['still_reserved']}\n")
    return 0


def register_reconcile_tasks(reconcile) -> None:
    from aivedio_tools.cli.admin_billing import _common

    t = _common(reconcile.add_parser("tasks", help="task reconciliation: settle terminal tasks whose event was lost, "
                                                   "report what is still unsettled or disagrees (needs maintenance.run)"))
    t.add_argument("--since-hours", type=float, default=24.0, help="check charges settled this far back (default 24)")
    t.add_argument("--limit", type=int, default=100, help="at most this many of each finding")
    t.set_defaults(fn=_reconcile_tasks)
