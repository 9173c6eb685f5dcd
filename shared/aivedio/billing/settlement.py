"""Settlement (ch. 20.6.4 to 20.6.6, 20.7.1, 20.7.5, 20.7.8): the consumer of terminal events.

`settle()` applies one TaskSucceeded, TaskFailed, TaskCancelled or TaskMediaIngestFailed event in ONE
transaction, and `settle_many()` a batch of them (the same effects, with set-based statements):

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

import uuid
from dataclasses import dataclass, replace
from datetime import datetime
from decimal import Decimal
from typing import Any, Callable, Literal
from uuid import UUID

import psycopg
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from aivedio import outbox
from aivedio.billing import contract_budgets, lots, policies, refunds
from aivedio.billing.reservations import Closing, InsufficientCredit, close_many, open_allocations, top_up
from aivedio.db.pool import in_transaction
from aivedio.faults import failpoints, safeguards
from aivedio.metrics_catalog import SETTLEMENT_ABSORBED_CREDITS, SETTLEMENT_REPLAYS, SETTLEMENTS
from aivedio.observability import logger, publish
from aivedio.spend import budgets, costs, parked
from aivedio.tasks import TERMINAL

# TaskMediaIngestFailed: the media pipeline's end of a task whose provider succeeded but whose output
# could not be made a playable video (aivedio.media.pipeline); stage MEDIA_DELIVERY_FAILED, priced by
# the policy's rule for it (policies.CHARGED_AS), the provider's cost recorded as for any success.
EVENT_STATES = {"TaskSucceeded": "SUCCEEDED", "TaskFailed": "FAILED", "TaskCancelled": "CANCELLED",
                "TaskMediaIngestFailed": "MEDIA_INGEST_FAILED"}
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
    state: Literal[tuple(sorted(TERMINAL))] | None = None  # the terminal states of aivedio.tasks
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


@dataclass(frozen=True)
class Terminal:
    """One delivery of a terminal event, as settle_many() takes them."""

    payload: dict[str, Any]
    event_type: str | None = None
    event_id: UUID | str | None = None


# The two reads travel together in one round trip. In READ COMMITTED each statement takes a new
# snapshot, so the charges and reservations are read after the wallet locks are granted: never a
# version from before a concurrent settlement of the same task committed. Every writer of a task's
# charge, reservation and allocations holds its wallet's lock, so under that lock they are stable.
# The wallets are locked in one order (wallet_id) by every multi-wallet writer: no deadlock.
LOCK_WALLETS_OF_TASKS = """
select w.* from wallet_account w
 where w.wallet_id in (select wallet_id from credit_reservation where task_id = any(%(task_ids)s::uuid[]))
 order by w.wallet_id
   for update of w
"""

LOAD_CHARGES = f"""
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
       exists (select 1 from budget_reservation b where b.attempt_id = ev.attempt_id and b.state = 'ACTIVE') as budget_active
  from unnest(%(task_ids)s::uuid[], %(attempt_ids)s::uuid[]) as ev(task_id, attempt_id)
  join generation_charge c on c.task_id = ev.task_id
  join credit_reservation r on r.task_id = c.task_id
  join price_book p on p.price_version_id = c.price_version_id
"""

# Only when the fast path finds nothing: which of the task, its reservation or its charge is missing.
DIAGNOSE = """
select t.tenant_id, r.wallet_id, c.task_id as charge_task
  from generation_task t
  left join credit_reservation r on r.task_id = t.task_id
  left join generation_charge c on c.task_id = t.task_id
 where t.task_id = %s
"""

FINALIZE_CHARGES = """
update generation_charge g
   set final_charge_amount = f.amount, finalized_at = %(now)s, settled_outcome = f.outcome, settle_reason = f.reason,
       settle_ledger_txn_id = f.txn, absorbed_amount = f.absorbed, delivered_seconds = f.seconds, settled_attempt_id = f.attempt_id
  from unnest(%(tasks)s::uuid[], %(amounts)s::bigint[], %(outcomes)s::text[], %(reasons)s::text[], %(txns)s::uuid[],
              %(absorbed)s::bigint[], %(seconds)s::int[], %(attempts)s::uuid[])
       as f(task_id, amount, outcome, reason, txn, absorbed, seconds, attempt_id)
 where g.task_id = f.task_id and g.finalized_at is null
