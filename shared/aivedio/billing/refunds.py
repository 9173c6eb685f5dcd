"""Refunds (ch. 20.6.7, 20.7.6): an admin operation that gives back credit a settlement consumed.

- A refund references the task's SETTLE transaction: its REFUND transaction carries
  reversal_of = that SETTLE, and its business key is refund:generation:{task_id}:{refund_id}.
- It may be partial; refunds of a task never add up to more than was settled.
- Each refunded credit goes back to the lot it was consumed from, with that lot's expiry
  (settlement_allocation says which lots): a refund cannot upgrade expiring credit (ch. 20.13.7).
- A refund that arrives before its task is settled waits in PENDING_SETTLEMENT and is applied by
  the settlement transaction itself (apply_pending), or rejected there if the settlement charged
  less than it asks. Money is never given back first and charged after.
- Money controls (ch. 20.13.5). A refund above BillingConfig.refund_dual_approval_above waits in
  PENDING_APPROVAL, moving no money, until an operator other than its requester approves it
  (approve_refund); it then goes on as above, or is turned down (reject_refund). Each operator may
  refund at most BillingConfig.refund_daily_limit_per_operator credits per UTC day of the platform
  clock: a refund counts against its requester when requested and, if it needs approval, against
  its approver when approved; a rejected refund counts for nobody. The check holds a per-operator
  advisory lock to the end of the transaction, so concurrent refunds by one operator never both
  pass it. Every decision that passes is audited with the limit's figures; one that is refused
  (REFUND_DAILY_LIMIT_EXCEEDED, APPROVAL_REFUSED) writes nothing, as every refused admin operation.
- Bad input (an amount over what is settled, another tenant's task, an unknown task, a frozen
  wallet) raises a domain error inside the transaction: nothing is written, not even an audit row.

Callers run each function inside one transaction (platform.db.transaction)."""
from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from uuid import UUID

import psycopg

from aivedio import audit
from aivedio.billing import contract_budgets, lots
from aivedio.billing.errors import (
    ApprovalRefused,
    RefundDailyLimitExceeded,
    RefundExceedsSettled,
    RefundTenantMismatch,
    TaskNotFound,
    WalletFrozen,
)
from aivedio.billing.ledger import Entry, lock_wallet, post
from aivedio.billing.reservations import lock_reservation
from aivedio.config import BillingConfig
from aivedio.errors import Conflict, InvalidRequest, NotFound
from aivedio.metrics_catalog import REFUNDS
from aivedio.observability import logger, publish

SYSTEM_OPERATOR = "system:settlement"
_DEFAULTS = BillingConfig()  # the knobs a caller does not pass

# What a task's refunds not yet applied hold of its charge: awaiting approval or settlement.
PENDING_OF_TASK = """
select coalesce(sum(amount), 0)::bigint as n from refund_request
 where task_id = %(task_id)s and state in ('PENDING_APPROVAL', 'PENDING_SETTLEMENT')
   and (%(refund_id)s::uuid is null or refund_id <> %(refund_id)s)
"""

# One operator's refunds of one UTC day: requested that day, or approved that day. A rejected
# refund moved no money and counts for nobody.
OPERATOR_DAY_USAGE = """
select coalesce(sum(amount), 0)::bigint as n from refund_request
 where state <> 'REJECTED'
   and ((requested_by = %(operator)s and created_at >= %(start)s and created_at < %(end)s)
        or (approved_by = %(operator)s and approved_at >= %(start)s and approved_at < %(end)s))
"""

# Serialises one operator's limit checks (held until commit or rollback).
LOCK_OPERATOR = "select pg_advisory_xact_lock(hashtextextended(%s, 0))"


