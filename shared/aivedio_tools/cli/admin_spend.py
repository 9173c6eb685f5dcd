"""`aivedio admin budget|costs|media-costs|parked ...`: provider spend (aivedio.spend): budgets, what
the platform pays providers and media, and the billing input parked for reconciliation."""
from __future__ import annotations

import argparse
from datetime import date, datetime, timedelta
from decimal import Decimal
from uuid import UUID

from aivedio.media import storage_cost
from aivedio.spend import parked
from aivedio.spend.budgets import SCOPES, set_budget, status
from aivedio.spend.costs import cost_report
from aivedio.spend.media_costs import import_cur
from aivedio_tools.cli.common import add_common, operator, run, when


def _budget_set(args) -> int:
    def fn(p, c):
        row = set_budget(c, operator=operator(args), scope_type=args.scope_type, scope_id=args.scope_id,
                         period_start=args.period_start, period_end=args.period_end, limit_amount=args.limit,
                         currency=args.currency, tenant_id=args.tenant_id)
        return {k: str(v) if v is not None else None for k, v in row.items()}
    return run(args, fn)


def _budget_status(args) -> int:
    return run(args, lambda p, c: {"budgets": status(c, now=p.clock.now(), config=p.config.billing)})


def _costs_report(args) -> int:
    def fn(p, c):
        end = args.end or p.clock.now()
        return cost_report(c, start=args.start or end - timedelta(days=1), end=end, provider=args.provider)
    return run(args, fn)


def _media_costs_import(args) -> int:
    """The import, then the storage check of every month it brought bucket storage lines for."""
    def fn(p, c):
        doc = import_cur(c, operator=operator(args), path=args.file, currencies=p.config.billing.media_cost_currencies)
        doc["storage_checks"] = [storage_cost.check_month(c, date.fromisoformat(m), p.config.media)
                                 for m in doc["bucket_storage"]["months"]]
        return doc
    return run(args, fn)


def _month(value: str) -> date:
    try:
        return datetime.strptime(value, "%Y-%m").date()
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: a month as YYYY-MM") from None


def _media_costs_check_storage(args) -> int:
    return run(args, lambda p, c: storage_cost.check_month(c, args.month, p.config.media))


def _parked_list(args) -> int:
    def fn(p, c):
        rows = parked.open_items(c, reasons=tuple(args.reason) if args.reason else None, limit=args.limit)
        return [{k: (str(v) if isinstance(v, (UUID, datetime)) else v) for k, v in r.items()} for r in rows]
    return run(args, fn)


def register(admin) -> None:
    budget = admin.add_parser("budget", help="provider spend budgets").add_subparsers(dest="budget_command", required=True)
    bs = add_common(budget.add_parser("set", help="create or change a budget"))
    bs.add_argument("--scope-type", required=True, choices=list(SCOPES), help="what the budget covers")
    bs.add_argument("--scope-id", required=True, help="GLOBAL: '*'; PROJECT: TENANT_ID:PROJECT (see `admin api-key create`)")
    bs.add_argument("--limit", required=True, type=Decimal)
    bs.add_argument("--currency", default="USD", help="the limit's currency, the provider costs' own")
    bs.add_argument("--period-start", required=True, type=when)
    bs.add_argument("--period-end", required=True, type=when, help="when the period ends (ISO 8601, with its timezone)")
    bs.add_argument("--tenant-id", type=UUID, default=None)
    bs.set_defaults(fn=_budget_set)
    add_common(budget.add_parser("status", help="budgets in force, their usage and threshold level")
               ).set_defaults(fn=_budget_status)

    costs = admin.add_parser("costs", help="provider and media costs").add_subparsers(dest="costs_command", required=True)
    cr = add_common(costs.add_parser("report", help="cost per successful video/second/playable minute, duplicate cost rate"))
    cr.add_argument("--from", dest="start", type=when, default=None, help="default: a day before --to")
    cr.add_argument("--to", dest="end", type=when, default=None, help="default: now")
    cr.add_argument("--provider", default=None)
    cr.set_defaults(fn=_costs_report)

    media = admin.add_parser("media-costs", help="media costs: transcode, storage, egress").add_subparsers(
        dest="media_costs_command", required=True)
    mi = add_common(media.add_parser("import", help="import an AWS Cost and Usage Report export (.csv or .csv.gz), "
                                                    "once per line"))
    mi.add_argument("--file", required=True, help="the cost-and-usage report: CSV, or gzip of it")
    mi.set_defaults(fn=_media_costs_import)
    mc = add_common(media.add_parser("check-storage", help="the media bucket's billed storage for a month (imported "
                                                           "CUR lines) against what the platform expects; a "
                                                           "mismatch is parked"))
    mc.add_argument("--month", required=True, type=_month, help="the usage month, YYYY-MM (UTC)")
    mc.set_defaults(fn=_media_costs_check_storage)

    pk = admin.add_parser("parked", help="billing input parked for reconciliation").add_subparsers(
        dest="parked_command", required=True)
    pl = add_common(pk.add_parser("list", help="open parked items, oldest first"))
    pl.add_argument("--reason", action="append", default=None, help="only this reason (repeat for several)")
    pl.add_argument("--limit", type=int, default=100)
    pl.set_defaults(fn=_parked_list)
