"""Settlement of terminal events on the real PostgreSQL (issue 6, "Settlement consumer", "Bad input").

- a success settles at the locked policy: SETTLE and RELEASE in one transaction, business keys of
  ch. 20.8.2, settlement_allocation per lot, the snapshot finalized, TaskSettled in the outbox, the
  provider's cost on the attempt and as a provider_cost_event; a redelivery (same or new event id)
  adds nothing;
- a price change after admission does not change what a task settles at;
- SETTLE takes the earliest-expiring lots first and RELEASE returns the rest to its original lots,
  whose expiry is unchanged;
- a BEFORE_DISPATCH cancellation (already released by admission's cancel) moves no money;
- failed-but-provider-charged under SUCCESS_ONLY: the user pays nothing, the cost is recorded;
- POSTPAID usage beyond the reservation within the credit limit; a prepaid wallet is capped;
- top-up before an extension, refused when the wallet cannot (nothing written);
- unknown task, another tenant, conflicting second terminal event, malformed payload, a price unit
  other than the wallet's, a provider cost in another currency: parked, never dropped, no money moved;
- the SQS handler reports only the bad record of a batch; the local runtime's consumer settles too."""
from __future__ import annotations

import json
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest

from aivedio import outbox
from aivedio.spend import budgets, costs
from aivedio.billing.ledger import lock_wallet
from aivedio.billing.reservations import InsufficientCredit, lock_reservation, release_remaining, top_up
from aivedio.billing.settlement import settle
from aivedio.config import BillingConfig, ModelPrice, PlatformConfig
from aivedio.context import set_platform
from aivedio.pricing import price_book
from tests.billing_support import (EVENT_TYPE, T0, add_lot, assert_invariants, footprint, make_attempt, make_task, new_wallet,
                                   quote_for, terminal)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def p(make_platform):
    platform = make_platform(redis=False, pool_size=4)
    set_platform(platform)
    yield platform
    set_platform(None)


def run(p, fn):
    return p.db.transaction(fn)


def do_settle(p, payload, *, event_id=None, event_type=None):
    with p.db.connection() as c:
        return settle(c, payload, T0 + timedelta(minutes=5), event_type=event_type or EVENT_TYPE.get(payload.get("state"), "TaskSucceeded"),
                      event_id=event_id or uuid.uuid4())


def ledger_keys(conn, wallet_id):
    return [r["business_key"] for r in conn.execute(
        "select business_key from ledger_transaction where wallet_id = %s order by created_at, business_key", (wallet_id,))]


def test_success_settles_at_the_locked_policy_and_a_redelivery_adds_nothing(p, conn):
    w = new_wallet(p, credits=1000)
    task = run(p, lambda c: make_task(c, w, policy="USAGE_BASED"))
    attempt = run(p, lambda c: make_attempt(c, w, task))
    event_id = uuid.uuid4()
    payload = terminal(task, w.tenant_id, attempt_id=attempt, seconds="3.2", cost="0.16")
    s = do_settle(p, payload, event_id=event_id)
    assert (s.outcome, s.charged, s.released) == ("SETTLED", 52, 18)  # (20 + 10 x 3.2) credits, rest of the 70 released
    keys = ledger_keys(conn, w.wallet_id)
    assert f"settle:generation:{task}:1" in keys and f"release:generation:{task}:SETTLED_SUCCEEDED" in keys
    w_row = assert_invariants(conn, w.wallet_id)
    assert (w_row["available_amount"], w_row["reserved_amount"], w_row["consumed_amount"]) == (948, 0, 52)
    charge = conn.execute("select * from generation_charge where task_id = %s", (task,)).fetchone()
    assert charge["final_charge_amount"] == 52 and charge["finalized_at"] is not None
    assert charge["settled_outcome"] == "SUCCEEDED/PROVIDER_SUCCEEDED" and charge["settled_attempt_id"] == attempt
    assert charge["settle_ledger_txn_id"] == s.settle_ledger_txn_id and charge["delivered_seconds"] == 5
    alloc = conn.execute("select sum(amount) as n from settlement_allocation where ledger_txn_id = %s", (s.settle_ledger_txn_id,)).fetchone()
    assert alloc["n"] == 52
    res = conn.execute("select * from credit_reservation where task_id = %s", (task,)).fetchone()
    assert (res["settled_amount"], res["released_amount"], res["state"]) == (52, 18, "SETTLED")
    a = conn.execute("select actual_cost_amount, actual_cost_currency, estimated_cost_amount from task_attempt where attempt_id = %s",
                     (attempt,)).fetchone()
    assert (a["actual_cost_amount"], a["actual_cost_currency"]) == (Decimal("0.16"), "USD")
    assert a["estimated_cost_amount"] == Decimal("0.25")  # the estimate stays beside the actual
    cost = conn.execute("select * from provider_cost_event where task_id = %s", (task,)).fetchall()
    assert len(cost) == 1 and cost[0]["external_charge_id"] == f"ch-{task}" and cost[0]["event_type"] == "GENERATION"
    settled_events = conn.execute("select payload from outbox_event where event_type = 'TaskSettled' and aggregate_id = %s",
                                  (task,)).fetchall()
    assert len(settled_events) == 1 and settled_events[0]["payload"]["charged"] == 52

    before = footprint(conn, w.tenant_id, w.wallet_id)
    assert do_settle(p, payload, event_id=event_id).outcome == "REPLAY"  # the relay delivered it again
    assert do_settle(p, payload).outcome == "REPLAY"  # the same outcome under a new event id (callback and poll)
    assert footprint(conn, w.tenant_id, w.wallet_id) == before


