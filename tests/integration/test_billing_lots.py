"""Credit lots on the real PostgreSQL (issue 6, "Credit lots", "Ledger"), with a ManualClock for exact
boundary timestamps.

- a lot is spendable until one microsecond before expires_at and not at expires_at; the sweep at
  expires_at - 1 us books nothing, the sweep at expires_at books EXPIRE for exactly what is left,
  and a second sweep adds nothing;
- credit reserved when its lot expires is not expired; released afterwards it returns to that lot
  under its original expiry, and the next sweep expires it: reserving never extends a lot's life;
- a subscription wallet is granted once per period, at the period's start to the microsecond, as a
  lot expiring at the period's end; a missed period is skipped;
- the scheduled credit_expiry handler runs grants, the sweep and the parked-settlement retry;
- corrections are appended reversals carrying reversal_of, at most once, refused for a SETTLE
  and for credit already spent (nothing written)."""
from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest

from aivedio.billing import expiry, subscriptions
from aivedio.billing.corrections import reverse
from aivedio.billing.errors import CorrectionRefused
from aivedio.billing.ledger import lock_wallet
from aivedio.billing.lots import LotsExhausted
from aivedio.billing.reservations import release_remaining
from aivedio.billing.settlement import settle
from aivedio.config import ManualClock
from aivedio.context import set_platform
from tests.billing_support import ADMIN, T0, add_lot, assert_invariants, footprint, make_task, new_wallet, terminal

pytestmark = pytest.mark.timeout(120)
US = timedelta(microseconds=1)
EXPIRES = T0 + timedelta(days=7)


@pytest.fixture
def clock():
    return ManualClock(T0)


@pytest.fixture
def p(make_platform, clock):
    platform = make_platform(redis=False, pool_size=4, clock=clock)
    set_platform(platform)
    yield platform
    set_platform(None)


def lot_row(conn, lot_id):
    return conn.execute("select * from credit_lot where lot_id = %s", (lot_id,)).fetchone()


def expire_txns(conn, wallet_id):
    return conn.execute("""select t.business_key, e.amount_delta from ledger_transaction t join ledger_entry e using (ledger_txn_id)
                            where t.wallet_id = %s and t.event_type = 'EXPIRE' and e.bucket = 'EXPIRED' order by t.created_at""",
                        (wallet_id,)).fetchall()


def test_expiry_at_the_exact_boundary(p, conn, clock):
    w = new_wallet(p, credits=0)
    lot = p.db.transaction(lambda c: add_lot(c, w, 100, expires_at=EXPIRES))
    clock._now = EXPIRES - US
    assert expiry.sweep(p)["credits_expired"] == 0  # one microsecond before: still alive
    task = p.db.transaction(lambda c: make_task(c, w, now=clock.now(), reserve_amount=10, quoted=10))  # and spendable
    assert lot_row(conn, lot)["reserved_amount"] == 10
    clock._now = EXPIRES
    before = footprint(conn, w.tenant_id, w.wallet_id)
    with pytest.raises(LotsExhausted):  # at expires_at it can no longer be reserved
        p.db.transaction(lambda c: make_task(c, w, now=clock.now(), reserve_amount=10, quoted=10))
    assert footprint(conn, w.tenant_id, w.wallet_id) == before
    out = expiry.sweep(p)
    assert out == {"wallets": 1, "credits_expired": 90, "failed_wallets": 0}
    row = lot_row(conn, lot)
    assert (row["remaining_amount"], row["reserved_amount"], row["expired_amount"]) == (0, 10, 90)
    assert [(r["business_key"], r["amount_delta"]) for r in expire_txns(conn, w.wallet_id)] == [(f"expire:lot:{lot}:0", 90)]
    assert expiry.sweep(p)["credits_expired"] == 0  # a second sweep adds nothing
    w_row = assert_invariants(conn, w.wallet_id)
    assert (w_row["available_amount"], w_row["reserved_amount"]) == (0, 10)

    # The reserved 10 outlived the lot; released later it returns to the lot, under the lot's expiry...
    clock.advance(3600)

    def cancel(c):
        wallet = lock_wallet(c, w.tenant_id)
        release_remaining(c, wallet=wallet, task_id=task, reason_code="CANCELLED_BEFORE_DISPATCH")
    p.db.transaction(cancel)
    row = lot_row(conn, lot)
    assert (row["remaining_amount"], row["reserved_amount"], row["expires_at"]) == (10, 0, EXPIRES)
    with pytest.raises(LotsExhausted):  # ...so it is not spendable again
        p.db.transaction(lambda c: make_task(c, w, now=clock.now(), reserve_amount=10, quoted=10))
    assert expiry.sweep(p)["credits_expired"] == 10  # and the next sweep expires it
    assert [r["business_key"] for r in expire_txns(conn, w.wallet_id)] == [f"expire:lot:{lot}:0", f"expire:lot:{lot}:90"]
    w_row = assert_invariants(conn, w.wallet_id)
    assert (w_row["available_amount"], w_row["reserved_amount"]) == (0, 0)


