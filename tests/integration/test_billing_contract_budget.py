"""The contract budget of an enterprise POSTPAID wallet (ch. 20.1.2 "检查信用额度、合同预算和账期内累计
应收"; a reservation is against the credit limit AND the contract budget) on the real PostgreSQL.

- admission reserves within the budget, and refuses the task that would take it past the budget
  with REJECT_INSUFFICIENT_CREDIT (402), writing nothing; so does a top-up before an extension;
- what settles in a period counts toward it (accrued + reserved + new <= budget), a refund in the
  period gives room back, and the next period starts fresh: checked at the exact boundary;
- a settlement whose POSTPAID excess would pass the budget tops up only to it (the platform bears
  the rest) instead of failing;
- a budget set after its period began starts from what the period already settled and refunded,
  and the counters always equal what the charges and refunds say;
- a wallet with no budget for the period is limited by its credit limit alone;
- `aivedio admin contract-budget set` is audited (the CLI is trusted), refuses overlapping periods
  and wallets that are not POSTPAID, and writes nothing when it refuses."""
from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone

import pytest

from aivedio.admission.decisions import Rejected
from aivedio.admission.models import GenerationRequest
from aivedio.admission.service import admit
from aivedio.billing.contract_budgets import accrued_from_facts, set_contract_budget
from aivedio.billing.ledger import lock_wallet
from aivedio.billing.refunds import request_refund
from aivedio.billing.reservations import InsufficientCredit, lock_reservation, top_up
from aivedio.billing.settlement import settle
from aivedio.config import ManualClock
from tests.admission_support import BODY, new_tenant
from tests.billing_support import (ADMIN, PRICE, SUPPORT, Cli, assert_invariants, footprint, make_task,
                                   new_wallet, price_version, terminal)

pytestmark = pytest.mark.timeout(120)
JUNE = (datetime(2026, 6, 1, tzinfo=timezone.utc), datetime(2026, 7, 1, tzinfo=timezone.utc))
JULY = (JUNE[1], datetime(2026, 8, 1, tzinfo=timezone.utc))
LAST_INSTANT_OF_JUNE = JUNE[1] - timedelta(microseconds=1)


@pytest.fixture
def clock():
    return ManualClock(JUNE[1] - timedelta(hours=1))


@pytest.fixture
def p(make_platform, clock):
    platform = make_platform(clock=clock, pool_size=4)
    return platform


def set_budget(p, tenant_id, period, amount, operator=ADMIN):
    return p.db.transaction(lambda c: set_contract_budget(c, operator=operator, tenant_id=tenant_id, period_start=period[0],
                                                          period_end=period[1], budget_amount=amount))


def budget_row(conn, wallet_id, period):
    return conn.execute("select * from contract_budget where wallet_id = %s and period_start = %s", (wallet_id, period[0])).fetchone()


def task(p, w, now, **kw):
    pv = p.db.transaction(lambda c: price_version(c, JUNE[0]))
    return p.db.transaction(lambda c: make_task(c, w, now=now, price_version_id=pv, **kw))


def settle_at(p, w, task_id, now, **kw):
    with p.db.connection() as c:
        return settle(c, terminal(task_id, w.tenant_id, **kw), now, event_type="TaskSucceeded", event_id=uuid.uuid4())


def assert_counters_match_facts(conn, wallet_id, period):
    row = budget_row(conn, wallet_id, period)
    assert accrued_from_facts(conn, wallet_id, *period) == {"settled": row["settled_amount"], "refunded": row["refunded_amount"]}


def test_admission_reserves_within_the_contract_budget_and_refuses_the_task_beyond_it(p, conn):
    t = new_tenant(p, account_type="POSTPAID", credits=100_000)  # a credit limit that never binds here
    set_budget(p, t.tenant_id, JUNE, 2 * PRICE + 10)
    req = GenerationRequest(**BODY)
    for n in range(2):
        assert admit(p, t.caller, req, BODY, f"k{n}").status == 202
    before = footprint(conn, t.tenant_id, t.wallet_id)
    tasks = conn.execute("select count(*) as n from generation_task where tenant_id = %s", (t.tenant_id,)).fetchone()["n"]
    with pytest.raises(Rejected) as e:
        admit(p, t.caller, req, BODY, "k2")  # 0 accrued + 140 reserved + 70 > 150
    assert (e.value.decision, e.value.status) == ("REJECT_INSUFFICIENT_CREDIT", 402)
    assert "contract budget" in e.value.message
    assert footprint(conn, t.tenant_id, t.wallet_id) == before
    assert conn.execute("select count(*) as n from generation_task where tenant_id = %s", (t.tenant_id,)).fetchone()["n"] == tasks
    assert conn.execute("select 1 from idempotency_record where tenant_id = %s and idempotency_key = 'k2'",
                        (t.tenant_id,)).fetchone() is None
    assert_invariants(conn, t.wallet_id)


