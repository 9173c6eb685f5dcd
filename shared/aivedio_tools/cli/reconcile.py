"""`aivedio reconcile ...` (contracts/operations.md): the reconciliations and the maintenance room, run
on demand. `wallets` checks every wallet's snapshot against its ledger, reservations and lots
(aivedio.billing.wallet_checks); `run SERVICE` runs one service of aivedio.reconcile.room once, and
`list` shows them all with their tuning."""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict


def _list(args: argparse.Namespace) -> int:
    from aivedio_tools.cli import _emit, _platform
    from aivedio.reconcile import room

    platform = _platform(args)
    try:
        doc = [{"service": s.name, "function": s.function, "repairs": s.repairs, "never": s.never,
                "interval_seconds": s.interval_seconds(platform.config),
                "aws_every_minutes": s.defaults.aws_every_minutes, **{k: v for k, v in asdict(room.tuning(platform, s.name).defaults).items()
                                                                    if k != "interval_seconds"}}
               for s in room.SERVICES]
    finally:
        platform.close()
    if args.json:
        _emit({"services": doc}, True)
    else:
        for d in doc:
            sys.stdout.write(f"{d['service']:<24} every {d['interval_seconds']:>8.0f}s  {d['repairs']}\n")
    return 0


def _run_service(args: argparse.Namespace) -> int:
    from aivedio.policy import roles as rbac
    from aivedio_tools.cli.admin_billing import _operator, _run
    from aivedio.reconcile import room

    operator = _operator(args)

    def run(platform, _conn) -> dict:
        def authorize(conn) -> None:
            rbac.require(conn, operator, "maintenance.run")
            rbac.audit(conn, operator=operator, action="maintenance.run", target=f"service:{args.service}")

        platform.db.transaction(authorize)
        return room.run(platform, args.service).as_dict()

    return _run(args, run, transaction=False)


def register(sub) -> None:
    from aivedio_tools.cli.admin_billing import _common, register_reconcile
    from aivedio.reconcile import room

    reconcile = sub.add_parser("reconcile", help="reconciliations and the maintenance room, run on demand").add_subparsers(
        dest="reconcile_command", required=True)
    register_reconcile(reconcile)
    ls = reconcile.add_parser("list", help="every repair the platform makes, with its schedule and tuning")
    ls.add_argument("--config", default=None)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(fn=_list)
    r = _common(reconcile.add_parser("run", help="run one maintenance service now (needs maintenance.run)"))
    r.add_argument("service", choices=[s.name for s in room.SERVICES])
    r.set_defaults(fn=_run_service)
    # --- further reconcile commands, by capability (each registers its own) ---
    from aivedio_tools.cli.reconcile_invoices import register_invoices
    register_invoices(reconcile)
    from aivedio_tools.cli.reconcile_tasks import register_reconcile_tasks
    register_reconcile_tasks(reconcile)
