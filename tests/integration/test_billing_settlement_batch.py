"""A batch of terminal events settled in one transaction (settle_many, the SQS handler's first try)
has exactly the effect of settling them one by one, and a batch that fails writes nothing and
falls back to one record at a time, so only the bad record fails.

The worlds compared are built twice, identically: wallets with several lots, a POSTPAID wallet
whose second task's top-up depends on the first one's (the balance moves inside the batch), a
second delivery and a contradicting one of the same task in the same batch, an unknown task and a
malformed payload."""
from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

from aivedio.billing.ledger import Entry, lock_wallet, post
from aivedio.billing.settlement import Terminal, settle, settle_many
from aivedio.context import set_platform
from aivedio_tools.local.lambda_context import FakeLambdaContext
from tests.billing_support import EVENT_TYPE, T0, add_lot, assert_invariants, make_attempt, make_task, new_wallet, terminal
from tests.integration.test_billing_settlement import envelope, sqs_event

pytestmark = pytest.mark.timeout(120)
NOW = T0 + timedelta(minutes=5)


@pytest.fixture
def p(make_platform):
    platform = make_platform(redis=False, pool_size=4)
    set_platform(platform)
    yield platform
    set_platform(None)


def build_world(p):
    """Wallets, tasks and the batch of terminal events to settle; all positions are stable."""
    prepaid = new_wallet(p, credits=1000)
    postpaid = new_wallet(p, credits=160, account_type="POSTPAID")  # a credit limit of 160
    with p.db.connection() as c, c.transaction():
        add_lot(c, prepaid, 100, kind="PROMOTIONAL", expires_at=T0 + timedelta(days=3))
        full = make_task(c, prepaid, policy="USAGE_BASED")
        partial = make_task(c, prepaid, policy="USAGE_BASED")
        failed = make_task(c, prepaid, policy="SUCCESS_ONLY")
        cancelled = make_task(c, prepaid, policy="SUBMIT_CHARGED")
        post1 = make_task(c, postpaid, policy="USAGE_BASED_POSTPAID")
        post2 = make_task(c, postpaid, policy="USAGE_BASED_POSTPAID")
        attempts = {t: make_attempt(c, prepaid if t in (full, partial, failed, cancelled) else postpaid, t)
                    for t in (full, partial, failed, cancelled, post1, post2)}
    ghost = uuid.uuid4()
    items = [
        (terminal(full, prepaid.tenant_id, attempt_id=attempts[full]), "TaskSucceeded"),
        (terminal(partial, prepaid.tenant_id, attempt_id=attempts[partial], seconds="3.5"), "TaskSucceeded"),
        (terminal(failed, prepaid.tenant_id, attempt_id=attempts[failed], state="FAILED", stage="PROVIDER_FAILED",
                  provider_charged=True), "TaskFailed"),
        (terminal(cancelled, prepaid.tenant_id, attempt_id=attempts[cancelled], state="CANCELLED", stage="PROVIDER_RUNNING",
                  provider_charged=True, cost="0.10"), "TaskCancelled"),
        (terminal(post1, postpaid.tenant_id, attempt_id=attempts[post1], seconds="3.5"), "TaskSucceeded"),
        (terminal(post2, postpaid.tenant_id, attempt_id=attempts[post2], seconds="9"), "TaskSucceeded"),
        (terminal(full, prepaid.tenant_id, attempt_id=attempts[full]), "TaskSucceeded"),  # reported again: a replay
        (terminal(partial, prepaid.tenant_id, attempt_id=attempts[partial], state="FAILED", stage="PROVIDER_FAILED"),
         "TaskFailed"),  # contradicts the first report: parked
        (terminal(ghost, prepaid.tenant_id), "TaskSucceeded"),  # unknown: parked
        ({"task_id": str(full), "stage": ""}, "TaskSucceeded"),  # malformed: parked
    ]
    return (prepaid, postpaid), [Terminal(payload, et, uuid.uuid4()) for payload, et in items]


def outcome_of(s):
    return (s.outcome, s.charged, s.released, s.absorbed, s.parked_reason, s.settle_ledger_txn_id is not None)