def test_a_price_change_after_admission_does_not_change_the_settlement(p, conn):
    w = new_wallet(p, credits=1000)
    old_version = price_book.ensure_price_book(conn, PlatformConfig(), T0)
    task = run(p, lambda c: make_task(c, w, policy="USAGE_BASED", price_version_id=old_version))
    # The price doubles after the task was admitted.
    dearer = PlatformConfig(prices={"video-model-x": ModelPrice(base_amount=40, per_second_amount=20)})
    new_version = price_book.ensure_price_book(conn, dearer, T0 + timedelta(seconds=1))
    assert new_version != old_version
    s = do_settle(p, terminal(task, w.tenant_id, seconds="5"))
    assert s.charged == 70  # the locked rules: 20 + 10 x 5, not 40 + 20 x 5
    meta = conn.execute("select metadata from ledger_transaction where business_key = %s", (f"settle:generation:{task}:1",)).fetchone()
    assert meta["metadata"]["price_version_id"] == str(old_version)
    assert_invariants(conn, w.wallet_id)


def test_settle_takes_earliest_expiry_first_and_release_returns_to_the_original_lots(p, conn):
    w = new_wallet(p, credits=0)
    soon, later = T0 + timedelta(days=2), T0 + timedelta(days=30)
    promo = run(p, lambda c: add_lot(c, w, 40, kind="PROMOTIONAL", expires_at=soon))
    paid = run(p, lambda c: add_lot(c, w, 100, kind="PAID", expires_at=later))
    task = run(p, lambda c: make_task(c, w, policy="USAGE_BASED"))  # reserves 70: 40 from promo, 30 from paid
    allocs = {r["lot_id"]: r["amount"] for r in conn.execute(
        "select lot_id, amount from reservation_allocation a join credit_reservation r using (reservation_id) where r.task_id = %s",
        (task,))}
    assert allocs == {promo: 40, paid: 30}
    s = do_settle(p, terminal(task, w.tenant_id, seconds="2"))  # 40 credits
    assert (s.charged, s.released) == (40, 30)
    parts = {r["lot_id"]: r["amount"] for r in conn.execute(
        "select lot_id, amount from settlement_allocation where ledger_txn_id = %s", (s.settle_ledger_txn_id,))}
    assert parts == {promo: 40}  # the credit expiring first was spent
    lots = {r["lot_id"]: r for r in conn.execute("select * from credit_lot where wallet_id = %s", (w.wallet_id,))}
    assert (lots[promo]["remaining_amount"], lots[promo]["reserved_amount"]) == (0, 0)
    assert (lots[paid]["remaining_amount"], lots[paid]["reserved_amount"]) == (100, 0)  # the 30 came back to it
    assert lots[promo]["expires_at"] == soon and lots[paid]["expires_at"] == later  # expiries untouched
    entries = conn.execute(
        """select e.lot_id, e.bucket, e.amount_delta from ledger_entry e join ledger_transaction t using (ledger_txn_id)
            where t.business_key = %s order by e.bucket""", (f"release:generation:{task}:SETTLED_SUCCEEDED",)).fetchall()
    assert {(e["lot_id"], e["bucket"], e["amount_delta"]) for e in entries} == {(paid, "AVAILABLE", 30), (paid, "RESERVED", -30)}
    assert_invariants(conn, w.wallet_id)


