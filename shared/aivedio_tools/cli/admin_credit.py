"""`aivedio admin refund|compensation|wallet|ledger|contract-budget|subscription|credits ...`:
customer credit (aivedio.billing). Each write runs in one transaction through the core, which
appends its audit row; a refusal by a money control (an operator's daily refund limit, an approval
refused) is audited too, in a transaction of its own."""
from __future__ import annotations

import json
import sys
from datetime import datetime
from uuid import UUID

from aivedio.billing import allowances, expiry, subscriptions, wallet_checks
from aivedio.billing.compensation import approve_compensation, reject_compensation, request_compensation
from aivedio.billing.contract_budgets import set_contract_budget
from aivedio.billing.corrections import reverse
from aivedio.billing.refunds import approve_refund, list_refunds, reject_refund, request_refund
from aivedio_tools.cli.common import add_common, operator, run, when


def _plain_row(row: dict) -> dict:
    return {k: (str(v) if isinstance(v, (UUID, datetime)) else v) for k, v in row.items()}


# --- refunds ------------------------------------------------------------------------------------------

def _refund_create(args) -> int:
    return run(args, lambda p, c: request_refund(
        c, operator=operator(args), tenant_id=args.tenant_id, task_id=args.task_id, amount=args.amount, reason=args.reason,
        request_key=args.request_key, now=p.clock.now(), dual_approval_above=p.config.billing.refund_dual_approval_above,
        daily_limit=p.config.billing.refund_daily_limit_per_operator), audit_refusal="refund.request")


def _refund_approve(args) -> int:
    return run(args, lambda p, c: approve_refund(c, operator=operator(args), refund_id=args.refund_id, now=p.clock.now(),
                                                 daily_limit=p.config.billing.refund_daily_limit_per_operator),
               audit_refusal="refund.approve")


def _refund_reject(args) -> int:
    return run(args, lambda p, c: reject_refund(c, operator=operator(args), refund_id=args.refund_id, reason=args.reason,
                                                now=p.clock.now()))


def _refund_list(args) -> int:
    return run(args, lambda p, c: [_plain_row(r) for r in list_refunds(c, tenant_id=args.tenant_id, task_id=args.task_id)])


# --- compensation -------------------------------------------------------------------------------------

def _compensation_request(args) -> int:
    try:
        evidence = json.loads(args.evidence) if args.evidence else None
    except json.JSONDecodeError as e:
        sys.stderr.write(f"aivedio: --evidence is not JSON: {e}\n")
        return 2
    return run(args, lambda p, c: request_compensation(
        c, operator=operator(args), tenant_id=args.tenant_id, case_id=args.case_id, amount=args.amount,
        reason_code=args.reason_code, evidence=evidence, now=p.clock.now(), expires_at=args.expires_at, task_id=args.task_id,
        dual_approval_above=p.config.billing.compensation_dual_approval_above))


def _compensation_approve(args) -> int:
    return run(args, lambda p, c: approve_compensation(c, operator=operator(args), tenant_id=args.tenant_id,
                                                       case_id=args.case_id, now=p.clock.now()))


def _compensation_reject(args) -> int:
    return run(args, lambda p, c: reject_compensation(c, operator=operator(args), tenant_id=args.tenant_id,
                                                      case_id=args.case_id, reason=args.reason, now=p.clock.now()))


# --- wallets and the ledger ---------------------------------------------------------------------------

def _wallet_check(args) -> int:
    return run(args, lambda p, c: wallet_checks.check_wallet(c, wallet_id=args.wallet_id, now=p.clock.now(),
                                                             freeze=not args.no_freeze))


def _wallet_rebuild(args) -> int:
    return run(args, lambda p, c: wallet_checks.rebuild(c, operator=operator(args), wallet_id=args.wallet_id,
                                                        now=p.clock.now(), reason=args.reason))


def _wallet_unfreeze(args) -> int:
    return run(args, lambda p, c: wallet_checks.unfreeze(c, operator=operator(args), wallet_id=args.wallet_id,
                                                         now=p.clock.now(), reason=args.reason))


def _wallet_partition(args) -> int:
    return run(args, lambda p, c: allowances.partition(c, operator=operator(args), tenant_id=args.tenant_id,
                                                       slots=args.slots, chunk_amount=args.chunk_amount,
                                                       fast_max_units=args.fast_max_units, reason=args.reason))


def _wallet_unpartition(args) -> int:
    return run(args, lambda p, c: allowances.unpartition(c, operator=operator(args), tenant_id=args.tenant_id,
                                                         reason=args.reason))