def state_of(conn, wallets):
    """What settlement wrote, position by position (ids differ between the two worlds)."""
    out = []
    for w in wallets:
        assert_invariants(conn, w.wallet_id)
        out.append(dict(conn.execute("select available_amount, reserved_amount, consumed_amount from wallet_account where wallet_id = %s",
                                     (w.wallet_id,)).fetchone()))
        out.append([dict(r) for r in conn.execute(
            "select kind, remaining_amount, reserved_amount from credit_lot where wallet_id = %s order by kind", (w.wallet_id,))])
        out.append([dict(r) for r in conn.execute(
            """select event_type, reason_code, (select sum(amount_delta) from ledger_entry e
                                                 where e.ledger_txn_id = t.ledger_txn_id and amount_delta > 0) as moved
                 from ledger_transaction t where wallet_id = %s order by event_type, reason_code, moved""", (w.wallet_id,))])
        out.append(conn.execute(
            """select count(*) filter (where event_type = 'TaskSettled') as settled_events,
                      (select count(*) from provider_cost_event where tenant_id = %s) as costs,
                      (select count(*) from billing_parked_event where tenant_id = %s) as parked,
                      (select count(*) from generation_charge where tenant_id = %s and finalized_at is not null) as finalized
                 from outbox_event where tenant_id = %s""", (w.tenant_id,) * 4).fetchone())
    return out


def test_a_batch_settles_exactly_as_one_by_one(p, conn):
    batch_wallets, batch_items = build_world(p)
    with p.db.connection() as c:
        batched = settle_many(c, batch_items, NOW)
    single_wallets, single_items = build_world(p)
    singles = []
    for item in single_items:
        with p.db.connection() as c:
            singles.append(settle(c, item.payload, NOW, event_type=item.event_type, event_id=item.event_id))

    assert [outcome_of(s) for s in batched] == [outcome_of(s) for s in singles]
    assert [s.outcome for s in batched] == ["SETTLED"] * 6 + ["REPLAY", "PARKED", "PARKED", "PARKED"]
    assert [s.parked_reason for s in batched[7:]] == ["CONFLICTING_TERMINAL", "UNKNOWN_TASK", "MALFORMED_EVENT"]
    # The second POSTPAID task may top up what the first one released within the credit limit (20 + 15).
    assert [(s.charged, s.absorbed) for s in batched[4:6]] == [(55, 0), (105, 5)]
    assert state_of(conn, batch_wallets) == state_of(conn, single_wallets)

    with p.db.connection() as c:  # the whole batch again: replays and the same parkings, no money
        before = state_of(conn, batch_wallets)
        again = settle_many(c, batch_items, NOW)
    assert [s.outcome for s in again[:7]] == ["REPLAY"] * 7
    after = state_of(conn, batch_wallets)
    assert [x for i, x in enumerate(after) if i % 4 != 3] == [x for i, x in enumerate(before) if i % 4 != 3]


def test_a_failing_batch_writes_nothing_and_only_its_bad_record_fails(p, conn):
    from functions.settlement.handler import lambda_handler

    w = new_wallet(p, credits=1000)
    with p.db.connection() as c, c.transaction():
        tasks = [make_task(c, w, policy="USAGE_BASED") for _ in range(3)]
        # The middle task's settle key is taken already (a damaged ledger): its SETTLE cannot be written.
        wallet = lock_wallet(c, w.tenant_id, w.wallet_id)
        post(c, wallet=wallet, business_key=f"settle:generation:{tasks[1]}:1", event_type="ADJUST",
             entries=[Entry("AVAILABLE", 1), Entry("ISSUED", -1)], reason_code="TEST_DAMAGE")
    event = sqs_event(*(envelope(terminal(t, w.tenant_id), EVENT_TYPE["SUCCEEDED"]) for t in tasks))
    with p.db.connection() as c:
        with pytest.raises(Exception):
            settle_many(c, [Terminal(terminal(t, w.tenant_id), "TaskSucceeded") for t in tasks], NOW)
    assert conn.execute("select count(*) as n from generation_charge where tenant_id = %s and finalized_at is not null",
                        (w.tenant_id,)).fetchone()["n"] == 0  # the failed batch wrote nothing

    out = lambda_handler(event, FakeLambdaContext("aivedio-settlement"))
    assert out["batchItemFailures"] == [{"itemIdentifier": event["Records"][1]["messageId"]}]
    finalized = {r["task_id"] for r in conn.execute(
        "select task_id from generation_charge where tenant_id = %s and finalized_at is not null", (w.tenant_id,))}
    assert finalized == {tasks[0], tasks[2]}
    settled = {r["task_id"] for r in conn.execute(
        "select task_id from ledger_transaction where wallet_id = %s and event_type = 'SETTLE'", (w.wallet_id,))}
    assert settled == {tasks[0], tasks[2]}  # (the damage itself, an ADJUST without a lot, leaves the lots one off)
