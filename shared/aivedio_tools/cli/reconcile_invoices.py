"""`aivedio reconcile invoices --provider P --date YYYY-MM-DD [--json]` (contracts/operations.md) and
`aivedio reconcile invoices-close --provider P --month YYYY-MM [--allow-incomplete --reason R] [--json]`:
one day's invoice reconciliation on demand, and the month close (aivedio.spend.invoices).

Under RBAC: reconciling needs invoice.reconcile, closing invoice.close; each is audited. `invoices --json`
prints exactly the contract's document (the report's archive keys go to stderr); a run that an unexpected
error stopped prints the error INVOICE_RUN_FAILED with its run id (the run is INCOMPLETE, RUN_FAILED)."""
from __future__ import annotations

import argparse
import sys
from datetime import date, datetime


def _day(s: str) -> date:
    try:
        if len(s) != 10:
            raise ValueError
        return date.fromisoformat(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected YYYY-MM-DD") from None


def _month(s: str) -> date:
    try:
        return datetime.strptime(s, "%Y-%m").date()
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected YYYY-MM") from None


def _reconcile(args: argparse.Namespace) -> int:
    from aivedio.policy import roles as rbac
    from aivedio_tools.cli.admin_billing import _operator, _run
    from aivedio.spend import invoices

    operator = _operator(args)

    def run(platform, _conn) -> dict:
        def authorize(conn) -> None:
            rbac.require(conn, operator, "invoice.reconcile")
            rbac.audit(conn, operator=operator, action="invoice.reconcile",
                       target=f"invoice:{args.provider}:{args.date.isoformat()}")

        platform.db.transaction(authorize)
        result = invoices.reconcile_day(platform, args.provider, args.date)
        sys.stderr.write(f"aivedio: {result.document['status']}; report {result.report_key}, {result.report_html_key}\n")
        return result.document

    return _run(args, run, transaction=False)


def _close(args: argparse.Namespace) -> int:
    from aivedio_tools.cli.admin_billing import _operator, _run
    from aivedio.spend import invoices

    return _run(args, lambda p, _c: invoices.close_month(p, args.provider, args.month, operator=_operator(args),
                                                         allow_incomplete=args.allow_incomplete, reason=args.reason),
                transaction=False)


def register_invoices(reconcile) -> None:
    from aivedio_tools.cli.admin_billing import _common

    r = _common(reconcile.add_parser("invoices", help="reconcile one provider's invoice for one UTC day (invoice.reconcile)"))
    r.add_argument("--provider", required=True)
    r.add_argument("--date", required=True, type=_day, help="the UTC day, YYYY-MM-DD")
    r.set_defaults(fn=_reconcile)
    c = _common(reconcile.add_parser("invoices-close", help="freeze a provider's month of invoices (invoice.close)"))
    c.add_argument("--provider", required=True)
    c.add_argument("--month", required=True, type=_month, help="YYYY-MM, a month that is over")
    c.add_argument("--allow-incomplete", action="store_true", help="close although some days have no COMPLETE run")
    c.add_argument("--reason", default=None, help="why (required with --allow-incomplete)")
    c.set_defaults(fn=_close)