def _ledger_reverse(args) -> int:
    return run(args, lambda p, c: reverse(c, operator=operator(args), ledger_txn_id=args.txn_id, reason=args.reason,
                                          now=p.clock.now()))


# --- credit coming in: contract budgets, subscriptions, expiry ------------------------------------------

def _contract_budget_set(args) -> int:
    return run(args, lambda p, c: _plain_row(set_contract_budget(
        c, operator=operator(args), tenant_id=args.tenant_id, period_start=args.period_start, period_end=args.period_end,
        budget_amount=args.amount, reason=args.reason)))


def _subscription_set(args) -> int:
    def fn(p, c):
        row = subscriptions.set_subscription(c, operator=operator(args), tenant_id=args.tenant_id, grant_amount=args.amount,
                                             period_seconds=args.period_seconds,
                                             first_grant_at=args.first_grant_at or p.clock.now())
        return {k: str(v) for k, v in row.items()}
    return run(args, fn)


def _credits_expire(args) -> int:
    def fn(p, _):
        now = p.clock.now()
        return {"subscriptions": subscriptions.grant_due(p, now), "expiry": expiry.sweep(p, now)}
    return run(args, fn, transaction=False)


def _reconcile_wallets(args) -> int:
    return run(args, lambda p, _: wallet_checks.check_all(p, freeze=not args.no_freeze), transaction=False)


# --- parsers ------------------------------------------------------------------------------------------