def request_refund(conn: psycopg.Connection, *, operator: str, tenant_id: UUID, task_id: UUID, amount: int,
                   reason: str, now: datetime, request_key: str | None = None, dual_approval_above: int | None = None,
                   daily_limit: int | None = None) -> dict:
    """Refund `amount` credits of a task's settled charge, or queue it until the task settles; above
    `dual_approval_above` it waits in PENDING_APPROVAL for approve_refund. Both knobs default to
    BillingConfig's (refund_dual_approval_above, refund_daily_limit_per_operator)."""
    threshold = _DEFAULTS.refund_dual_approval_above if dual_approval_above is None else dual_approval_above
    bad = {}
    if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
        bad["amount"] = "a positive integer of credit units"
    if not reason or not reason.strip():
        bad["reason"] = "required"
    if request_key is not None and not (1 <= len(request_key) <= 200):
        bad["request_key"] = "1 to 200 characters"
    if bad:
        raise InvalidRequest("invalid refund", bad)
    task = conn.execute("select tenant_id from generation_task where task_id = %s", (task_id,)).fetchone()
    if task is None:
        raise TaskNotFound(f"no task {task_id}")
    if task["tenant_id"] != tenant_id:
        raise RefundTenantMismatch(f"task {task_id} does not belong to tenant {tenant_id}")
    res = conn.execute("select wallet_id from credit_reservation where task_id = %s", (task_id,)).fetchone()
    if res is None:
        raise TaskNotFound(f"task {task_id} has no charge to refund")
    wallet = lock_wallet(conn, tenant_id, res["wallet_id"])
    if wallet["frozen"]:
        raise WalletFrozen(f"wallet frozen: {wallet['freeze_reason'] or 'under review'}")
    if request_key is not None:
        prior = conn.execute("select * from refund_request where tenant_id = %s and request_key = %s",
                             (tenant_id, request_key)).fetchone()
        if prior is not None:
            if prior["task_id"] != task_id or prior["amount"] != amount:
                raise Conflict("this refund request key was used for another refund", code="REFUND_KEY_REUSED")
            return _describe(prior, replayed=True)
    charge, r = _lock_charge(conn, wallet, task_id)
    _check_refundable(conn, charge, r, amount)
    limit = _take_daily_limit(conn, operator=operator, amount=amount, now=now, limit=daily_limit)
    refund_id = uuid.uuid4()
    if amount > threshold:
        # Four eyes (ch. 20.13.5): recorded, moving no money, until another operator approves it.
        row = _insert(conn, refund_id, tenant_id, task_id, amount, reason, operator, request_key, "PENDING_APPROVAL", now)
        audit.append(conn, operator=operator, action="refund.request", target=f"task:{task_id}", tenant_id=tenant_id,
                     new={"refund_id": str(refund_id), "amount": amount, "state": "PENDING_APPROVAL",
                          "dual_approval_above": threshold, "daily_limit": limit}, reason=reason)
        publish(REFUNDS, state="awaiting_approval")
        return _describe(row)
    row = _insert(conn, refund_id, tenant_id, task_id, amount, reason, operator, request_key, "PENDING_SETTLEMENT", now)
    if not _settled(charge):
        audit.append(conn, operator=operator, action="refund.request", target=f"task:{task_id}", tenant_id=tenant_id,
                     new={"refund_id": str(refund_id), "amount": amount, "state": "PENDING_SETTLEMENT", "daily_limit": limit},
                     reason=reason)
        publish(REFUNDS, state="pending")
        return _describe(row)
    return _describe(_apply_now(conn, operator=operator, wallet=wallet, reservation=r, charge=charge, refund=row, now=now,
                                limit=limit))


def approve_refund(conn: psycopg.Connection, *, operator: str, refund_id: UUID, now: datetime,
                   daily_limit: int | None = None) -> dict:
    """The second pair of eyes on a PENDING_APPROVAL refund: an operator other than its requester.
    Then it goes on as any refund does: applied now, or PENDING_SETTLEMENT until its task settles.
    The refund counts against the approver's daily limit too. A refund no longer pending approval
    (approved, applied, rejected) is refused: an approval never refunds twice."""
    ref = conn.execute(
        """select f.tenant_id, f.task_id, r.wallet_id from refund_request f join credit_reservation r using (task_id)
            where f.refund_id = %s""", (refund_id,)).fetchone()
    if ref is None:
        raise NotFound(f"no refund {refund_id}", code="REFUND_NOT_FOUND")
    wallet = lock_wallet(conn, ref["tenant_id"], ref["wallet_id"])  # the same lock order as request_refund and settlement
    row = conn.execute("select * from refund_request where refund_id = %s for update", (refund_id,)).fetchone()
    if row["state"] != "PENDING_APPROVAL":
        raise ApprovalRefused(f"refund {refund_id} is {row['state']}, not awaiting approval",
                              details={"state": row["state"], "approved_by": row["approved_by"]})
    if operator == row["requested_by"]:
        raise ApprovalRefused("the requester cannot approve their own refund",
                              details={"requested_by": row["requested_by"]})
    if wallet["frozen"]:
        raise WalletFrozen(f"wallet frozen: {wallet['freeze_reason'] or 'under review'}")
    charge, r = _lock_charge(conn, wallet, row["task_id"])
    _check_refundable(conn, charge, r, row["amount"], refund_id=refund_id)
    limit = _take_daily_limit(conn, operator=operator, amount=row["amount"], now=now, limit=daily_limit)
    row = conn.execute(
        """update refund_request set state = 'PENDING_SETTLEMENT', approved_by = %s, approved_at = %s
            where refund_id = %s and state = 'PENDING_APPROVAL' returning *""",
        (operator, now, refund_id)).fetchone()
    audit.append(conn, operator=operator, action="refund.approve", target=f"task:{row['task_id']}", tenant_id=row["tenant_id"],
                 new={"refund_id": str(refund_id), "amount": row["amount"], "requested_by": row["requested_by"],
                      "state": "COMPLETED" if _settled(charge) else "PENDING_SETTLEMENT", "daily_limit": limit},
                 reason=row["reason"])
    publish(REFUNDS, state="approved")
    if not _settled(charge):
        return _describe(row)
    return _describe(_apply_now(conn, operator=operator, wallet=wallet, reservation=r, charge=charge, refund=row, now=now,
                                limit=limit))