def test_a_cancellation_before_dispatch_moves_no_money_and_still_finalizes(p, conn):
    w = new_wallet(p, credits=1000)
    task = run(p, lambda c: make_task(c, w))

    def cancel(c):  # what admission/cancel.py does in its transaction
        wallet = lock_wallet(c, w.tenant_id)
        release_remaining(c, wallet=wallet, task_id=task, reason_code="CANCELLED_BEFORE_DISPATCH")
    run(p, cancel)
    before = conn.execute("select count(*) as n from ledger_transaction where wallet_id = %s", (w.wallet_id,)).fetchone()["n"]
    # The payload admission's cancel writes: task_id and stage only.
    s = do_settle(p, {"task_id": str(task), "stage": "BEFORE_DISPATCH"}, event_type="TaskCancelled")
    assert (s.outcome, s.charged, s.released) == ("SETTLED", 0, 0)
    assert conn.execute("select count(*) as n from ledger_transaction where wallet_id = %s", (w.wallet_id,)).fetchone()["n"] == before
    charge = conn.execute("select final_charge_amount, settled_outcome from generation_charge where task_id = %s", (task,)).fetchone()
    assert (charge["final_charge_amount"], charge["settled_outcome"]) == (0, "CANCELLED/BEFORE_DISPATCH")
    w_row = assert_invariants(conn, w.wallet_id)
    assert (w_row["available_amount"], w_row["consumed_amount"]) == (1000, 0)


@pytest.mark.parametrize("policy,state,stage,charged,expected", [
    ("SUCCESS_ONLY", "FAILED", "PROVIDER_FAILED", True, 0),  # failed but billed: platform's failure cost
    ("SUCCESS_ONLY", "FAILED", "MEDIA_DELIVERY_FAILED", True, 0),  # playable delivery is the promise
    ("SUCCESS_ONLY", "CANCELLED", "PROVIDER_RUNNING", True, 14),  # a cancellation fee: 20 % of 70
    ("SUCCESS_ONLY", "CANCELLED", "PROVIDER_RUNNING", False, 0),
    ("SUBMIT_CHARGED", "FAILED", "PROVIDER_FAILED", True, 70),
    ("SUBMIT_CHARGED", "FAILED", "MEDIA_DELIVERY_FAILED", True, 70),  # charged, delivery is retried
    ("SUBMIT_CHARGED", "FAILED", "SUBMIT_REJECTED", False, 0),
    ("USAGE_BASED", "FAILED", "PROVIDER_FAILED", True, 40),  # 2 s of usage
    ("USAGE_BASED", "FAILED", "PROVIDER_FAILED", False, 0),
    ("USAGE_BASED", "CANCELLED", "BEFORE_SUBMIT", False, 0),
])
def test_failures_and_cancellations_follow_the_locked_policy(p, conn, policy, state, stage, charged, expected):
    w = new_wallet(p, credits=1000)
    task = run(p, lambda c: make_task(c, w, policy=policy))
    attempt = run(p, lambda c: make_attempt(c, w, task))
    s = do_settle(p, terminal(task, w.tenant_id, state=state, stage=stage, attempt_id=attempt, provider_charged=charged,
                              seconds="2", cost="0.10" if charged else "0"))
    assert (s.outcome, s.charged, s.released) == ("SETTLED", expected, 70 - expected)
    w_row = assert_invariants(conn, w.wallet_id)
    assert (w_row["available_amount"], w_row["consumed_amount"]) == (1000 - expected, expected)
    cost = conn.execute("select amount, event_type from provider_cost_event where task_id = %s", (task,)).fetchall()
    if charged:
        kind = "GENERATION" if stage == "MEDIA_DELIVERY_FAILED" else {"FAILED": "FAILED_CHARGE", "CANCELLED": "CANCELLATION_FEE"}[state]
        assert [(c["amount"], c["event_type"]) for c in cost] == [(Decimal("0.10"), kind)]  # the cost, apart from the price
    else:
        assert cost == []