def test_lots_without_expiry_and_other_wallets_are_untouched(p, conn, clock):
    w = new_wallet(p, credits=50)  # a PAID lot without expiry
    other = new_wallet(p, credits=0)
    p.db.transaction(lambda c: add_lot(c, other, 30, expires_at=EXPIRES + timedelta(days=1)))
    p.db.transaction(lambda c: add_lot(c, w, 20, expires_at=EXPIRES))
    clock._now = EXPIRES + timedelta(hours=1)
    assert expiry.sweep(p)["credits_expired"] == 20
    assert assert_invariants(conn, w.wallet_id)["available_amount"] == 50
    assert assert_invariants(conn, other.wallet_id)["available_amount"] == 30


def test_a_settled_then_refunded_credit_keeps_its_expiry(p, conn, clock):
    from aivedio.billing.refunds import request_refund

    w = new_wallet(p, credits=0)
    lot = p.db.transaction(lambda c: add_lot(c, w, 100, expires_at=EXPIRES))
    task = p.db.transaction(lambda c: make_task(c, w, policy="SUCCESS_ONLY"))
    with p.db.connection() as c:
        settle(c, terminal(task, w.tenant_id), T0, event_type="TaskSucceeded", event_id=uuid.uuid4())
    clock._now = EXPIRES + US
    expiry.sweep(p)
    p.db.transaction(lambda c: request_refund(c, operator=ADMIN, tenant_id=w.tenant_id, task_id=task, amount=70, reason="x",
                                              now=clock.now(), request_key="r1"))
    assert lot_row(conn, lot)["remaining_amount"] == 70  # back to its lot, which has expired...
    assert expiry.sweep(p)["credits_expired"] == 70  # ...so it expires, not turned into lasting credit
    assert assert_invariants(conn, w.wallet_id)["available_amount"] == 0


def test_subscription_grants_once_per_period_at_the_exact_start(p, conn, clock):
    w = new_wallet(p, credits=0, account_type="SUBSCRIPTION")
    day = 86400
    start = T0 + timedelta(hours=1)
    p.db.transaction(lambda c: subscriptions.set_subscription(c, operator=ADMIN, tenant_id=w.tenant_id, grant_amount=300,
                                                              period_seconds=30 * day, first_grant_at=start))
    clock._now = start - US
    assert subscriptions.grant_due(p)["credits_granted"] == 0
    clock._now = start
    assert subscriptions.grant_due(p)["credits_granted"] == 300
    assert subscriptions.grant_due(p)["credits_granted"] == 0  # granted once
    lot = conn.execute("select * from credit_lot where wallet_id = %s and kind = 'SUBSCRIPTION'", (w.wallet_id,)).fetchone()
    assert (lot["original_amount"], lot["expires_at"]) == (300, start + timedelta(days=30))
    assert lot["source_business_key"] == f"grant:subscription:{w.wallet_id}:{start.isoformat()}"
    # The sweep at the period's end expires what is left; the next period's grant comes at that instant.
    clock._now = start + timedelta(days=30)
    assert subscriptions.grant_due(p)["credits_granted"] == 300
    expiry.sweep(p)
    assert [r["amount_delta"] for r in expire_txns(conn, w.wallet_id)] == [300]
    assert assert_invariants(conn, w.wallet_id)["available_amount"] == 300
    # Two periods pass unseen: the one that ended is skipped, the current one granted.
    clock._now = start + timedelta(days=90, seconds=1)
    assert subscriptions.grant_due(p)["credits_granted"] == 300
    assert conn.execute("select next_grant_at from wallet_subscription where wallet_id = %s", (w.wallet_id,)).fetchone()[
        "next_grant_at"] == start + timedelta(days=120)
    assert conn.execute("select count(*) as n from audit_log where action = 'subscription.set' and tenant_id = %s",
                        (w.tenant_id,)).fetchone()["n"] == 1


