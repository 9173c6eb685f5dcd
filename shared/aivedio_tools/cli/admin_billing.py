"""`aivedio admin ...` billing commands (contracts/operations.md: "refunds and compensation, under RBAC
and audit"), and `aivedio reconcile wallets`. Each write runs in one transaction through the domain
core, which checks the operator's role and appends the audit row. A domain error prints
{"error": CODE, "message", "details"} and exits 1, having written nothing."""
from __future__ import annotations

import argparse
import getpass
import json
import sys
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Callable
from uuid import UUID

from aivedio.errors import DomainError


def _operator(args: argparse.Namespace) -> str:
    return args.operator or f"cli:{getpass.getuser()}"


def _dt(s: str) -> datetime:
    d = datetime.fromisoformat(s.replace("Z", "+00:00"))
    if d.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{s!r}: give a timezone (e.g. 2026-06-01T00:00:00Z)")
    return d


def _run(args: argparse.Namespace, fn: Callable[[Any, Any], Any], *, transaction: bool = True,
         audit_refusal: str | None = None) -> int:
    """Build the platform, run fn(platform, conn) in one transaction, print the result. A money
    operation named by `audit_refusal` that a money control refuses leaves an audit row of its own:
    the refused transaction wrote nothing, not even that."""
    from aivedio_tools.cli import _emit, _platform

    platform = _platform(args)
    try:
        if transaction:
            doc = platform.db.transaction(lambda conn: fn(platform, conn))
        else:
            doc = fn(platform, None)
    except DomainError as e:
        if audit_refusal is not None and e.code in AUDITED_REFUSALS:
            _audit_refused(platform, args, audit_refusal, e)
        err = {"error": e.code, "message": e.message, "details": e.details}
        if args.json:
            sys.stdout.write(json.dumps(err, default=str, sort_keys=True) + "\n")
        else:
            sys.stderr.write(f"aivedio: {e.code}: {e.message}\n")
        return 1
    finally:
        platform.close()
    _emit(doc, args.json)
    return 0


# Refusals by the money controls (ch. 20.13.5) are audited; bad input still writes nothing at all.
AUDITED_REFUSALS = ("REFUND_DAILY_LIMIT_EXCEEDED", "APPROVAL_REFUSED")


def _audit_refused(platform, args: argparse.Namespace, action: str, e: DomainError) -> None:
    from aivedio.policy import roles as rbac

    target = next((f"{k.removesuffix('_id')}:{getattr(args, k)}" for k in ("task_id", "refund_id")
                   if getattr(args, k, None) is not None), "refund")
    platform.db.transaction(lambda c: rbac.audit(
        c, operator=_operator(args), action=f"{action}.refused", target=target,
        tenant_id=getattr(args, "tenant_id", None),
        new={"error": e.code, "amount": getattr(args, "amount", None), "details": e.details}, reason=e.message))


def _common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--operator", default=None, help="who acts (default cli:<os user>); needs a role, see `admin operator grant`")
    p.add_argument("--config", default=None)
    p.add_argument("--json", action="store_true")
    return p


# --- commands ---------------------------------------------------------------------------------------------

def _operator_grant(args) -> int:
    from aivedio.policy import roles as rbac

    return _run(args, lambda p, c: {"grantee": args.grantee, "role": args.role,
                                    "created": rbac.grant(c, operator=_operator(args), grantee=args.grantee, role=args.role)})


def _refund_create(args) -> int:
    from aivedio.billing.refunds import request_refund

    return _run(args, lambda p, c: request_refund(c, operator=_operator(args), tenant_id=args.tenant_id, task_id=args.task_id,
                                                  amount=args.amount, reason=args.reason, request_key=args.request_key,
                                                  now=p.clock.now(),
                                                  dual_approval_above=p.config.billing.refund_dual_approval_above,
                                                  daily_limit=p.config.billing.refund_daily_limit_per_operator),
                audit_refusal="refund.request")


def _refund_approve(args) -> int:
    from aivedio.billing.refunds import approve_refund

    return _run(args, lambda p, c: approve_refund(c, operator=_operator(args), refund_id=args.refund_id, now=p.clock.now(),
                                                  daily_limit=p.config.billing.refund_daily_limit_per_operator),
                audit_refusal="refund.approve")