def test_postpaid_usage_beyond_the_reservation_within_the_credit_limit(p, conn):
    post = new_wallet(p, credits=100, account_type="POSTPAID")  # credit limit 100
    task = run(p, lambda c: make_task(c, post, policy="USAGE_BASED_POSTPAID"))  # reserves 70
    s = do_settle(p, terminal(task, post.tenant_id, seconds="9"))  # 20 + 90 = 110 credits
    assert (s.charged, s.absorbed) == (100, 10)  # 30 more within the limit of 100; 10 beyond it borne by the platform
    w = assert_invariants(conn, post.wallet_id)
    assert (w["available_amount"], w["consumed_amount"]) == (-100, 100)
    assert conn.execute("select count(*) as n from ledger_transaction where business_key = %s",
                        (f"reserve:generation:{task}:topup:settle:1",)).fetchone()["n"] == 1
    pre = new_wallet(p, credits=1000)
    task2 = run(p, lambda c: make_task(c, pre, policy="USAGE_BASED_POSTPAID"))
    s2 = do_settle(p, terminal(task2, pre.tenant_id, seconds="9"))
    assert (s2.charged, s2.absorbed) == (70, 40)  # a prepaid wallet pays at most what it reserved
    assert conn.execute("select absorbed_amount from generation_charge where task_id = %s", (task2,)).fetchone()["absorbed_amount"] == 40
    assert_invariants(conn, pre.wallet_id)


def test_top_up_before_an_extension_and_its_refusal(p, conn):
    w = new_wallet(p, credits=100)
    task = run(p, lambda c: make_task(c, w, policy="USAGE_BASED_TOP_UP"))  # 70 of 100 reserved

    def extend(amount, n):
        def tx(c):
            wallet = lock_wallet(c, w.tenant_id)
            r = lock_reservation(c, wallet, task)
            return top_up(c, wallet=wallet, reservation=r, amount=amount, business_key=f"reserve:generation:{task}:topup:{n}", now=T0)
        return tx

    run(p, extend(20, 1))
    run(p, extend(20, 1))  # a retried top-up adds nothing
    before = footprint(conn, w.tenant_id, w.wallet_id)
    with pytest.raises(InsufficientCredit):
        run(p, extend(20, 2))  # only 10 left: the extension is refused
    assert footprint(conn, w.tenant_id, w.wallet_id) == before
    s = do_settle(p, terminal(task, w.tenant_id, seconds="8"))  # 100 credits asked, 90 reserved
    assert (s.charged, s.absorbed) == (90, 10)
    w_row = assert_invariants(conn, w.wallet_id)
    assert (w_row["available_amount"], w_row["consumed_amount"]) == (10, 90)


def parked_rows(conn, task_id=None):
    return conn.execute("select * from billing_parked_event where (%s::uuid is null or task_id = %s) order by created_at",
                        (task_id, task_id)).fetchall()


def test_an_unknown_task_is_parked_not_dropped_and_parked_once(p, conn):
    ghost = uuid.uuid4()
    payload = terminal(ghost, uuid.uuid4())
    assert do_settle(p, payload).outcome == "PARKED"
    assert do_settle(p, payload).outcome == "PARKED"
    rows = parked_rows(conn, ghost)
    assert len(rows) == 1 and rows[0]["reason"] == "UNKNOWN_TASK" and rows[0]["status"] == "OPEN"
    assert rows[0]["payload"]["task_id"] == str(ghost)


def test_bad_terminal_events_are_parked_and_move_no_money(p, conn):
    w = new_wallet(p, credits=1000)
    other = new_wallet(p, credits=1000)
    task = run(p, lambda c: make_task(c, w))
    before = footprint(conn, w.tenant_id, w.wallet_id)
    assert do_settle(p, terminal(task, other.tenant_id)).parked_reason == "TENANT_MISMATCH"
    assert do_settle(p, {"task_id": str(task), "stage": ""}, event_type="TaskSucceeded").parked_reason == "MALFORMED_EVENT"
    assert do_settle(p, {**terminal(task, w.tenant_id), "state": "FAILED"}, event_type="TaskSucceeded").parked_reason == "MALFORMED_EVENT"
    assert do_settle(p, terminal(task, w.tenant_id, state="FAILED", stage="EXPLODED")).parked_reason == "UNKNOWN_OUTCOME"
    after = footprint(conn, w.tenant_id, w.wallet_id)
    assert after["wallet"] == before["wallet"] and after["reservations"] == before["reservations"]
    assert after["ledger_transaction"] == before["ledger_transaction"]
    assert {r["reason"] for r in parked_rows(conn, task)} == {"TENANT_MISMATCH", "MALFORMED_EVENT", "UNKNOWN_OUTCOME"}
    # The task still settles when its real event comes.
    assert do_settle(p, terminal(task, w.tenant_id)).charged == 70