"""


@dataclass
class _Plan:
    """One event that settles: what settle_many_in decided for it, before the bulk writes."""

    index: int
    ev: TerminalEvent
    item: Terminal
    state: str
    outcome_key: str
    charge: dict
    wallet: dict
    decision: policies.ChargeDecision
    closing: Closing
    open_before: int

    @property
    def released(self) -> int:
        return self.open_before - self.decision.amount


def settle(conn: psycopg.Connection, payload: dict[str, Any], now: datetime, *, event_type: str | None = None,
           event_id: UUID | str | None = None) -> Settlement:
    """Apply one terminal event, in one transaction (settle_many of one)."""
    return settle_many(conn, [Terminal(payload, event_type, event_id)], now)[0]


def settle_many(conn: psycopg.Connection, items: list[Terminal], now: datetime) -> list[Settlement]:
    """Apply terminal events (an SQS batch, say) in ONE transaction, retried whole on serialization
    failure or deadlock: the same effect as one transaction each, in a handful of statements that
    travel in a pipeline, about three round trips in all. Safe to call any number of times for the
    same events, concurrently too. A failure rolls them all back: the caller may then settle them
    one by one to learn which one fails."""
    with conn.pipeline():
        results = in_transaction(conn, lambda c: settle_many_in(c, items, now))
    failpoints.hit("after-ledger-before-ack")  # the ledger committed; the caller has not acknowledged the messages
    return results


def settle_in(conn: psycopg.Connection, payload: dict[str, Any], now: datetime, *, event_type: str | None = None,
              event_id: UUID | str | None = None) -> Settlement:
    """settle() inside the caller's transaction."""
    return settle_many_in(conn, [Terminal(payload, event_type, event_id)], now)[0]


def settle_many_in(conn: psycopg.Connection, items: list[Terminal], now: datetime) -> list[Settlement]:
    """settle_many() inside the caller's transaction. Results are in the order of `items`."""
    results: list[Settlement | None] = [None] * len(items)
    valid: list[tuple[int, TerminalEvent, str]] = []
    again: list[int] = []  # a second delivery of a task already in this batch: settled after the first
    seen: set[UUID] = set()
    for i, item in enumerate(items):
        ids = _ids(item)
        try:
            ev = TerminalEvent.model_validate(item.payload)
        except ValidationError as e:
            results[i] = _park(conn, "MALFORMED_EVENT", detail=str(e).splitlines()[0], task_id=item.payload.get("task_id"), **ids)
            continue
        state = ev.state or EVENT_STATES.get(item.event_type or "")
        if state is None or (item.event_type in EVENT_STATES and EVENT_STATES[item.event_type] != state):
            results[i] = _park(conn, "MALFORMED_EVENT", detail=f"event {item.event_type} with state {ev.state}",
                               tenant_id=ev.tenant_id, task_id=ev.task_id, attempt_id=ev.attempt_id, **ids)
            continue
        if ev.task_id in seen:
            again.append(i)
            continue
        seen.add(ev.task_id)
        valid.append((i, ev, state))

    plans: list[_Plan] = []

    def write_planned() -> None:
        if plans:
            _write(conn, plans, results, now)
            plans.clear()

    if valid:
        # One round trip: the wallet locks and the locked snapshots.
        args = {"task_ids": [ev.task_id for _, ev, _ in valid], "attempt_ids": [ev.attempt_id for _, ev, _ in valid]}
        wallet_cur = conn.execute(LOCK_WALLETS_OF_TASKS, args)
        charge_cur = conn.execute(LOAD_CHARGES, args)
        wallets = {w["wallet_id"]: w for w in wallet_cur.fetchall()}
        charges = {c["task_id"]: c for c in charge_cur.fetchall()}
        for i, ev, state in valid:
            plan_or_result = _plan(conn, i, items[i], ev, state, charges.get(ev.task_id), wallets, now,
                                   before_top_up=write_planned)
            if isinstance(plan_or_result, Settlement):
                results[i] = plan_or_result
            else:
                plans.append(plan_or_result)
    write_planned()
    if again:  # they now find the first delivery's finalized snapshot, as a redelivery would
        for i, s in zip(again, settle_many_in(conn, [items[i] for i in again], now)):
            results[i] = s
    return results  # type: ignore[return-value]


