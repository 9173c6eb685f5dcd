"""Compensation (ch. 20.6.7, 20.8.4): goodwill credit the platform adds, separate from refunds.

A REFUND gives back a consumption; a COMPENSATE adds new credit. Each compensation is a case with a
case id, a reason code and evidence. At or below BillingConfig.compensation_dual_approval_above it
is applied when requested; above it, it waits in PENDING_APPROVAL until two distinct approvers,
neither of them the requester, approve it (ch. 20.13.5). The credit arrives as a COMPENSATION lot
(with its own expiry if the case gives one) through a COMPENSATE transaction whose business key is
compensate:{case_id}. Every step is audited; a refused step writes nothing."""
from __future__ import annotations

import json
from datetime import datetime
from uuid import UUID

import psycopg

from aivedio import audit
from aivedio.billing import lots
from aivedio.billing.errors import ApprovalRefused, CompensationInvalid, TaskNotFound, WalletFrozen
from aivedio.billing.ledger import Entry, lock_wallet, post
from aivedio.errors import Conflict, NotFound
from aivedio.metrics_catalog import COMPENSATIONS_APPLIED
from aivedio.observability import logger, publish

# Reason codes are data: a new one is a line here, reviewed like a price change.
REASON_CODES = ("SERVICE_OUTAGE", "QUALITY_ISSUE", "DELAYED_DELIVERY", "BILLING_ERROR", "GOODWILL", "PROMOTION_MAKEGOOD")
MAX_CASE_ID = 128


def request_compensation(conn: psycopg.Connection, *, operator: str, tenant_id: UUID, case_id: str | None, amount: int,
                         reason_code: str, evidence: dict | None, now: datetime, dual_approval_above: int,
                         expires_at: datetime | None = None, task_id: UUID | None = None) -> dict:
    bad = {}
    if not case_id or not str(case_id).strip():
        bad["case_id"] = "required: the support or incident case this compensation answers"
    elif len(case_id) > MAX_CASE_ID:
        bad["case_id"] = f"at most {MAX_CASE_ID} characters"
    if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
        bad["amount"] = "a positive integer of credit units"
    if reason_code not in REASON_CODES:
        bad["reason_code"] = f"one of {', '.join(REASON_CODES)}"
    if not evidence or not isinstance(evidence, dict):
        bad["evidence"] = "required: a JSON object (ticket links, incident ids, screenshots...)"
    if expires_at is not None and expires_at <= now:
        bad["expires_at"] = "must be in the future"
    if bad:
        raise CompensationInvalid("invalid compensation", bad)
    wallet = conn.execute("select wallet_id from wallet_account where tenant_id = %s order by wallet_id limit 1",
                          (tenant_id,)).fetchone()
    if wallet is None:
        raise NotFound(f"tenant {tenant_id} has no wallet")
    if task_id is not None:
        t = conn.execute("select tenant_id from generation_task where task_id = %s", (task_id,)).fetchone()
        if t is None or t["tenant_id"] != tenant_id:
            raise TaskNotFound(f"no task {task_id} of tenant {tenant_id}")
    wallet = lock_wallet(conn, tenant_id, wallet["wallet_id"])
    if wallet["frozen"]:
        raise WalletFrozen(f"wallet frozen: {wallet['freeze_reason'] or 'under review'}")
    prior = conn.execute("select * from compensation_case where tenant_id = %s and case_id = %s for update",
                         (tenant_id, case_id)).fetchone()
    if prior is not None:
        if prior["amount"] != amount or prior["reason_code"] != reason_code:
            raise Conflict(f"case {case_id} exists with another amount or reason", code="COMPENSATION_CASE_EXISTS")
        return _describe(prior, replayed=True)
    required = 2 if amount > dual_approval_above else 1
    case = conn.execute(
        """insert into compensation_case (case_id, tenant_id, wallet_id, amount, reason_code, evidence, state, requested_by,
                                          required_approvals, lot_expires_at, task_id, created_at, updated_at)
           values (%s, %s, %s, %s, %s, %s, 'PENDING_APPROVAL', %s, %s, %s, %s, %s, %s) returning *""",
        (case_id, tenant_id, wallet["wallet_id"], amount, reason_code, json.dumps(evidence), operator, required, expires_at,
         task_id, now, now)).fetchone()
    audit.append(conn, operator=operator, action="compensation.request", target=f"compensation:{case_id}", tenant_id=tenant_id,
                 new={"amount": amount, "reason_code": reason_code, "required_approvals": required, "evidence": evidence})
    if required == 1:
        # At or below the threshold the requester's own permission is the one approval needed.
        case = _apply(conn, wallet=wallet, case=case, now=now, operator=operator)
    return _describe(case)