def test_a_second_contradicting_terminal_event_is_parked(p, conn):
    w = new_wallet(p, credits=1000)
    task = run(p, lambda c: make_task(c, w))
    assert do_settle(p, terminal(task, w.tenant_id)).charged == 70
    before = footprint(conn, w.tenant_id, w.wallet_id)
    s = do_settle(p, terminal(task, w.tenant_id, state="FAILED", stage="PROVIDER_FAILED", provider_charged=False, cost=None,
                              seconds=None))
    assert s.parked_reason == "CONFLICTING_TERMINAL"
    after = footprint(conn, w.tenant_id, w.wallet_id)
    assert after["wallet"] == before["wallet"] and after["ledger_transaction"] == before["ledger_transaction"]


def test_a_price_unit_other_than_the_wallets_is_rejected_never_summed(p, conn):
    w = new_wallet(p, credits=1000)
    task = run(p, lambda c: make_task(c, w))
    usd = conn.execute(
        """insert into price_book (product_code, effective_from, currency_or_unit, rules, status)
           values ('video-generation-usd', %s, 'USD', %s, 'ACTIVE') returning price_version_id""",
        (T0, json.dumps(price_book.default_rules(PlatformConfig())))).fetchone()["price_version_id"]
    conn.execute("update generation_charge set price_version_id = %s where task_id = %s", (usd, task))
    before = footprint(conn, w.tenant_id, w.wallet_id)
    s = do_settle(p, terminal(task, w.tenant_id))
    assert s.parked_reason == "CURRENCY_MISMATCH"
    after = footprint(conn, w.tenant_id, w.wallet_id)
    assert after["wallet"] == before["wallet"] and after["reservations"] == before["reservations"]
    assert conn.execute("select finalized_at from generation_charge where task_id = %s", (task,)).fetchone()["finalized_at"] is None


def test_provider_costs_that_cannot_be_matched_are_parked_for_reconciliation(p, conn):
    w = new_wallet(p, credits=1000)
    # a cost in another currency than the one already on the attempt
    t1 = run(p, lambda c: make_task(c, w))
    a1 = run(p, lambda c: make_attempt(c, w, t1))
    conn.execute("update task_attempt set actual_cost_amount = 0.25, actual_cost_currency = 'EUR' where attempt_id = %s", (a1,))
    s = do_settle(p, terminal(t1, w.tenant_id, attempt_id=a1, cost="0.25", currency="USD"))
    assert s.charged == 70  # the user's settlement does not depend on the provider's cost
    assert {r["reason"] for r in parked_rows(conn, t1)} == {"CURRENCY_MISMATCH"}
    assert conn.execute("select actual_cost_currency from task_attempt where attempt_id = %s", (a1,)).fetchone()["actual_cost_currency"] == "EUR"
    # a cost without a charge id: a conservative composite key, and reconciliation decides
    t2 = run(p, lambda c: make_task(c, w))
    do_settle(p, terminal(t2, w.tenant_id, charge_id=None, job_id="job-x2"))
    assert {r["reason"] for r in parked_rows(conn, t2)} == {"COST_WITHOUT_CHARGE_ID", "UNMAPPED_ATTEMPT"}
    assert conn.execute("select external_charge_id from provider_cost_event where task_id = %s", (t2,)).fetchone()[
        "external_charge_id"] == "composite:job-x2"
    # billed, cost unknown
    t3 = run(p, lambda c: make_task(c, w))
    a3 = run(p, lambda c: make_attempt(c, w, t3))
    do_settle(p, terminal(t3, w.tenant_id, attempt_id=a3, state="FAILED", stage="PROVIDER_FAILED", provider_charged=True,
                          cost=None, seconds=None))
    assert {r["reason"] for r in parked_rows(conn, t3)} == {"COST_UNKNOWN"}
    assert_invariants(conn, w.wallet_id)