def test_settled_credit_counts_toward_its_period_and_the_next_period_starts_fresh(p, conn):
    w = new_wallet(p, credits=100_000, account_type="POSTPAID")
    set_budget(p, w.tenant_id, JUNE, 200)
    set_budget(p, w.tenant_id, JULY, 150)
    a = task(p, w, JUNE[1] - timedelta(hours=1))
    settle_at(p, w, a, LAST_INSTANT_OF_JUNE)  # 70 receivable in June
    b = task(p, w, LAST_INSTANT_OF_JUNE)  # June: 70 accrued + 0 reserved + 70 <= 200
    before = footprint(conn, w.tenant_id, w.wallet_id)
    with pytest.raises(InsufficientCredit, match="contract budget"):
        task(p, w, LAST_INSTANT_OF_JUNE)  # June: 70 + 70 + 70 > 200
    assert footprint(conn, w.tenant_id, w.wallet_id) == before
    task(p, w, JULY[0])  # July: 0 accrued + 70 reserved (b) + 70 <= 150; June's 70 stays June's
    settle_at(p, w, b, JULY[0])  # 70 receivable in July, at its first instant
    with pytest.raises(InsufficientCredit):
        task(p, w, JULY[0])  # July: 70 + 70 reserved + 70 > 150
    june, july = budget_row(conn, w.wallet_id, JUNE), budget_row(conn, w.wallet_id, JULY)
    assert (june["settled_amount"], july["settled_amount"]) == (PRICE, PRICE)
    # A refund gives room back in the period it is made in, whichever period the charge was in.
    p.db.transaction(lambda cn: request_refund(cn, operator=SUPPORT, tenant_id=w.tenant_id, task_id=a, amount=PRICE,
                                               reason="contract dispute", now=JULY[0] + timedelta(days=1)))
    assert budget_row(conn, w.wallet_id, JULY)["refunded_amount"] == PRICE
    task(p, w, JULY[0] + timedelta(days=1))  # July: 70 - 70 + 70 reserved + 70 <= 150
    for period in (JUNE, JULY):
        assert_counters_match_facts(conn, w.wallet_id, period)
    assert_invariants(conn, w.wallet_id)


def test_a_top_up_beyond_the_contract_budget_is_refused_and_writes_nothing(p, conn):
    w = new_wallet(p, credits=100_000, account_type="POSTPAID")
    set_budget(p, w.tenant_id, JUNE, 100)
    now = JUNE[1] - timedelta(hours=1)
    t = task(p, w, now, policy="USAGE_BASED_TOP_UP")  # 70 of 100

    def extend(amount, n):
        def tx(c):
            wallet = lock_wallet(c, w.tenant_id, w.wallet_id)
            return top_up(c, wallet=wallet, reservation=lock_reservation(c, wallet, t), amount=amount,
                          business_key=f"reserve:generation:{t}:topup:{n}", now=now)
        return p.db.transaction(tx)

    extend(20, 1)  # 90 of 100
    before = footprint(conn, w.tenant_id, w.wallet_id)
    with pytest.raises(InsufficientCredit, match="contract budget"):
        extend(20, 2)
    assert footprint(conn, w.tenant_id, w.wallet_id) == before
    assert_invariants(conn, w.wallet_id)


def test_a_settlement_tops_a_postpaid_excess_up_only_to_the_contract_budget(p, conn):
    w = new_wallet(p, credits=100_000, account_type="POSTPAID")
    set_budget(p, w.tenant_id, JUNE, 100)
    t = task(p, w, JUNE[0] + timedelta(days=1), policy="USAGE_BASED_POSTPAID")  # reserves 70
    s = settle_at(p, w, t, JUNE[0] + timedelta(days=2), seconds="9")  # 110 asked; the credit limit would allow it
    assert (s.outcome, s.charged, s.absorbed) == ("SETTLED", 100, 10)  # 30 more up to the budget; 10 borne by the platform
    assert budget_row(conn, w.wallet_id, JUNE)["settled_amount"] == 100
    assert_counters_match_facts(conn, w.wallet_id, JUNE)
    assert_invariants(conn, w.wallet_id)