def _refund_reject(args) -> int:
    from aivedio.billing.refunds import reject_refund

    return _run(args, lambda p, c: reject_refund(c, operator=_operator(args), refund_id=args.refund_id, reason=args.reason,
                                                 now=p.clock.now()))


def _refund_list(args) -> int:
    from aivedio.policy import roles as rbac
    from aivedio.billing.refunds import list_refunds

    def fn(p, c):
        rbac.require(c, _operator(args), "wallet.check")
        return [{k: (str(v) if isinstance(v, (UUID, datetime)) else v) for k, v in r.items()}
                for r in list_refunds(c, tenant_id=args.tenant_id, task_id=args.task_id)]
    return _run(args, fn)


def _compensation_request(args) -> int:
    from aivedio.billing.compensation import request_compensation

    try:
        evidence = json.loads(args.evidence) if args.evidence else None
    except json.JSONDecodeError as e:
        sys.stderr.write(f"aivedio: --evidence is not JSON: {e}\n")
        return 2
    return _run(args, lambda p, c: request_compensation(
        c, operator=_operator(args), tenant_id=args.tenant_id, case_id=args.case_id, amount=args.amount,
        reason_code=args.reason_code, evidence=evidence, now=p.clock.now(), expires_at=args.expires_at, task_id=args.task_id,
        dual_approval_above=p.config.billing.compensation_dual_approval_above))


def _compensation_approve(args) -> int:
    from aivedio.billing.compensation import approve_compensation

    return _run(args, lambda p, c: approve_compensation(c, operator=_operator(args), tenant_id=args.tenant_id,
                                                        case_id=args.case_id, now=p.clock.now()))


def _compensation_reject(args) -> int:
    from aivedio.billing.compensation import reject_compensation

    return _run(args, lambda p, c: reject_compensation(c, operator=_operator(args), tenant_id=args.tenant_id,
                                                       case_id=args.case_id, reason=args.reason, now=p.clock.now()))


def _wallet_check(args) -> int:
    from aivedio.policy import roles as rbac
    from aivedio.billing import wallet_checks

    def fn(p, c):
        rbac.require(c, _operator(args), "wallet.check")
        return wallet_checks.check_wallet(c, wallet_id=args.wallet_id, now=p.clock.now(), freeze=not args.no_freeze)
    return _run(args, fn)


def _wallet_rebuild(args) -> int:
    from aivedio.billing import wallet_checks

    return _run(args, lambda p, c: wallet_checks.rebuild(c, operator=_operator(args), wallet_id=args.wallet_id,
                                                         now=p.clock.now(), reason=args.reason))


def _wallet_unfreeze(args) -> int:
    from aivedio.billing import wallet_checks

    return _run(args, lambda p, c: wallet_checks.unfreeze(c, operator=_operator(args), wallet_id=args.wallet_id,
                                                          now=p.clock.now(), reason=args.reason))


def _wallet_partition(args) -> int:
    from aivedio.billing import allowances

    return _run(args, lambda p, c: allowances.partition(c, operator=_operator(args), tenant_id=args.tenant_id,
                                                        slots=args.slots, chunk_amount=args.chunk_amount,
                                                        fast_max_units=args.fast_max_units, reason=args.reason))


def _wallet_unpartition(args) -> int:
    from aivedio.billing import allowances

    return _run(args, lambda p, c: allowances.unpartition(c, operator=_operator(args), tenant_id=args.tenant_id,
                                                          reason=args.reason))


def _ledger_reverse(args) -> int:
    from aivedio.billing.corrections import reverse

    return _run(args, lambda p, c: reverse(c, operator=_operator(args), ledger_txn_id=args.txn_id, reason=args.reason,
                                           now=p.clock.now()))


def _budget_set(args) -> int:
    from aivedio.spend.budgets import set_budget

    def fn(p, c):
        row = set_budget(c, operator=_operator(args), scope_type=args.scope_type, scope_id=args.scope_id,
                         period_start=args.period_start, period_end=args.period_end, limit_amount=args.limit,
                         currency=args.currency, tenant_id=args.tenant_id)
        return {k: str(v) if v is not None else None for k, v in row.items()}
    return _run(args, fn)


