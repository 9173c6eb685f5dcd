"""Refunds (ch. 20.6.7, 20.7.6): an admin operation that gives back credit a settlement consumed.

- A refund references the task's SETTLE transaction: its REFUND transaction carries
  reversal_of = that SETTLE, and its business key is refund:generation:{task_id}:{refund_id}.
- It may be partial; refunds of a task never add up to more than was settled.
- Each refunded credit goes back to the lot it was consumed from, with that lot's expiry
  (settlement_allocation says which lots): a refund cannot upgrade expiring credit (ch. 20.13.7).
- A refund that arrives before its task is settled waits in PENDING_SETTLEMENT and is applied by
  the settlement transaction itself (apply_pending), or rejected there if the settlement charged
  less than it asks. Money is never given back first and charged after.
- Bad input (an amount over what is settled, another tenant's task, an unknown task, a frozen
  wallet) raises a domain error inside the transaction: nothing is written, not even an audit row.

Callers run each function inside one transaction (platform.db.transaction)."""
from __future__ import annotations

import uuid
from datetime import datetime
from uuid import UUID

import psycopg

from aivedio.admin import rbac
from aivedio.billing import contract_budgets, lots
from aivedio.billing.errors import RefundExceedsSettled, RefundTenantMismatch, TaskNotFound, WalletFrozen
from aivedio.billing.ledger import Entry, lock_wallet, post
from aivedio.billing.reservations import lock_reservation
from aivedio.errors import Conflict, InvalidRequest
from aivedio.observability import logger, metrics

SYSTEM_OPERATOR = "system:settlement"


def request_refund(conn: psycopg.Connection, *, operator: str, tenant_id: UUID, task_id: UUID, amount: int,
                   reason: str, now: datetime, request_key: str | None = None) -> dict:
    """Refund `amount` credits of a task's settled charge, or queue it until the task settles."""
    rbac.require(conn, operator, "refund.create")
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
    charge = conn.execute("select * from generation_charge where task_id = %s for update", (task_id,)).fetchone()
    r = lock_reservation(conn, wallet, task_id)
    pending = conn.execute(
        "select coalesce(sum(amount), 0)::bigint as n from refund_request where task_id = %s and state = 'PENDING_SETTLEMENT'",
        (task_id,)).fetchone()["n"]
    refund_id = uuid.uuid4()
    if charge is None or charge["finalized_at"] is None:
        # Not settled yet: wait for the settlement; never more than could ever be settled.
        ceiling = r["reserved_amount"]
        if pending + amount > ceiling:
            raise RefundExceedsSettled(
                f"refunds of {pending + amount} would exceed the {ceiling} this task can be charged at most",
                details={"reserved": ceiling, "pending": pending, "requested": amount})
        row = _insert(conn, refund_id, tenant_id, task_id, amount, reason, operator, request_key, "PENDING_SETTLEMENT", now)
        rbac.audit(conn, operator=operator, action="refund.request", target=f"task:{task_id}", tenant_id=tenant_id,
                   new={"refund_id": str(refund_id), "amount": amount, "state": "PENDING_SETTLEMENT"}, reason=reason)
        metrics.add("billing.refund_pending")
        return _describe(row)
    refundable = r["settled_amount"] - r["refunded_amount"] - pending
    if amount > refundable or charge["settle_ledger_txn_id"] is None:
        raise RefundExceedsSettled(
            f"refund of {amount} exceeds the {max(0, refundable)} refundable",
            details={"settled": r["settled_amount"], "refunded": r["refunded_amount"], "pending": pending, "requested": amount})
    row = _insert(conn, refund_id, tenant_id, task_id, amount, reason, operator, request_key, "PENDING_SETTLEMENT", now)
    row = _apply(conn, wallet=wallet, reservation=r, refund=row, settle_txn_id=charge["settle_ledger_txn_id"], now=now)
    rbac.audit(conn, operator=operator, action="refund.apply", target=f"task:{task_id}", tenant_id=tenant_id,
               new={"refund_id": str(refund_id), "amount": amount, "refund_ledger_txn_id": str(row["refund_ledger_txn_id"]),
                    "reversal_of": str(charge["settle_ledger_txn_id"])}, reason=reason)
    return _describe(row)


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
            rbac.audit(conn, operator=SYSTEM_OPERATOR, action="refund.apply", target=f"task:{ref['task_id']}",
                       tenant_id=ref["tenant_id"], new={"refund_id": str(ref["refund_id"]), "amount": ref["amount"],
                                                        "refund_ledger_txn_id": str(done["refund_ledger_txn_id"]),
                                                        "reversal_of": str(settle_txn_id)},
                       reason="pending refund applied at settlement")
            applied += 1
        else:
            why = f"settled {reservation['settled_amount']}, already refunded {reservation['refunded_amount']}: {ref['amount']} not refundable"
            conn.execute("update refund_request set state = 'REJECTED', rejected_reason = %s, completed_at = %s where refund_id = %s",
                         (why, now, ref["refund_id"]))
            rbac.audit(conn, operator=SYSTEM_OPERATOR, action="refund.reject", target=f"task:{ref['task_id']}",
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
    metrics.add("billing.refund_applied")
    logger.info("refund applied", extra={"tenant_id": str(refund["tenant_id"]), "task_id": str(refund["task_id"]),
                                         "amount": amount, "refund_id": str(refund["refund_id"])})
    return row


def _describe(row: dict, replayed: bool = False) -> dict:
    return {"refund_id": str(row["refund_id"]), "task_id": str(row["task_id"]), "tenant_id": str(row["tenant_id"]),
            "amount": row["amount"], "state": row["state"],
            "settle_ledger_txn_id": str(row["settle_ledger_txn_id"]) if row["settle_ledger_txn_id"] else None,
            "refund_ledger_txn_id": str(row["refund_ledger_txn_id"]) if row["refund_ledger_txn_id"] else None,
            "replayed": replayed}


def list_refunds(conn: psycopg.Connection, *, tenant_id: UUID, task_id: UUID | None = None) -> list[dict]:
    return conn.execute(
        """select * from refund_request where tenant_id = %s and (%s::uuid is null or task_id = %s)
            order by request_seq""",
        (tenant_id, task_id, task_id)).fetchall()
