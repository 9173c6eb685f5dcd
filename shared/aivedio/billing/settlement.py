"""Settlement (ch. 20.6.4 to 20.6.6, 20.7.1, 20.7.5, 20.7.8): the consumer of terminal events.

`settle()` applies one TaskSucceeded, TaskFailed or TaskCancelled event in ONE transaction:

1. lock the wallet (the lock order of every balance change; every writer of a task's charge,
   reservation and allocations holds it), then read the charge snapshot and the reservation;
2. a redelivered event (the same event id, or the same outcome reported again under another one)
   finds the snapshot finalized and changes nothing (the same outcome is a replay; a different one
   is parked as CONFLICTING_TERMINAL); the ledger's business keys, unique per wallet, are the last
   line behind that;
3. decide the charge with the policy and price version LOCKED at admission (aivedio.billing.policies),
   never today's price;
4. SETTLE the charge (RESERVED -> CONSUMED) from the lots the reservation drew from, and RELEASE the
   rest (RESERVED -> AVAILABLE) back to its original lots with their original expiry;
5. finalize the charge snapshot, record the provider's cost (on the attempt and as a
   provider_cost_event, apart from the user's price), settle the attempt's spend budget, apply any
   refund that was waiting for this settlement, and write TaskSettled to the outbox.

Business keys (ch. 20.8.2): settle:generation:{task_id}:{charge_version},
release:generation:{task_id}:SETTLED_{state}, reserve:generation:{task_id}:topup:settle:{charge_version}.

Input that cannot be applied (an unknown task, a task of another tenant than the event says, no
charge snapshot, an unknown outcome, a price unit other than the wallet's) is parked for
reconciliation in billing_parked_event and acknowledged, never dropped and never retried forever.
A cancellation BEFORE_DISPATCH was already released by admission's cancel: it settles nothing but
still finalizes the snapshot."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, Literal
from uuid import UUID

import psycopg
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from aivedio import outbox
from aivedio.billing import budgets, costs, lots, parked, policies, refunds
from aivedio.billing.reservations import close, top_up
from aivedio.db.pool import in_transaction
from aivedio.observability import logger, metrics

EVENT_STATES = {"TaskSucceeded": "SUCCEEDED", "TaskFailed": "FAILED", "TaskCancelled": "CANCELLED"}
SETTLED_EVENT = "TaskSettled"


class Usage(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    seconds: Decimal | None = None
    cost_amount: Decimal | None = None
    currency: str | None = None


class TerminalEvent(BaseModel):
    """The payload of TaskSucceeded / TaskFailed / TaskCancelled, version 1. Fields a producer may
    leave out (admission's BEFORE_DISPATCH cancel sends only task_id and stage) have defaults."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    task_id: UUID
    tenant_id: UUID | None = None
    attempt_id: UUID | None = None
    state: Literal["SUCCEEDED", "FAILED", "CANCELLED"] | None = None
    stage: str = Field(min_length=1)
    provider: str | None = None
    provider_account: str | None = None
    provider_job_id: str | None = None
    charge_id: str | None = None
    provider_charged: bool = False
    usage: Usage | None = None
    output_seconds: int = Field(default=0, ge=0)
    error_code: str | None = None
    finished_at: datetime | None = None


@dataclass(frozen=True)
class Settlement:
    outcome: str  # SETTLED | REPLAY | PARKED
    task_id: UUID | None = None
    charged: int = 0
    released: int = 0
    absorbed: int = 0
    reason_code: str | None = None
    parked_reason: str | None = None
    refunds_applied: int = 0
    refunds_rejected: int = 0
    settle_ledger_txn_id: UUID | None = None


# The three reads travel together in one round trip. In READ COMMITTED each statement takes a new
# snapshot, so the charge and reservation are read after the wallet lock is granted: never a version
# from before a concurrent settlement of the same task committed. Every writer of a task's charge,
# reservation and allocations holds its wallet's lock, so under that lock they are stable.
LOCK_WALLET_OF_TASK = """
select w.* from wallet_account w
 where w.wallet_id = (select wallet_id from credit_reservation where task_id = %(task_id)s)
   for update
"""

LOAD_CHARGE = f"""
select c.price_version_id, c.normalized_params, c.quoted_amount, c.charge_policy_code, c.charge_version, c.finalized_at,
       c.final_charge_amount, c.settled_outcome, c.settle_reason, c.settle_ledger_txn_id,
       p.rules -> 'models' -> (c.normalized_params ->> 'model') as model_rules, p.currency_or_unit as price_unit,
       r.reservation_id, r.wallet_id, r.tenant_id, r.task_id, r.reserved_amount, r.settled_amount, r.released_amount,
       r.refunded_amount, r.state,
       coalesce((select json_agg(json_build_object('lot_id', a.lot_id, 'open', a.amount - a.settled_amount - a.released_amount)
                                 order by {lots.SPENDING_ORDER})
                   from reservation_allocation a join credit_lot l using (lot_id)
                  where a.reservation_id = r.reservation_id and a.amount - a.settled_amount - a.released_amount > 0),
                '[]'::json) as allocations,
       exists (select 1 from refund_request f where f.task_id = c.task_id and f.state = 'PENDING_SETTLEMENT') as refunds_pending,
       exists (select 1 from budget_reservation b where b.attempt_id = %(attempt_id)s and b.state = 'ACTIVE') as budget_active
  from generation_charge c
  join credit_reservation r on r.task_id = c.task_id
  join price_book p on p.price_version_id = c.price_version_id
 where c.task_id = %(task_id)s
"""

# Only when the fast path finds nothing: which of the task, its reservation or its charge is missing.
DIAGNOSE = """
select t.tenant_id, r.wallet_id, c.task_id as charge_task
  from generation_task t
  left join credit_reservation r on r.task_id = t.task_id
  left join generation_charge c on c.task_id = t.task_id
 where t.task_id = %s
"""

FINALIZE_CHARGE = """
update generation_charge
   set final_charge_amount = %(amount)s, finalized_at = %(now)s, settled_outcome = %(outcome)s, settle_reason = %(reason)s,
       settle_ledger_txn_id = %(txn)s, absorbed_amount = %(absorbed)s, delivered_seconds = %(seconds)s,
       settled_attempt_id = %(attempt_id)s
 where task_id = %(task_id)s and finalized_at is null
"""


def settle(conn: psycopg.Connection, payload: dict[str, Any], now: datetime, *, event_type: str | None = None,
           event_id: UUID | str | None = None) -> Settlement:
    """Apply one terminal event, in one transaction (retried whole on serialization failure or
    deadlock). Safe to call any number of times for the same event, concurrently too. The
    statements travel in a pipeline: about three round trips per settlement."""
    with conn.pipeline():
        return in_transaction(conn, lambda c: settle_in(c, payload, now, event_type=event_type, event_id=event_id))


def settle_in(conn: psycopg.Connection, payload: dict[str, Any], now: datetime, *, event_type: str | None = None,
              event_id: UUID | str | None = None) -> Settlement:
    """settle() inside the caller's transaction."""
    ids: dict[str, Any] = {"payload": payload, "event_type": event_type, "event_id": event_id}
    try:
        ev = TerminalEvent.model_validate(payload)
    except ValidationError as e:
        return _park(conn, "MALFORMED_EVENT", detail=str(e).splitlines()[0], task_id=payload.get("task_id"), **ids)
    task_id = ev.task_id
    # One round trip: the wallet lock and the locked snapshot. No processed_event row is needed: the
    # finalized snapshot (and behind it the ledger's business keys) makes a redelivery a no-op.
    wallet_cur = conn.execute(LOCK_WALLET_OF_TASK, {"task_id": task_id})
    charge_cur = conn.execute(LOAD_CHARGE, {"task_id": task_id, "attempt_id": ev.attempt_id})
    wallet, charge = wallet_cur.fetchone(), charge_cur.fetchone()
    ids.update(task_id=task_id, attempt_id=ev.attempt_id)
    state = ev.state or EVENT_STATES.get(event_type or "")
    if state is None or (event_type in EVENT_STATES and EVENT_STATES[event_type] != state):
        return _park(conn, "MALFORMED_EVENT", detail=f"event {event_type} with state {ev.state}", tenant_id=ev.tenant_id, **ids)
    outcome_key = f"{state}/{ev.stage}"

    if wallet is None or charge is None:
        found = conn.execute(DIAGNOSE, (task_id,)).fetchone()
        if found is None:
            return _park(conn, "UNKNOWN_TASK", tenant_id=ev.tenant_id, **ids)
        if ev.tenant_id is not None and ev.tenant_id != found["tenant_id"]:
            return _park(conn, "TENANT_MISMATCH", tenant_id=ev.tenant_id, detail=f"task belongs to {found['tenant_id']}", **ids)
        return _park(conn, "MISSING_CHARGE", tenant_id=found["tenant_id"],
                     detail="no credit reservation" if found["wallet_id"] is None else "no charge snapshot", **ids)
    tenant_id = charge["tenant_id"]
    if ev.tenant_id is not None and ev.tenant_id != tenant_id:
        return _park(conn, "TENANT_MISMATCH", tenant_id=ev.tenant_id, detail=f"task belongs to {tenant_id}", **ids)
    ids["tenant_id"] = tenant_id
    if charge["finalized_at"] is not None:
        if charge["settled_outcome"] == outcome_key:
            metrics.add("settlement.replay", via="snapshot")
            return Settlement("REPLAY", task_id, charged=charge["final_charge_amount"], reason_code=charge["settle_reason"],
                              settle_ledger_txn_id=charge["settle_ledger_txn_id"])
        return _park(conn, "CONFLICTING_TERMINAL", detail=f"settled as {charge['settled_outcome']}, event says {outcome_key}", **ids)
    if charge["price_unit"] != wallet["unit_code"]:
        return _park(conn, "CURRENCY_MISMATCH",
                     detail=f"price version in {charge['price_unit']}, wallet in {wallet['unit_code']}", **ids)
    params = charge["normalized_params"] or {}
    if charge["model_rules"] is None:
        return _park(conn, "MISSING_CHARGE", detail=f"model {params.get('model')!r} not in the locked price version", **ids)

    r = {k: charge[k] for k in ("reservation_id", "wallet_id", "tenant_id", "task_id", "reserved_amount", "settled_amount",
                                "released_amount", "refunded_amount", "state")}
    allocations = [{"lot_id": UUID(a["lot_id"]), "open": a["open"]} for a in charge["allocations"]]
    headroom = wallet["available_amount"] + (wallet["credit_limit_amount"] if wallet["account_type"] == "POSTPAID" else 0)
    snapshot = policies.ChargeSnapshot(
        policy_code=charge["charge_policy_code"], quoted_amount=charge["quoted_amount"],
        reserved_open=r["reserved_amount"] - r["settled_amount"] - r["released_amount"], model_rules=charge["model_rules"],
        params=params, account_type=wallet["account_type"], headroom=headroom)
    outcome = policies.Outcome(state=state, stage=ev.stage, provider_charged=ev.provider_charged,
                               usage_seconds=ev.usage.seconds if ev.usage else None, output_seconds=ev.output_seconds)
    try:
        decision = policies.decide(snapshot, outcome)
    except (policies.UnknownOutcome, policies.UnknownPolicy) as e:
        return _park(conn, "UNKNOWN_OUTCOME", detail=str(e), **ids)

    version = charge["charge_version"]
    if decision.top_up:
        top_up(conn, wallet=wallet, reservation=r, amount=decision.top_up,
               business_key=f"reserve:generation:{task_id}:topup:settle:{version}", now=now)
    open_before = r["reserved_amount"] - r["settled_amount"] - r["released_amount"]
    settle_txn = close(
        conn, wallet=wallet, reservation=r, allocations=allocations, amount=decision.amount,
        settle_key=f"settle:generation:{task_id}:{version}", release_key=f"release:generation:{task_id}:SETTLED_{state}",
        reason_code=decision.reason_code, release_reason=f"SETTLED_{state}",
        metadata={"policy": decision.policy, "rule": decision.rule, "uncapped": decision.uncapped, "absorbed": decision.absorbed,
                  "price_version_id": str(charge["price_version_id"]), "attempt_id": str(ev.attempt_id) if ev.attempt_id else None,
                  "outcome": outcome_key, "notes": list(decision.notes)})
    conn.execute(FINALIZE_CHARGE, {"amount": decision.amount, "now": now, "outcome": outcome_key, "reason": decision.reason_code,
                                   "txn": settle_txn, "absorbed": decision.absorbed,
                                   "seconds": ev.output_seconds if state == "SUCCEEDED" else 0, "attempt_id": ev.attempt_id,
                                   "task_id": task_id})
    applied = rejected = 0
    if charge["refunds_pending"]:
        applied, rejected = refunds.apply_pending(conn, wallet=wallet, reservation=r, settle_txn_id=settle_txn, now=now)
    released = open_before - decision.amount
    outbox.write_event(conn, SETTLED_EVENT, aggregate_type="generation_task", aggregate_id=task_id, tenant_id=tenant_id,
                       payload={"task_id": str(task_id), "tenant_id": str(tenant_id), "outcome": outcome_key,
                                "charged": decision.amount, "released": released, "absorbed": decision.absorbed,
                                "policy": decision.policy, "reason_code": decision.reason_code,
                                "settle_ledger_txn_id": str(settle_txn) if settle_txn else None,
                                "refunds_applied": applied, "refunds_rejected": rejected})
    if charge["budget_active"]:  # a spend budget was reserved for this attempt
        if ev.usage is not None and ev.usage.cost_amount is not None and ev.usage.currency:
            budgets.settle_attempt(conn, attempt_id=ev.attempt_id, actual=ev.usage.cost_amount, currency=ev.usage.currency, now=now)
        elif not ev.provider_charged:
            budgets.release_attempt(conn, attempt_id=ev.attempt_id, now=now)
        # billed with an unknown cost: the budget stays reserved until reconciliation knows the cost
    # Last, as it is the one write that awaits an answer: the provider's cost, apart from the price.
    cost = costs.record_provider_cost(
        conn, payload=payload, state=state, stage=ev.stage, tenant_id=tenant_id, task_id=task_id,
        attempt_id=ev.attempt_id, provider=ev.provider, provider_account=ev.provider_account,
        provider_job_id=ev.provider_job_id, charge_id=ev.charge_id, provider_charged=ev.provider_charged,
        usage=ev.usage, occurred_at=ev.finished_at or now, event_type=event_type, event_id=event_id)

    metrics.add("settlement.settled", outcome=state)
    if decision.absorbed:
        metrics.add("settlement.absorbed_credits", decision.absorbed)
    logger.info("task settled", extra={"tenant_id": str(tenant_id), "task_id": str(task_id),
                                       "attempt_id": str(ev.attempt_id) if ev.attempt_id else None, "outcome": outcome_key,
                                       "charged": decision.amount, "released": released, "absorbed": decision.absorbed,
                                       "policy": decision.policy, "cost": cost.status})
    return Settlement("SETTLED", task_id, charged=decision.amount, released=released, absorbed=decision.absorbed,
                      reason_code=decision.reason_code, refunds_applied=applied, refunds_rejected=rejected,
                      settle_ledger_txn_id=settle_txn)


def _park(conn: psycopg.Connection, reason: str, *, payload: dict, event_type: str | None, event_id: Any, task_id: Any = None,
          tenant_id: Any = None, attempt_id: Any = None, detail: str | None = None) -> Settlement:
    parked.park(conn, reason=reason, payload=payload, event_type=event_type, event_id=event_id, task_id=task_id,
                tenant_id=tenant_id, attempt_id=attempt_id, detail=detail)
    try:
        tid = UUID(str(task_id)) if task_id is not None else None
    except ValueError:
        tid = None
    return Settlement("PARKED", tid, parked_reason=reason)


RETRYABLE_PARKED = ("UNKNOWN_TASK", "MISSING_CHARGE")


def retry_parked(platform, now: datetime | None = None, limit: int = 100) -> dict:
    """Settle again the parked events whose cause may since have gone (a task or charge snapshot
    that was not visible yet). Each in its own transaction; resolved when it settles or replays."""
    now = now or platform.clock.now()
    with platform.db.connection() as conn:
        items = parked.open_items(conn, reasons=RETRYABLE_PARKED, limit=limit)
    resolved = 0
    for item in items:
        def tx(c, item=item) -> bool:
            s = settle_in(c, item["payload"], now, event_type=item["event_type"])
            if s.outcome in ("SETTLED", "REPLAY"):
                return parked.resolve(c, item["parked_id"], f"settled on retry: {s.outcome}", now)
            return False
        resolved += bool(platform.db.transaction(tx))
    return {"retried": len(items), "resolved": resolved}