def test_a_budget_set_mid_period_starts_from_what_the_period_already_holds(p, conn):
    w = new_wallet(p, credits=100_000, account_type="POSTPAID")
    a = task(p, w, JUNE[0] + timedelta(days=1))
    settle_at(p, w, a, JUNE[0] + timedelta(days=2))
    p.db.transaction(lambda c: request_refund(c, operator=SUPPORT, tenant_id=w.tenant_id, task_id=a, amount=20,
                                              reason="late delivery", now=JUNE[0] + timedelta(days=3)))
    b = task(p, w, JUNE[0] + timedelta(days=4))
    settle_at(p, w, b, JULY[0])  # July's receivable, not June's
    set_budget(p, w.tenant_id, JUNE, 120)
    row = budget_row(conn, w.wallet_id, JUNE)
    assert (row["settled_amount"], row["refunded_amount"]) == (PRICE, 20)
    assert_counters_match_facts(conn, w.wallet_id, JUNE)
    task(p, w, JUNE[0] + timedelta(days=5))  # 50 accrued + 0 reserved + 70 <= 120
    with pytest.raises(InsufficientCredit):
        task(p, w, JUNE[0] + timedelta(days=5))  # 50 + 70 + 70 > 120


def test_without_a_budget_for_the_period_the_credit_limit_alone_applies(p, conn):
    w = new_wallet(p, credits=2 * PRICE + 10, account_type="POSTPAID")
    set_budget(p, w.tenant_id, JULY, 0)  # another period's budget does not bind in June
    now = JUNE[0] + timedelta(days=1)
    task(p, w, now)
    task(p, w, now)
    with pytest.raises(InsufficientCredit, match="available"):
        task(p, w, now)  # -210 < -150: the credit limit, as before
    with pytest.raises(InsufficientCredit, match="contract budget"):
        task(p, w, JULY[0], reserve_amount=1)  # July's budget of 0 refuses everything


def test_the_cli_sets_a_budget_and_audits_it(p, conn, db_url, monkeypatch, capsys):
    monkeypatch.setenv("AIVEDIO_DATABASE_URL", db_url)
    monkeypatch.setenv("AIVEDIO_REDIS_URL", "none")
    cli = Cli(monkeypatch)
    w = new_wallet(p, credits=1000, account_type="POSTPAID")
    args = ["admin", "contract-budget", "set", "--tenant-id", str(w.tenant_id), "--period-start", JUNE[0].isoformat(),
            "--period-end", JUNE[1].isoformat(), "--json"]

    def run(*extra, operator=ADMIN):
        code = cli.main([*args, *extra, "--operator", operator])
        return code, json.loads(capsys.readouterr().out)

    code, doc = run("--amount", "500", "--reason", "contract 2026-Q2")
    assert code == 0 and doc["budget_amount"] == 500 and doc["wallet_id"] == str(w.wallet_id)
    code, doc = run("--amount", "800")  # the same period: its amount changes
    assert code == 0 and doc["budget_amount"] == 800
    audits = conn.execute("""select operator, action, target, old_value, new_value, reason from audit_log
                              where tenant_id = %s and action = 'contract_budget.set' order by audit_id""", (w.tenant_id,)).fetchall()
    assert [(a["operator"], a["target"], a["old_value"], a["new_value"]["budget_amount"], a["reason"]) for a in audits] == [
        (ADMIN, f"wallet:{w.wallet_id}", None, 500, "contract 2026-Q2"),
        (ADMIN, f"wallet:{w.wallet_id}", {"budget_amount": 500}, 800, None)]

    before = footprint(conn, w.tenant_id, w.wallet_id)
    code = cli.main(["admin", "contract-budget", "set", "--tenant-id", str(w.tenant_id), "--amount", "1",
                     "--period-start", "2026-06-15T00:00:00Z", "--period-end", "2026-07-15T00:00:00Z", "--json", "--operator", ADMIN])
    assert (code, json.loads(capsys.readouterr().out)["error"]) == (1, "CONTRACT_PERIOD_OVERLAP")
    prepaid = new_wallet(p, credits=1000)
    code = cli.main(["admin", "contract-budget", "set", "--tenant-id", str(prepaid.tenant_id), "--amount", "1",
                     "--period-start", JUNE[0].isoformat(), "--period-end", JUNE[1].isoformat(), "--json", "--operator", ADMIN])
    assert (code, json.loads(capsys.readouterr().out)["error"]) == (1, "NOT_FOUND")
    assert footprint(conn, w.tenant_id, w.wallet_id) == before