def _budget_status(args) -> int:
    from aivedio.policy import roles as rbac
    from aivedio.spend.budgets import status

    def fn(p, c):
        rbac.require(c, _operator(args), "costs.read")
        return {"budgets": status(c, now=p.clock.now(), config=p.config.billing)}
    return _run(args, fn)


def _contract_budget_set(args) -> int:
    from aivedio.billing.contract_budgets import set_contract_budget

    def fn(p, c):
        row = set_contract_budget(c, operator=_operator(args), tenant_id=args.tenant_id, period_start=args.period_start,
                                  period_end=args.period_end, budget_amount=args.amount, reason=args.reason)
        return {k: str(v) if isinstance(v, (UUID, datetime)) else v for k, v in row.items()}
    return _run(args, fn)


def _subscription_set(args) -> int:
    from aivedio.billing.subscriptions import set_subscription

    def fn(p, c):
        row = set_subscription(c, operator=_operator(args), tenant_id=args.tenant_id, grant_amount=args.amount,
                               period_seconds=args.period_seconds, first_grant_at=args.first_grant_at or p.clock.now())
        return {k: str(v) for k, v in row.items()}
    return _run(args, fn)


def _credits_expire(args) -> int:
    from aivedio.policy import roles as rbac
    from aivedio.billing import expiry, subscriptions

    def fn(p, c):
        with p.db.connection() as conn:
            rbac.require(conn, _operator(args), "credits.expire")
        now = p.clock.now()
        return {"subscriptions": subscriptions.grant_due(p, now), "expiry": expiry.sweep(p, now)}
    return _run(args, fn, transaction=False)


def _costs_report(args) -> int:
    from aivedio.policy import roles as rbac
    from aivedio.spend.costs import cost_report

    def fn(p, c):
        rbac.require(c, _operator(args), "costs.read")
        end = args.end or p.clock.now()
        start = args.start or end - timedelta(days=1)
        return cost_report(c, start=start, end=end, provider=args.provider)
    return _run(args, fn)


def _media_costs_import(args) -> int:
    from aivedio.spend.media_costs import import_cur

    return _run(args, lambda p, c: import_cur(c, operator=_operator(args), path=args.file,
                                              currencies=p.config.billing.media_cost_currencies))


def _parked_list(args) -> int:
    from aivedio.policy import roles as rbac
    from aivedio.spend import parked

    def fn(p, c):
        rbac.require(c, _operator(args), "wallet.check")
        rows = parked.open_items(c, reasons=tuple(args.reason) if args.reason else None, limit=args.limit)
        return [{k: (str(v) if isinstance(v, (UUID, datetime)) else v) for k, v in r.items()} for r in rows]
    return _run(args, fn)


def _reconcile_wallets(args) -> int:
    from aivedio.billing import wallet_checks

    return _run(args, lambda p, c: wallet_checks.check_all(p, freeze=not args.no_freeze), transaction=False)


# --- parsers -------------------------------------------------------------------------------------------------