def reject_refund(conn: psycopg.Connection, *, operator: str, refund_id: UUID, reason: str, now: datetime) -> dict:
    """Turn down a PENDING_APPROVAL refund: REJECTED, no money moved. Anything else is refused."""
    if not reason or not reason.strip():
        raise InvalidRequest("invalid rejection", {"reason": "required"})
    row = conn.execute("select * from refund_request where refund_id = %s for update", (refund_id,)).fetchone()
    if row is None:
        raise NotFound(f"no refund {refund_id}", code="REFUND_NOT_FOUND")
    if row["state"] != "PENDING_APPROVAL":
        raise ApprovalRefused(f"refund {refund_id} is {row['state']}, not awaiting approval", details={"state": row["state"]})
    row = conn.execute(
        """update refund_request set state = 'REJECTED', rejected_by = %s, rejected_reason = %s, completed_at = %s
            where refund_id = %s returning *""",
        (operator, reason, now, refund_id)).fetchone()
    audit.append(conn, operator=operator, action="refund.reject", target=f"task:{row['task_id']}", tenant_id=row["tenant_id"],
                 new={"refund_id": str(refund_id), "amount": row["amount"], "requested_by": row["requested_by"],
                      "state": "REJECTED"}, reason=reason)
    return _describe(row)


def _settled(charge: dict | None) -> bool:
    return charge is not None and charge["finalized_at"] is not None


def _lock_charge(conn: psycopg.Connection, wallet: dict, task_id: UUID) -> tuple[dict | None, dict]:
    charge = conn.execute("select * from generation_charge where task_id = %s for update", (task_id,)).fetchone()
    return charge, lock_reservation(conn, wallet, task_id)


def _check_refundable(conn: psycopg.Connection, charge: dict | None, r: dict, amount: int, refund_id: UUID | None = None) -> None:
    """Raise unless `amount` fits beside the task's other open refunds (awaiting approval or
    settlement; `refund_id`'s own excluded): within what is settled and not yet refunded, or, before
    settlement, within the reservation (the most the task can ever be charged)."""
    pending = conn.execute(PENDING_OF_TASK, {"task_id": r["task_id"], "refund_id": refund_id}).fetchone()["n"]
    if not _settled(charge):
        ceiling = r["reserved_amount"]
        if pending + amount > ceiling:
            raise RefundExceedsSettled(
                f"refunds of {pending + amount} would exceed the {ceiling} this task can be charged at most",
                details={"reserved": ceiling, "pending": pending, "requested": amount})
        return
    refundable = r["settled_amount"] - r["refunded_amount"] - pending
    if amount > refundable or charge["settle_ledger_txn_id"] is None:
        raise RefundExceedsSettled(
            f"refund of {amount} exceeds the {max(0, refundable)} refundable",
            details={"settled": r["settled_amount"], "refunded": r["refunded_amount"], "pending": pending, "requested": amount})