def register(admin) -> None:
    refund = admin.add_parser("refund", help="refunds of settled charges").add_subparsers(dest="refund_command", required=True)
    c = add_common(refund.add_parser("create", help="refund part or all of a task's settled charge (above the threshold "
                                                    "it waits for `approve` by another operator)"))
    c.add_argument("--tenant-id", required=True, type=UUID)
    c.add_argument("--task-id", required=True, type=UUID)
    c.add_argument("--amount", required=True, type=int, help="credits to refund, at most what the task settled")
    c.add_argument("--reason", required=True)
    c.add_argument("--request-key", required=True, help="idempotency key: the same key never refunds twice")
    c.set_defaults(fn=_refund_create)
    ap = add_common(refund.add_parser("approve", help="a second operator approves a refund above the threshold"))
    ap.add_argument("--refund-id", required=True, type=UUID)
    ap.set_defaults(fn=_refund_approve)
    rj = add_common(refund.add_parser("reject", help="turn down a refund awaiting approval (no money moves)"))
    rj.add_argument("--refund-id", required=True, type=UUID)
    rj.add_argument("--reason", required=True)
    rj.set_defaults(fn=_refund_reject)
    ls = add_common(refund.add_parser("list", help="a tenant's refund requests"))
    ls.add_argument("--tenant-id", required=True, type=UUID)
    ls.add_argument("--task-id", type=UUID, default=None)
    ls.set_defaults(fn=_refund_list)

    comp = admin.add_parser("compensation", help="goodwill credit under approval").add_subparsers(
        dest="compensation_command", required=True)
    r = add_common(comp.add_parser("request", help="open a compensation case (applied at once at or below the threshold)"))
    r.add_argument("--tenant-id", required=True, type=UUID)
    r.add_argument("--case-id", default=None)
    r.add_argument("--amount", required=True, type=int, help="credits to grant")
    r.add_argument("--reason-code", required=True,
                   help="SERVICE_OUTAGE, QUALITY_ISSUE, DELAYED_DELIVERY, BILLING_ERROR, GOODWILL or PROMOTION_MAKEGOOD")
    r.add_argument("--evidence", default=None, help="a JSON object")
    r.add_argument("--expires-at", type=when, default=None, help="when the granted credit expires (default: never)")
    r.add_argument("--task-id", type=UUID, default=None)
    r.set_defaults(fn=_compensation_request)
    for name, fn, extra in (("approve", _compensation_approve, False), ("reject", _compensation_reject, True)):
        a = add_common(comp.add_parser(name, help=f"{name} a compensation case awaiting approval (another operator)"))
        a.add_argument("--tenant-id", required=True, type=UUID)
        a.add_argument("--case-id", required=True)
        if extra:
            a.add_argument("--reason", required=True)
        a.set_defaults(fn=fn)

    wallet = admin.add_parser("wallet", help="wallet checks and repair").add_subparsers(dest="wallet_command", required=True)
    wc = add_common(wallet.add_parser("check", help="snapshot vs ledger vs reservations vs lots; freezes on mismatch"))
    wc.add_argument("--wallet-id", required=True, type=UUID)
    wc.add_argument("--no-freeze", action="store_true", help="report a mismatch without freezing the wallet")
    wc.set_defaults(fn=_wallet_check)
    wr = add_common(wallet.add_parser("rebuild", help="append adjustments, recompute the snapshot, unfreeze if clean"))
    wr.add_argument("--wallet-id", required=True, type=UUID)
    wr.add_argument("--reason", required=True)
    wr.set_defaults(fn=_wallet_rebuild)
    wu = add_common(wallet.add_parser("unfreeze", help="lift a freeze (only when the wallet checks clean)"))
    wu.add_argument("--wallet-id", required=True, type=UUID)
    wu.add_argument("--reason", required=True)
    wu.set_defaults(fn=_wallet_unfreeze)
    wp = add_common(wallet.add_parser("partition", help="a hot wallet: spend allowances carved into slots, so a tenant's "
                                                        "users admit without queueing on one wallet row (ch. 20.11.4)"))
    wp.add_argument("--tenant-id", required=True, type=UUID)
    wp.add_argument("--slots", type=int, default=allowances.DEFAULT_SLOTS, help="2 to 256; each user admits through one")
    wp.add_argument("--chunk-amount", required=True, type=int, help="credits a slot is refilled with at a time")
    wp.add_argument("--fast-max-units", type=int, default=allowances.DEFAULT_FAST_MAX_UNITS,
                    help="a task with more fairness units takes the merged path")
    wp.add_argument("--reason", default=None)
    wp.set_defaults(fn=_wallet_partition)
    wn = add_common(wallet.add_parser("unpartition", help="every allowance back to its lots; one wallet row again"))
    wn.add_argument("--tenant-id", required=True, type=UUID)
    wn.add_argument("--reason", default=None)
    wn.set_defaults(fn=_wallet_unpartition)

    ledger = admin.add_parser("ledger", help="ledger corrections").add_subparsers(dest="ledger_command", required=True)
    lr = add_common(ledger.add_parser("reverse", help="append a reversal (ADJUST with reversal_of) of a "
                                                      "GRANT/COMPENSATE/EXPIRE/ADJUST"))
    lr.add_argument("--txn-id", required=True, type=UUID)
    lr.add_argument("--reason", required=True)
    lr.set_defaults(fn=_ledger_reverse)

    contract = admin.add_parser("contract-budget", help="POSTPAID contract budgets per billing period").add_subparsers(
        dest="contract_budget_command", required=True)
    cs = add_common(contract.add_parser("set", help="a POSTPAID wallet's budget for a period: accrued + reserved + new "
                                                    "<= AMOUNT"))
    cs.add_argument("--tenant-id", required=True, type=UUID)
    cs.add_argument("--amount", required=True, type=int, help="credits")
    cs.add_argument("--period-start", required=True, type=when)
    cs.add_argument("--period-end", required=True, type=when, help="exclusive")
    cs.add_argument("--reason", default=None)
    cs.set_defaults(fn=_contract_budget_set)

    sub = admin.add_parser("subscription", help="subscription grants").add_subparsers(dest="subscription_command",
                                                                                      required=True)
    ss = add_common(sub.add_parser("set", help="grant AMOUNT credits every PERIOD seconds (expiring at the period's end)"))
    ss.add_argument("--tenant-id", required=True, type=UUID)
    ss.add_argument("--amount", required=True, type=int, help="credits granted each period")
    ss.add_argument("--period-seconds", required=True, type=int, help="the period's length, in platform seconds")
    ss.add_argument("--first-grant-at", type=when, default=None, help="the first grant's time (default now)")
    ss.set_defaults(fn=_subscription_set)

    credits = admin.add_parser("credits", help="credit lots").add_subparsers(dest="credits_command", required=True)
    add_common(credits.add_parser("expire", help="run the subscription grants and the expiry sweep now")
               ).set_defaults(fn=_credits_expire)


def register_reconcile(reconcile) -> None:
    """`aivedio reconcile wallets`: every wallet checked (ch. 20.8.5); a mismatched one is frozen."""
    w = add_common(reconcile.add_parser("wallets", help="check every wallet (ch. 20.8.5); freezes mismatched ones"))
    w.add_argument("--no-freeze", action="store_true", help="report mismatches without freezing the wallets")
    w.set_defaults(fn=_reconcile_wallets)