def test_the_scheduled_handler(p, conn, clock):
    from functions.credit_expiry.handler import lambda_handler
    from aivedio_tools.local.lambda_context import FakeLambdaContext

    w = new_wallet(p, credits=0)
    p.db.transaction(lambda c: add_lot(c, w, 25, expires_at=EXPIRES))
    clock._now = EXPIRES
    with open("events/credit_expiry.json") as f:
        out = lambda_handler(json.load(f), FakeLambdaContext("aivedio-credit-expiry"))
    assert out["details"]["expiry"]["credits_expired"] >= 25
    assert [r["amount_delta"] for r in expire_txns(conn, w.wallet_id)] == [25]
    assert set(out["details"]) == {"subscriptions", "expiry", "parked_settlements"}
    assert_invariants(conn, w.wallet_id)


def test_corrections_are_appended_reversals(p, conn, clock):
    w = new_wallet(p, credits=0)
    lot = p.db.transaction(lambda c: add_lot(c, w, 40, kind="PROMOTIONAL", key="grant:promo:mistake"))
    grant = conn.execute("select ledger_txn_id from ledger_transaction where business_key = 'grant:promo:mistake'").fetchone()[
        "ledger_txn_id"]
    out = p.db.transaction(lambda c: reverse(c, operator=ADMIN, ledger_txn_id=grant, reason="granted to the wrong tenant",
                                             now=clock.now()))
    txn = conn.execute("select * from ledger_transaction where ledger_txn_id = %s", (out["ledger_txn_id"],)).fetchone()
    assert (txn["event_type"], txn["reversal_of"], txn["business_key"]) == ("ADJUST", grant, f"reverse:{grant}")
    entries = conn.execute("select bucket, amount_delta from ledger_entry where ledger_txn_id = %s order by bucket",
                           (txn["ledger_txn_id"],)).fetchall()
    assert [(e["bucket"], e["amount_delta"]) for e in entries] == [("AVAILABLE", -40), ("ISSUED", 40)]
    assert lot_row(conn, lot)["remaining_amount"] == 0
    assert p.db.transaction(lambda c: reverse(c, operator=ADMIN, ledger_txn_id=grant, reason="again", now=clock.now()))["replayed"]
    assert assert_invariants(conn, w.wallet_id)["available_amount"] == 0
    # A SETTLE is refunded, not reversed; credit already reserved cannot be ungranted.
    p.db.transaction(lambda c: add_lot(c, w, 70, key="grant:paid:1"))
    task = p.db.transaction(lambda c: make_task(c, w))
    with p.db.connection() as c:
        s = settle(c, terminal(task, w.tenant_id), T0, event_type="TaskSucceeded", event_id=uuid.uuid4())
    p.db.transaction(lambda c: add_lot(c, w, 10, key="grant:paid:2"))
    task2 = p.db.transaction(lambda c: make_task(c, w, reserve_amount=10, quoted=10))
    paid2 = conn.execute("select ledger_txn_id from ledger_transaction where business_key = 'grant:paid:2'").fetchone()["ledger_txn_id"]
    before = footprint(conn, w.tenant_id, w.wallet_id)
    with pytest.raises(CorrectionRefused):
        p.db.transaction(lambda c: reverse(c, operator=ADMIN, ledger_txn_id=s.settle_ledger_txn_id, reason="x", now=clock.now()))
    with pytest.raises(CorrectionRefused):
        p.db.transaction(lambda c: reverse(c, operator=ADMIN, ledger_txn_id=paid2, reason="x", now=clock.now()))
    assert footprint(conn, w.tenant_id, w.wallet_id) == before
    assert conn.execute("select state from credit_reservation where task_id = %s", (task2,)).fetchone()["state"] == "ACTIVE"
    # An EXPIRE booked in error is reversed: the credit is back in its lot.
    late = p.db.transaction(lambda c: add_lot(c, w, 5, expires_at=EXPIRES, key="grant:late"))
    clock._now = EXPIRES
    expiry.sweep(p)
    exp = conn.execute("select ledger_txn_id from ledger_transaction where business_key = %s", (f"expire:lot:{late}:0",)).fetchone()
    p.db.transaction(lambda c: reverse(c, operator=ADMIN, ledger_txn_id=exp["ledger_txn_id"], reason="expired early", now=clock.now()))
    row = lot_row(conn, late)
    assert (row["remaining_amount"], row["expired_amount"]) == (5, 0)
    assert_invariants(conn, w.wallet_id)