def register_admin(admin) -> None:
    """Add the billing commands to `aivedio admin`'s sub-parsers."""
    from aivedio.policy import roles as rbac

    op = admin.add_parser("operator", help="operator roles (RBAC)").add_subparsers(dest="operator_command", required=True)
    g = _common(op.add_parser("grant", help="give an operator a role (the first BILLING_ADMIN bootstraps)"))
    g.add_argument("--grantee", required=True)
    g.add_argument("--role", required=True, choices=list(rbac.ROLES))
    g.set_defaults(fn=_operator_grant)
    from aivedio_tools.cli.admin_operators import register_operator_commands

    register_operator_commands(op)

    refund = admin.add_parser("refund", help="refunds of settled charges").add_subparsers(dest="refund_command", required=True)
    c = _common(refund.add_parser("create", help="refund part or all of a task's settled charge (above the threshold it "
                                                 "waits for `approve` by another operator)"))
    c.add_argument("--tenant-id", required=True, type=UUID)
    c.add_argument("--task-id", required=True, type=UUID)
    c.add_argument("--amount", required=True, type=int)
    c.add_argument("--reason", required=True)
    c.add_argument("--request-key", required=True, help="idempotency key: the same key never refunds twice")
    c.set_defaults(fn=_refund_create)
    ap = _common(refund.add_parser("approve", help="a second operator approves a refund above the threshold"))
    ap.add_argument("--refund-id", required=True, type=UUID)
    ap.set_defaults(fn=_refund_approve)
    rj = _common(refund.add_parser("reject", help="turn down a refund awaiting approval (no money moves)"))
    rj.add_argument("--refund-id", required=True, type=UUID)
    rj.add_argument("--reason", required=True)
    rj.set_defaults(fn=_refund_reject)
    ls = _common(refund.add_parser("list", help="a tenant's refund requests"))
    ls.add_argument("--tenant-id", required=True, type=UUID)
    ls.add_argument("--task-id", type=UUID, default=None)
    ls.set_defaults(fn=_refund_list)

    comp = admin.add_parser("compensation", help="goodwill credit under approval").add_subparsers(dest="compensation_command",
                                                                                                   required=True)
    r = _common(comp.add_parser("request", help="open a compensation case (applied at once at or below the threshold)"))
    r.add_argument("--tenant-id", required=True, type=UUID)
    r.add_argument("--case-id", default=None)
    r.add_argument("--amount", required=True, type=int)
    r.add_argument("--reason-code", required=True)
    r.add_argument("--evidence", default=None, help="a JSON object")
    r.add_argument("--expires-at", type=_dt, default=None)
    r.add_argument("--task-id", type=UUID, default=None)
    r.set_defaults(fn=_compensation_request)
    for name, fn, extra in (("approve", _compensation_approve, False), ("reject", _compensation_reject, True)):
        a = _common(comp.add_parser(name))
        a.add_argument("--tenant-id", required=True, type=UUID)
        a.add_argument("--case-id", required=True)
        if extra:
            a.add_argument("--reason", required=True)
        a.set_defaults(fn=fn)

    wallet = admin.add_parser("wallet", help="wallet checks and repair").add_subparsers(dest="wallet_command", required=True)
    wc = _common(wallet.add_parser("check", help="snapshot vs ledger vs reservations vs lots; freezes on mismatch"))
    wc.add_argument("--wallet-id", required=True, type=UUID)
    wc.add_argument("--no-freeze", action="store_true")
    wc.set_defaults(fn=_wallet_check)
    wr = _common(wallet.add_parser("rebuild", help="append adjustments, recompute the snapshot, unfreeze if clean"))
    wr.add_argument("--wallet-id", required=True, type=UUID)
    wr.add_argument("--reason", required=True)
    wr.set_defaults(fn=_wallet_rebuild)
    wu = _common(wallet.add_parser("unfreeze", help="lift a freeze (only when the wallet checks clean)"))
    wu.add_argument("--wallet-id", required=True, type=UUID)
    wu.add_argument("--reason", required=True)
    wu.set_defaults(fn=_wallet_unfreeze)
    from aivedio.billing import allowances

    wp = _common(wallet.add_parser("partition", help="a hot wallet: spend allowances carved into slots, so a tenant's "
                                                     "users admit without queueing on one wallet row (ch. 20.11.4)"))
    wp.add_argument("--tenant-id", required=True, type=UUID)
    wp.add_argument("--slots", type=int, default=allowances.DEFAULT_SLOTS, help="2 to 256; each user admits through one")
    wp.add_argument("--chunk-amount", required=True, type=int, help="credits a slot is refilled with at a time")
    wp.add_argument("--fast-max-units", type=int, default=allowances.DEFAULT_FAST_MAX_UNITS,
                    help="a task with more fairness units takes the merged path")
    wp.add_argument("--reason", default=None)
    wp.set_defaults(fn=_wallet_partition)
    wn = _common(wallet.add_parser("unpartition", help="every allowance back to its lots; one wallet row again"))
    wn.add_argument("--tenant-id", required=True, type=UUID)
    wn.add_argument("--reason", default=None)
    wn.set_defaults(fn=_wallet_unpartition)

    ledger = admin.add_parser("ledger", help="ledger corrections").add_subparsers(dest="ledger_command", required=True)
    lr = _common(ledger.add_parser("reverse", help="append a reversal (ADJUST with reversal_of) of a GRANT/COMPENSATE/EXPIRE/ADJUST"))
    lr.add_argument("--txn-id", required=True, type=UUID)
    lr.add_argument("--reason", required=True)
    lr.set_defaults(fn=_ledger_reverse)

    budget = admin.add_parser("budget", help="provider spend budgets").add_subparsers(dest="budget_command", required=True)
    bs = _common(budget.add_parser("set", help="create or change a budget"))
    bs.add_argument("--scope-type", required=True, choices=["TENANT", "PROJECT", "PROVIDER_ACCOUNT", "MODEL", "REGION", "GLOBAL"])
    bs.add_argument("--scope-id", required=True, help="GLOBAL: '*'; PROJECT: TENANT_ID:PROJECT (see `admin api-key create`)")
    bs.add_argument("--limit", required=True, type=Decimal)
    bs.add_argument("--currency", default="USD")
    bs.add_argument("--period-start", required=True, type=_dt)
    bs.add_argument("--period-end", required=True, type=_dt)
    bs.add_argument("--tenant-id", type=UUID, default=None)
    bs.set_defaults(fn=_budget_set)
    bst = _common(budget.add_parser("status", help="budgets in force, their usage and threshold level"))
    bst.set_defaults(fn=_budget_status)

    contract = admin.add_parser("contract-budget", help="POSTPAID contract budgets per billing period").add_subparsers(
        dest="contract_budget_command", required=True)
    cs = _common(contract.add_parser("set", help="a POSTPAID wallet's budget for a period: accrued + reserved + new <= AMOUNT"))
    cs.add_argument("--tenant-id", required=True, type=UUID)
    cs.add_argument("--amount", required=True, type=int, help="credits")
    cs.add_argument("--period-start", required=True, type=_dt)
    cs.add_argument("--period-end", required=True, type=_dt, help="exclusive")
    cs.add_argument("--reason", default=None)
    cs.set_defaults(fn=_contract_budget_set)

    sub = admin.add_parser("subscription", help="subscription grants").add_subparsers(dest="subscription_command", required=True)
    ss = _common(sub.add_parser("set", help="grant AMOUNT credits every PERIOD seconds (expiring at the period's end)"))
    ss.add_argument("--tenant-id", required=True, type=UUID)
    ss.add_argument("--amount", required=True, type=int)
    ss.add_argument("--period-seconds", required=True, type=int)
    ss.add_argument("--first-grant-at", type=_dt, default=None)
    ss.set_defaults(fn=_subscription_set)

    credits = admin.add_parser("credits", help="credit lots").add_subparsers(dest="credits_command", required=True)
    ce = _common(credits.add_parser("expire", help="run the subscription grants and the expiry sweep now"))
    ce.set_defaults(fn=_credits_expire)

    costs = admin.add_parser("costs", help="provider and media costs").add_subparsers(dest="costs_command", required=True)
    cr = _common(costs.add_parser("report", help="cost per successful video/second/playable minute, duplicate cost rate"))
    cr.add_argument("--from", dest="start", type=_dt, default=None, help="default: a day before --to")
    cr.add_argument("--to", dest="end", type=_dt, default=None, help="default: now")
    cr.add_argument("--provider", default=None)
    cr.set_defaults(fn=_costs_report)

    media = admin.add_parser("media-costs", help="media costs: transcode, storage, egress").add_subparsers(
        dest="media_costs_command", required=True)
    mi = _common(media.add_parser("import", help="import an AWS Cost and Usage Report export (.csv or .csv.gz), once per line"))
    mi.add_argument("--file", required=True)
    mi.set_defaults(fn=_media_costs_import)

    parked = admin.add_parser("parked", help="settlement input parked for reconciliation").add_subparsers(
        dest="parked_command", required=True)
    pl = _common(parked.add_parser("list"))
    pl.add_argument("--reason", action="append", default=None)
    pl.add_argument("--limit", type=int, default=100)
    pl.set_defaults(fn=_parked_list)


def register_reconcile(reconcile) -> None:
    """Add `wallets` to `aivedio reconcile`'s sub-parsers."""
    w = reconcile.add_parser("wallets", help="check every wallet (ch. 20.8.5); freezes mismatched ones")
    w.add_argument("--no-freeze", action="store_true")
    w.add_argument("--config", default=None)
    w.add_argument("--json", action="store_true")
    w.set_defaults(fn=_reconcile_wallets)