def _plan(conn: psycopg.Connection, i: int, item: Terminal, ev: TerminalEvent, state: str, charge: dict | None,
          wallets: dict[UUID, dict], now: datetime, *, before_top_up: Callable[[], None]) -> _Plan | Settlement:
    """The checks and the charge decision of one event, or its parked or replayed result. A top-up
    (a POSTPAID excess) is written here, after the settlements planned before it (whose releases it
    may need: the wallet's credit limit is checked by the database on every write)."""
    task_id = ev.task_id
    ids = {**_ids(item), "task_id": task_id, "attempt_id": ev.attempt_id}
    outcome_key = f"{state}/{ev.stage}"
    wallet = wallets.get(charge["wallet_id"]) if charge is not None else None
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
    again = ""  # the business keys' suffix of a settlement made a second time (settlement-idempotency broken)
    if charge["finalized_at"] is not None:
        if charge["settled_outcome"] != outcome_key:
            return _park(conn, "CONFLICTING_TERMINAL", detail=f"settled as {charge['settled_outcome']}, event says {outcome_key}",
                         **ids)
        if not (safeguards.broken("settlement-idempotency") and _reserve_again(conn, charge, wallet, now, before_top_up)):
            publish(SETTLEMENT_REPLAYS, via="snapshot")
            return Settlement("REPLAY", task_id, charged=charge["final_charge_amount"], reason_code=charge["settle_reason"],
                              settle_ledger_txn_id=charge["settle_ledger_txn_id"])
        again = f":again:{uuid.uuid4()}"
    if charge["price_unit"] != wallet["unit_code"]:
        return _park(conn, "CURRENCY_MISMATCH",
                     detail=f"price version in {charge['price_unit']}, wallet in {wallet['unit_code']}", **ids)
    params = charge["normalized_params"] or {}
    if charge["model_rules"] is None:
        return _park(conn, "MISSING_CHARGE", detail=f"model {params.get('model')!r} not in the locked price version", **ids)

    r = {k: charge[k] for k in ("reservation_id", "wallet_id", "tenant_id", "task_id", "reserved_amount", "settled_amount",
                                "released_amount", "refunded_amount", "state")}
    allocations = [{"lot_id": UUID(a["lot_id"]), "open": a["open"]} for a in charge["allocations"]]
    # The wallet dict moves with every settlement planned before this one: the headroom is current.
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
        before_top_up()  # the wallet and its contract budget as the events planned before this one leave them
        room = contract_budgets.headroom(conn, wallet, now)
        if room is not None and room < decision.top_up:  # the contract budget caps the excess too; the platform bears the rest
            decision = policies.decide(replace(snapshot, headroom=max(0, room)), outcome)
    if decision.top_up:
        top_up(conn, wallet=wallet, reservation=r, amount=decision.top_up,
               business_key=f"reserve:generation:{task_id}:topup:settle:{version}{again}", now=now)  # POSTPAID: no lots
    open_before = r["reserved_amount"] - r["settled_amount"] - r["released_amount"]
    closing = Closing(
        wallet=wallet, reservation=r, allocations=allocations, amount=decision.amount,
        settle_key=f"settle:generation:{task_id}:{version}{again}", release_key=f"release:generation:{task_id}:SETTLED_{state}{again}",
        reason_code=decision.reason_code, release_reason=f"SETTLED_{state}",
        metadata={"policy": decision.policy, "rule": decision.rule, "uncapped": decision.uncapped, "absorbed": decision.absorbed,
                  "price_version_id": str(charge["price_version_id"]), "attempt_id": str(ev.attempt_id) if ev.attempt_id else None,
                  "outcome": outcome_key, "notes": list(decision.notes)})
    # Planned now, so the next event of the same wallet sees this one's effect on the balance.
    _preview(wallet, open_before, decision.amount)
    return _Plan(i, ev, item, state, outcome_key, charge, wallet, decision, closing, open_before)