def approve_compensation(conn: psycopg.Connection, *, operator: str, tenant_id: UUID, case_id: str, now: datetime) -> dict:
    case = conn.execute("select wallet_id from compensation_case where tenant_id = %s and case_id = %s",
                        (tenant_id, case_id)).fetchone()
    if case is None:
        raise NotFound(f"no compensation case {case_id}")
    wallet = lock_wallet(conn, tenant_id, case["wallet_id"])
    case = conn.execute("select * from compensation_case where tenant_id = %s and case_id = %s for update",
                        (tenant_id, case_id)).fetchone()
    if case["state"] != "PENDING_APPROVAL":
        raise ApprovalRefused(f"case {case_id} is {case['state']}", details={"state": case["state"]})
    if wallet["frozen"]:
        raise WalletFrozen(f"wallet frozen: {wallet['freeze_reason'] or 'under review'}")
    approvals = list(case["approvals"])
    if operator == case["requested_by"]:
        raise ApprovalRefused("the requester cannot approve their own compensation")
    if any(a["operator"] == operator for a in approvals):
        raise ApprovalRefused(f"{operator} already approved case {case_id}; a second approver must be someone else")
    approvals.append({"operator": operator, "at": now.isoformat()})
    case = conn.execute(
        "update compensation_case set approvals = %s, updated_at = %s where tenant_id = %s and case_id = %s returning *",
        (json.dumps(approvals), now, tenant_id, case_id)).fetchone()
    audit.append(conn, operator=operator, action="compensation.approve", target=f"compensation:{case_id}", tenant_id=tenant_id,
                 new={"approvals": len(approvals), "required": case["required_approvals"]})
    if len(approvals) >= case["required_approvals"]:
        case = _apply(conn, wallet=wallet, case=case, now=now, operator=operator)
    return _describe(case)


def reject_compensation(conn: psycopg.Connection, *, operator: str, tenant_id: UUID, case_id: str, reason: str,
                        now: datetime) -> dict:
    case = conn.execute("select * from compensation_case where tenant_id = %s and case_id = %s for update",
                        (tenant_id, case_id)).fetchone()
    if case is None:
        raise NotFound(f"no compensation case {case_id}")
    if case["state"] != "PENDING_APPROVAL":
        raise ApprovalRefused(f"case {case_id} is {case['state']}", details={"state": case["state"]})
    case = conn.execute("update compensation_case set state = 'REJECTED', updated_at = %s where tenant_id = %s and case_id = %s returning *",
                        (now, tenant_id, case_id)).fetchone()
    audit.append(conn, operator=operator, action="compensation.reject", target=f"compensation:{case_id}", tenant_id=tenant_id,
                 reason=reason)
    return _describe(case)


def _apply(conn: psycopg.Connection, *, wallet: dict, case: dict, now: datetime, operator: str) -> dict:
    """COMPENSATE: a COMPENSATION lot (AVAILABLE +x, ISSUED -x); POSTPAID wallets, which have no
    lots, get the credit against what they owe."""
    key = f"compensate:{case['case_id']}"
    amount = case["amount"]
    if wallet["account_type"] == "POSTPAID":
        entries = [Entry("AVAILABLE", amount), Entry("ISSUED", -amount)]
    else:
        lot_id = lots.create_lot(conn, wallet=wallet, kind="COMPENSATION", amount=amount, source_business_key=key,
                                 expires_at=case["lot_expires_at"])
        entries = [Entry("AVAILABLE", amount, lot_id), Entry("ISSUED", -amount, lot_id)]
    posted = post(conn, wallet=wallet, business_key=key, event_type="COMPENSATE", entries=entries, task_id=case["task_id"],
                  reason_code=case["reason_code"], metadata={"case_id": case["case_id"], "approvals": case["approvals"],
                                                             "requested_by": case["requested_by"]})
    case = conn.execute(
        """update compensation_case set state = 'APPLIED', ledger_txn_id = %s, updated_at = %s
            where tenant_id = %s and case_id = %s returning *""",
        (posted.ledger_txn_id, now, case["tenant_id"], case["case_id"])).fetchone()
    audit.append(conn, operator=operator, action="compensation.apply", target=f"compensation:{case['case_id']}",
                 tenant_id=case["tenant_id"], new={"amount": amount, "ledger_txn_id": str(posted.ledger_txn_id)})
    publish(COMPENSATIONS_APPLIED)
    logger.info("compensation applied", extra={"tenant_id": str(case["tenant_id"]), "case_id": case["case_id"], "amount": amount})
    return case


def _describe(case: dict, replayed: bool = False) -> dict:
    return {"case_id": case["case_id"], "tenant_id": str(case["tenant_id"]), "amount": case["amount"],
            "reason_code": case["reason_code"], "state": case["state"], "required_approvals": case["required_approvals"],
            "approvals": [a["operator"] for a in case["approvals"]],
            "ledger_txn_id": str(case["ledger_txn_id"]) if case["ledger_txn_id"] else None, "replayed": replayed}