def _take_daily_limit(conn: psycopg.Connection, *, operator: str, amount: int, now: datetime, limit: int | None) -> dict:
    """The per-operator daily limit (ch. 20.13.5 "限制单人、单日的操作额度"): what `operator`
    requested (at request time) and approved (at approval time) in the UTC day of `now`, rejected
    refunds aside, plus `amount`, may not pass `limit`. The operator's advisory lock, held to the
    end of the transaction, makes the sum and the write that follows one step, so two concurrent
    refunds by one operator cannot both pass. Returns the decision, for the audit row."""
    limit = _DEFAULTS.refund_daily_limit_per_operator if limit is None else limit
    conn.execute(LOCK_OPERATOR, (f"refund.operator:{operator}",))
    utc = now.astimezone(timezone.utc)
    start = utc.replace(hour=0, minute=0, second=0, microsecond=0)
    used = conn.execute(OPERATOR_DAY_USAGE, {"operator": operator, "start": start, "end": start + timedelta(days=1)}
                        ).fetchone()["n"]
    decision = {"operator": operator, "day": start.date().isoformat(), "used": used, "amount": amount, "limit": limit}
    if used + amount > limit:
        publish(REFUNDS, state="daily_limit_refused")
        logger.warning("refund refused: operator daily limit", extra=decision)
        raise RefundDailyLimitExceeded(
            f"operator {operator} has refunded {used} of {limit} credits on {decision['day']} (UTC); {amount} more would pass it",
            details=decision)
    return decision


def _apply_now(conn: psycopg.Connection, *, operator: str, wallet: dict, reservation: dict, charge: dict, refund: dict,
               now: datetime, limit: dict) -> dict:
    row = _apply(conn, wallet=wallet, reservation=reservation, refund=refund, settle_txn_id=charge["settle_ledger_txn_id"], now=now)
    audit.append(conn, operator=operator, action="refund.apply", target=f"task:{row['task_id']}", tenant_id=row["tenant_id"],
                 new={"refund_id": str(row["refund_id"]), "amount": row["amount"],
                      "refund_ledger_txn_id": str(row["refund_ledger_txn_id"]),
                      "reversal_of": str(charge["settle_ledger_txn_id"]), "requested_by": row["requested_by"],
                      "approved_by": row["approved_by"], "daily_limit": limit}, reason=row["reason"])
    return row


def apply_pending(conn: psycopg.Connection, *, wallet: dict, reservation: dict, settle_txn_id: UUID | None,
                  now: datetime) -> tuple[int, int]:
    """Inside the settlement transaction: apply the task's PENDING_SETTLEMENT refunds in arrival
    order, or reject those the settled amount cannot cover. Returns (applied, rejected)."""
    pending = conn.execute(
        """select * from refund_request where task_id = %s and state = 'PENDING_SETTLEMENT'
            order by request_seq for update""",
        (reservation["task_id"],)).fetchall()
    applied = rejected = 0
    for ref in pending:
        refundable = reservation["settled_amount"] - reservation["refunded_amount"]
        if settle_txn_id is not None and ref["amount"] <= refundable:
            done = _apply(conn, wallet=wallet, reservation=reservation, refund=ref, settle_txn_id=settle_txn_id, now=now)
            audit.append(conn, operator=SYSTEM_OPERATOR, action="refund.apply", target=f"task:{ref['task_id']}",
                         tenant_id=ref["tenant_id"], new={"refund_id": str(ref["refund_id"]), "amount": ref["amount"],
                                                          "refund_ledger_txn_id": str(done["refund_ledger_txn_id"]),
                                                          "reversal_of": str(settle_txn_id)},
                         reason="pending refund applied at settlement")
            applied += 1
        else:
            why = f"settled {reservation['settled_amount']}, already refunded {reservation['refunded_amount']}: {ref['amount']} not refundable"
            conn.execute("update refund_request set state = 'REJECTED', rejected_reason = %s, completed_at = %s where refund_id = %s",
                         (why, now, ref["refund_id"]))
            audit.append(conn, operator=SYSTEM_OPERATOR, action="refund.reject", target=f"task:{ref['task_id']}",
                         tenant_id=ref["tenant_id"], new={"refund_id": str(ref["refund_id"]), "amount": ref["amount"]}, reason=why)
            logger.warning("pending refund rejected at settlement", extra={"tenant_id": str(ref["tenant_id"]),
                                                                           "task_id": str(ref["task_id"]), "reason": why})
            rejected += 1
    return applied, rejected


def _insert(conn, refund_id, tenant_id, task_id, amount, reason, operator, request_key, state, now) -> dict:
    return conn.execute(
        """insert into refund_request (refund_id, tenant_id, task_id, amount, state, reason, requested_by, request_key, created_at)
           values (%s, %s, %s, %s, %s, %s, %s, %s, %s) returning *""",
        (refund_id, tenant_id, task_id, amount, state, reason, operator, request_key, now),
    ).fetchone()