def _reserve_again(conn: psycopg.Connection, charge: dict, wallet: dict, now: datetime, before_top_up: Callable[[], None]) -> bool:
    """The settlement-idempotency safeguard switched off (a chaos run only): a redelivered event is
    settled again instead of replayed. Reserve the first settlement's charge once more (a top-up of
    the closed reservation, under a key of its own) so the settlement that follows charges it a
    second time. False (a replay after all) when it charged nothing or the wallet cannot pay."""
    amount = charge["final_charge_amount"] or 0
    if amount <= 0:
        return False
    before_top_up()  # the wallet as the settlements planned before this one leave it
    reservation = {k: charge[k] for k in ("reservation_id", "task_id", "reserved_amount")}
    try:
        top_up(conn, wallet=wallet, reservation=reservation, amount=amount,
               business_key=f"reserve:generation:{charge['task_id']}:again:{uuid.uuid4()}", now=now)
    except InsufficientCredit:
        return False
    charge["reserved_amount"] = reservation["reserved_amount"]
    charge["allocations"] = [{"lot_id": str(a["lot_id"]), "open": a["open"]}
                             for a in open_allocations(conn, charge["reservation_id"])]
    return True


def _preview(wallet: dict, open_before: int, amount: int) -> None:
    """Move the wallet dict as close_many will (which moves it again from the real postings; this
    preview is undone in _write first)."""
    wallet["available_amount"] += open_before - amount
    wallet["reserved_amount"] -= open_before
    wallet["consumed_amount"] += amount