def test_settlement_settles_the_attempts_spend_budget(p, conn):
    w = new_wallet(p, credits=1000)
    task = run(p, lambda c: make_task(c, w))
    attempt = run(p, lambda c: make_attempt(c, w, task))
    budget = conn.execute(
        """insert into budget_account (scope_type, scope_id, period_start, period_end, limit_amount, currency)
           values ('GLOBAL', '*', %s, %s, 100, 'USD') returning budget_id""", (T0 - timedelta(days=1), T0 + timedelta(days=1))
    ).fetchone()["budget_id"]
    run(p, lambda c: budgets.reserve(c, scopes=[("GLOBAL", "*")], amount=Decimal("0.25"), currency="USD",
                                     business_key=f"provider-budget-reserve:{attempt}", now=T0, config=BillingConfig(),
                                     attempt_id=attempt, task_id=task))
    do_settle(p, terminal(task, w.tenant_id, attempt_id=attempt, cost="0.30"))
    b = conn.execute("select reserved_amount, consumed_amount from budget_account where budget_id = %s", (budget,)).fetchone()
    assert (b["reserved_amount"], b["consumed_amount"]) == (Decimal(0), Decimal("0.30"))


def sqs_event(*bodies: str) -> dict:
    return {"Records": [{"messageId": str(uuid.uuid4()), "receiptHandle": "r", "body": b, "attributes": {}, "messageAttributes": {},
                         "md5OfBody": "", "eventSource": "aws:sqs", "eventSourceARN": "arn:aws:sqs:local:1:aivedio-settlement",
                         "awsRegion": "local"} for b in bodies]}


def envelope(payload: dict, event_type: str, event_id=None) -> str:
    return json.dumps({"event_id": str(event_id or uuid.uuid4()), "event_type": event_type, "version": 1,
                       "aggregate_type": "generation_task", "aggregate_id": payload["task_id"], "tenant_id": payload.get("tenant_id"),
                       "payload": payload, "created_at": T0.isoformat()})


def test_the_sqs_handler_reports_only_the_bad_record(p, conn):
    from functions.settlement.handler import lambda_handler
    from aivedio_tools.local.lambda_context import FakeLambdaContext

    w = new_wallet(p, credits=1000)
    task = run(p, lambda c: make_task(c, w))
    good = envelope(terminal(task, w.tenant_id), "TaskSucceeded")
    event = sqs_event(good, good, "{not json")
    out = lambda_handler(event, FakeLambdaContext("aivedio-settlement"))
    assert out["batchItemFailures"] == [{"itemIdentifier": event["Records"][2]["messageId"]}]
    assert_invariants(conn, w.wallet_id)
    assert conn.execute("select count(*) as n from ledger_transaction where business_key = %s",
                        (f"settle:generation:{task}:1",)).fetchone()["n"] == 1
    # The sample event names a task this database never saw: parked and acknowledged.
    with open("events/settlement.json") as f:
        sample = json.load(f)
    assert lambda_handler(sample, FakeLambdaContext("aivedio-settlement"))["batchItemFailures"] == []
    assert parked_rows(conn, uuid.UUID(json.loads(sample["Records"][0]["body"])["payload"]["task_id"]))[0]["reason"] == "UNKNOWN_TASK"


def test_the_local_runtime_delivers_terminal_events_to_settlement(p, conn):
    from aivedio import events_routing
    from aivedio_tools.local.runtime import sqs_consumer

    assert events_routing.consumers()["settlement"] == ("TaskSucceeded", "TaskFailed", "TaskCancelled", "TaskMediaIngestFailed")
    w = new_wallet(p, credits=1000)
    task = run(p, lambda c: make_task(c, w))
    run(p, lambda c: outbox.write_event(c, "TaskFailed", aggregate_type="generation_task", aggregate_id=task, tenant_id=w.tenant_id,
                                        payload=terminal(task, w.tenant_id, state="FAILED", stage="PROVIDER_FAILED",
                                                         provider_charged=False, cost=None, seconds=None)))
    deliver = sqs_consumer("functions.settlement.handler")
    delivered = []
    outbox.relay_once(p, lambda env: (delivered.append(env), deliver(env)) if env["event_type"] == "TaskFailed" else None)
    assert delivered
    w_row = assert_invariants(conn, w.wallet_id)
    assert (w_row["available_amount"], w_row["reserved_amount"]) == (1000, 0)
    assert conn.execute("select settled_outcome from generation_charge where task_id = %s", (task,)).fetchone()[
        "settled_outcome"] == "FAILED/PROVIDER_FAILED"


def test_quote_helper_matches_the_price_book():
    assert quote_for(5) == 70 and quote_for(Decimal("3.2")) == 52
    assert costs.COST_EVENT_TYPE["CANCELLED"] == "CANCELLATION_FEE"