def _apply(conn: psycopg.Connection, *, wallet: dict, reservation: dict, refund: dict, settle_txn_id: UUID,
           now: datetime) -> dict:
    """REFUND: CONSUMED -> AVAILABLE, back to the lots the SETTLE consumed (latest expiry first, so
    the credit most likely to outlive the refund is restored first; each to its own lot)."""
    amount = refund["amount"]
    allocs = conn.execute(
        """select s.lot_id, s.amount - s.refunded_amount as open from settlement_allocation s join credit_lot l using (lot_id)
            where s.ledger_txn_id = %s and s.amount > s.refunded_amount
            order by l.expires_at desc nulls first, l.priority desc, s.lot_id for update of s""",
        (settle_txn_id,)).fetchall()
    parts: list[tuple[UUID, int]] = []
    need = amount
    for a in allocs:
        if need == 0:
            break
        part = min(need, a["open"])
        parts.append((a["lot_id"], part))
        need -= part
    if need and allocs:
        raise RefundExceedsSettled(f"the settlement's lots hold {amount - need} refundable of {amount}")
    entries = ([e for lot_id, part in parts for e in (Entry("CONSUMED", -part, lot_id), Entry("AVAILABLE", part, lot_id))]
               if parts else [Entry("CONSUMED", -amount), Entry("AVAILABLE", amount)])
    posted = post(conn, wallet=wallet, business_key=f"refund:generation:{refund['task_id']}:{refund['refund_id']}",
                  event_type="REFUND", entries=entries, task_id=refund["task_id"],
                  reservation_id=reservation["reservation_id"], reversal_of=settle_txn_id, reason_code="REFUND",
                  metadata={"refund_id": str(refund["refund_id"]), "reason": refund["reason"]})
    if posted.created:
        lots.refund_to_lots(conn, parts)
        if wallet["account_type"] == "POSTPAID":  # a refund lowers the receivable of the period it is made in
            contract_budgets.accrue(conn, now=now, refunded={wallet["wallet_id"]: amount})
        with conn.cursor() as cur:
            cur.executemany(
                "update settlement_allocation set refunded_amount = refunded_amount + %s where ledger_txn_id = %s and lot_id = %s",
                [(part, settle_txn_id, lot_id) for lot_id, part in parts])
        reservation["refunded_amount"] += amount
        reservation["state"] = "REFUNDED" if reservation["refunded_amount"] == reservation["settled_amount"] else "PARTIALLY_REFUNDED"
        conn.execute(
            """update credit_reservation set refunded_amount = %s, state = %s, version = version + 1, updated_at = now()
                where reservation_id = %s""",
            (reservation["refunded_amount"], reservation["state"], reservation["reservation_id"]))
    row = conn.execute(
        """update refund_request set state = 'COMPLETED', settle_ledger_txn_id = %s, refund_ledger_txn_id = %s, completed_at = %s
            where refund_id = %s returning *""",
        (settle_txn_id, posted.ledger_txn_id, now, refund["refund_id"])).fetchone()
    publish(REFUNDS, state="applied")
    logger.info("refund applied", extra={"tenant_id": str(refund["tenant_id"]), "task_id": str(refund["task_id"]),
                                         "amount": amount, "refund_id": str(refund["refund_id"])})
    return row


def _describe(row: dict, replayed: bool = False) -> dict:
    return {"refund_id": str(row["refund_id"]), "task_id": str(row["task_id"]), "tenant_id": str(row["tenant_id"]),
            "amount": row["amount"], "state": row["state"], "requested_by": row["requested_by"],
            "approved_by": row["approved_by"],
            "settle_ledger_txn_id": str(row["settle_ledger_txn_id"]) if row["settle_ledger_txn_id"] else None,
            "refund_ledger_txn_id": str(row["refund_ledger_txn_id"]) if row["refund_ledger_txn_id"] else None,
            "replayed": replayed}


def list_refunds(conn: psycopg.Connection, *, tenant_id: UUID, task_id: UUID | None = None) -> list[dict]:
    return conn.execute(
        """select * from refund_request where tenant_id = %s and (%s::uuid is null or task_id = %s)
            order by request_seq""",
        (tenant_id, task_id, task_id)).fetchall()