def _write(conn: psycopg.Connection, plans: list[_Plan], results: list, now: datetime) -> None:
    """The bulk writes of the planned settlements, then what is rare and per event (refunds waiting
    for this settlement, spend budgets), then the provider costs, which await one answer."""
    for p in plans:  # close_many moves the wallet dicts itself
        _preview(p.wallet, -p.open_before, -p.decision.amount)
    close_many(conn, [p.closing for p in plans], now)
    conn.execute(FINALIZE_CHARGES, {
        "now": now, "tasks": [p.ev.task_id for p in plans], "amounts": [p.decision.amount for p in plans],
        "outcomes": [p.outcome_key for p in plans], "reasons": [p.decision.reason_code for p in plans],
        "txns": [p.closing.settle_txn_id for p in plans], "absorbed": [p.decision.absorbed for p in plans],
        "seconds": [p.ev.output_seconds if p.state == "SUCCEEDED" else 0 for p in plans],
        "attempts": [p.ev.attempt_id for p in plans]})
    refunds_done: dict[int, tuple[int, int]] = {}
    for p in plans:
        if p.charge["refunds_pending"]:
            refunds_done[p.index] = refunds.apply_pending(conn, wallet=p.wallet, reservation=p.closing.reservation,
                                                          settle_txn_id=p.closing.settle_txn_id, now=now)
        if p.charge["budget_active"]:  # a spend budget was reserved for this attempt
            usage = p.ev.usage
            if usage is not None and usage.cost_amount is not None and usage.currency:
                budgets.settle_attempt(conn, attempt_id=p.ev.attempt_id, actual=usage.cost_amount, currency=usage.currency, now=now)
            elif not p.ev.provider_charged:
                budgets.release_attempt(conn, attempt_id=p.ev.attempt_id, now=now)
            # billed with an unknown cost: the budget stays reserved until reconciliation knows the cost
    events = []
    for p in plans:
        applied, rejected = refunds_done.get(p.index, (0, 0))
        d, tenant_id, txn = p.decision, p.charge["tenant_id"], p.closing.settle_txn_id
        events.append((p.ev.task_id, tenant_id, {
            "task_id": str(p.ev.task_id), "tenant_id": str(tenant_id), "outcome": p.outcome_key, "charged": d.amount,
            "released": p.released, "absorbed": d.absorbed, "policy": d.policy, "reason_code": d.reason_code,
            "settle_ledger_txn_id": str(txn) if txn else None, "refunds_applied": applied, "refunds_rejected": rejected}))
    outbox.write_events(conn, SETTLED_EVENT, aggregate_type="generation_task", events=events)
    # Last, as it is the one write that awaits an answer: the providers' costs, apart from the price.
    recorded = costs.record_provider_costs(conn, [
        costs.CostReport(payload=p.item.payload, state=p.state, stage=p.ev.stage, tenant_id=p.charge["tenant_id"],
                         task_id=p.ev.task_id, attempt_id=p.ev.attempt_id, provider=p.ev.provider,
                         provider_account=p.ev.provider_account, provider_job_id=p.ev.provider_job_id, charge_id=p.ev.charge_id,
                         provider_charged=p.ev.provider_charged, usage=p.ev.usage, occurred_at=p.ev.finished_at or now,
                         event_type=p.item.event_type, event_id=p.item.event_id) for p in plans])
    settled = []
    for p, cost in zip(plans, recorded):
        d, tenant_id = p.decision, p.charge["tenant_id"]
        applied, rejected = refunds_done.get(p.index, (0, 0))
        publish(SETTLEMENTS, outcome=p.state)
        if d.absorbed:
            publish(SETTLEMENT_ABSORBED_CREDITS, d.absorbed)
        settled.append({"tenant_id": str(tenant_id), "task_id": str(p.ev.task_id),
                        "attempt_id": str(p.ev.attempt_id) if p.ev.attempt_id else None, "outcome": p.outcome_key,
                        "charged": d.amount, "released": p.released, "absorbed": d.absorbed, "policy": d.policy,
                        "cost": cost.status})
        results[p.index] = Settlement("SETTLED", p.ev.task_id, charged=d.amount, released=p.released, absorbed=d.absorbed,
                                      reason_code=d.reason_code, refunds_applied=applied, refunds_rejected=rejected,
                                      settle_ledger_txn_id=p.closing.settle_txn_id)
    # One line per transaction, each task in it with its figures (a log query finds a task_id inside).
    logger.info("tasks settled", extra={"count": len(settled), "tasks": settled})


def _ids(item: Terminal) -> dict[str, Any]:
    return {"payload": item.payload, "event_type": item.event_type, "event_id": item.event_id}


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

# What settlement parks a terminal event for (the _park calls above): while one of these is OPEN for
# a task, with a terminal event type, the task's settlement waits for it (retry_parked, or a person),
# and the repairs (unsettled-terminals, expired-reservations) leave the task alone. The provider
# cost's reasons (spend.costs: COST_UNKNOWN, COST_WITHOUT_CHARGE_ID, COST_MISMATCH, UNMAPPED_ATTEMPT)
# never stop a settlement. CURRENCY_MISMATCH is parked by both; the event type tells a terminal
# event's from a cost orphan-jobs recorded, which carries none.
SETTLEMENT_INPUT_PARKED = ("MALFORMED_EVENT", "UNKNOWN_TASK", "TENANT_MISMATCH", "MISSING_CHARGE", "CURRENCY_MISMATCH",
                           "UNKNOWN_OUTCOME", "CONFLICTING_TERMINAL")
TERMINAL_EVENT_TYPES = tuple(sorted(EVENT_STATES))


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
