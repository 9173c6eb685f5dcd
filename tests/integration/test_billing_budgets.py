"""Provider spend budgets (issue 6, "Budgets", ch. 20.9.4) on the real PostgreSQL.

- reserve/settle/release at several scopes at once, idempotent per business key;
- 70 %: an alert, once per budget and level; 90 %: costly or low-priority work refused; 100 %:
  everything refused; the abnormal-slope breaker refuses far below the limit; each refusal writes
  nothing;
- a budget in another currency is never summed: CurrencyMismatch;
- settle consumes the actual cost (which may overrun the estimate), release frees the estimate;
- concurrent reservations never overrun a budget."""
from __future__ import annotations

import threading
import uuid
from datetime import timedelta
from decimal import Decimal

import psycopg
import pytest
from psycopg.rows import dict_row

from aivedio.spend import budgets
from aivedio.spend.budgets import BudgetExceeded, CurrencyMismatch
from aivedio.config import BillingConfig
from tests.billing_support import ADMIN, T0, make_attempt, make_task, new_wallet

pytestmark = [pytest.mark.timeout(120), pytest.mark.redis_cluster]
CFG = BillingConfig(budget_slope_max_fraction=1.0)  # the breaker off unless a test turns it on


@pytest.fixture
def p(make_platform):
    platform = make_platform(redis=False, pool_size=8)
    return platform


def new_budget(p, scope_type, scope_id, limit, currency="USD"):
    return p.db.transaction(lambda c: budgets.set_budget(
        c, operator=ADMIN, scope_type=scope_type, scope_id=scope_id, period_start=T0 - timedelta(hours=1),
        period_end=T0 + timedelta(days=1), limit_amount=Decimal(limit), currency=currency))["budget_id"]


def reserve(p, scopes, amount, *, key=None, config=CFG, now=T0, **kw):
    return p.db.transaction(lambda c: budgets.reserve(c, scopes=scopes, amount=Decimal(amount), currency=kw.pop("currency", "USD"),
                                                      business_key=key or f"provider-budget-reserve:{uuid.uuid4()}", now=now,
                                                      config=config, **kw))


def row(conn, budget_id):
    return conn.execute("select * from budget_account where budget_id = %s", (budget_id,)).fetchone()


def state(conn, budget_id):
    r = row(conn, budget_id)
    n = conn.execute("select count(*) as n from budget_reservation where budget_id = %s", (budget_id,)).fetchone()["n"]
    return (r["reserved_amount"], r["consumed_amount"], r["alert_level"], n)


def test_thresholds_alert_restrict_and_reject(p, conn):
    scope = [("PROVIDER_ACCOUNT", f"acct-{uuid.uuid4().hex[:6]}")]
    b = new_budget(p, *scope[0], 100)
    assert reserve(p, scope, 60).level == 0
    check = reserve(p, scope, 10)  # 70 %
    assert check.level == 70 and check.alerts == (f"{scope[0][0]}:{scope[0][1]}>=70%",)
    assert row(conn, b)["alert_level"] == 70
    assert reserve(p, scope, 5).alerts == ()  # alerted once per level
    before = state(conn, b)
    with pytest.raises(BudgetExceeded) as e:
        reserve(p, scope, 15, costly=True)  # 90 %: costly work refused
    assert e.value.details["why"] == "RESTRICT"
    with pytest.raises(BudgetExceeded):
        reserve(p, scope, 15, low_priority=True)
    assert state(conn, b) == before  # refusals write nothing
    assert reserve(p, scope, 15).level == 90  # ordinary work still passes at 90 %
    with pytest.raises(BudgetExceeded) as e:
        reserve(p, scope, Decimal("10.00000001"))  # past 100 %
    assert e.value.details["why"] == "REJECT" and e.value.code == "BUDGET_EXCEEDED"
    assert state(conn, b) == (Decimal(90), Decimal(0), 90, 4)
    assert reserve(p, scope, 10).level == 90  # up to exactly the limit
    with pytest.raises(BudgetExceeded):
        reserve(p, scope, Decimal("0.00000001"))  # a full budget refuses everything
    status = {s["budget_id"]: s for s in p.db.transaction(lambda c: budgets.status(c, now=T0, config=CFG))}
    assert status[str(b)]["level"] == 100 and status[str(b)]["usage_pct"] == "100.00"


def test_several_scopes_at_once_and_idempotent_keys(p, conn):
    tenant, model = f"t-{uuid.uuid4().hex[:6]}", f"m-{uuid.uuid4().hex[:6]}"
    scopes = [("TENANT", tenant), ("MODEL", model), ("REGION", "us"), ("GLOBAL", f"g-{uuid.uuid4().hex[:6]}")]
    ids = [new_budget(p, s, i, 1000) for s, i in scopes]
    key = f"provider-budget-reserve:{uuid.uuid4()}"
    first = reserve(p, scopes, "2.5", key=key)
    again = reserve(p, scopes, "2.5", key=key)  # a retried reservation adds nothing
    assert set(first.reserved) == set(ids) == set(again.reserved)
    for b in ids:
        assert state(conn, b)[0] == Decimal("2.5") and state(conn, b)[3] == 1
    # One scope full refuses the whole reservation, and none of the others is touched.
    small = new_budget(p, "PROJECT", budgets.project_scope_id(new_wallet(p).tenant_id, "p-1"), 1)
    with pytest.raises(BudgetExceeded):
        reserve(p, [*scopes, ("PROJECT", row(conn, small)["scope_id"])], "2")
    for b in ids:
        assert state(conn, b)[0] == Decimal("2.5")


def test_settle_consumes_the_actual_cost_and_release_frees_the_estimate(p, conn):
    scope = [("MODEL", f"m-{uuid.uuid4().hex[:6]}")]
    b = new_budget(p, *scope[0], 10)
    w = new_wallet(p, credits=1000)
    task = p.db.transaction(lambda c: make_task(c, w))
    a1, a2 = (p.db.transaction(lambda c, n=n: make_attempt(c, w, task, attempt_no=n)) for n in (1, 2))
    reserve(p, scope, "1", key=f"provider-budget-reserve:{a1}", attempt_id=a1)
    reserve(p, scope, "1", key=f"provider-budget-reserve:{a2}", attempt_id=a2)
    p.db.transaction(lambda c: budgets.settle_attempt(c, attempt_id=a1, actual=Decimal("1.4"), currency="USD", now=T0))
    p.db.transaction(lambda c: budgets.settle_attempt(c, attempt_id=a1, actual=Decimal("1.4"), currency="USD", now=T0))
    p.db.transaction(lambda c: budgets.release_attempt(c, attempt_id=a2, now=T0))
    assert state(conn, b)[:2] == (Decimal(0), Decimal("1.4"))  # the overrun is consumed, once
    rows = {r["attempt_id"]: r for r in conn.execute("select * from budget_reservation where budget_id = %s", (b,))}
    assert (rows[a1]["state"], rows[a1]["settled_amount"], rows[a1]["released_amount"]) == ("SETTLED", Decimal(1), Decimal(0))
    assert (rows[a2]["state"], rows[a2]["released_amount"]) == ("RELEASED", Decimal(1))


def test_the_abnormal_slope_breaker(p, conn):
    scope = [("GLOBAL", f"g-{uuid.uuid4().hex[:6]}")]
    b = new_budget(p, *scope[0], 100)
    cfg = BillingConfig(budget_slope_window_seconds=600, budget_slope_max_fraction=0.2)
    reserve(p, scope, 15, config=cfg, now=T0)
    with pytest.raises(BudgetExceeded) as e:
        reserve(p, scope, 10, config=cfg, now=T0 + timedelta(seconds=60))  # 25 within 10 minutes at only 25 % used
    assert e.value.details["why"] == "SLOPE_BREAKER"
    assert reserve(p, scope, 10, config=cfg, now=T0 + timedelta(seconds=601)).level == 0  # the window moved on
    assert state(conn, b)[0] == Decimal(25)


def test_a_budget_in_another_currency_is_never_summed(p, conn):
    scope = ("PROVIDER_ACCOUNT", f"eur-{uuid.uuid4().hex[:6]}")
    b = new_budget(p, *scope, 100, currency="EUR")
    with pytest.raises(CurrencyMismatch):
        reserve(p, [scope], 1, currency="USD")
    assert state(conn, b) == (Decimal(0), Decimal(0), 0, 0)
    assert reserve(p, [scope], 1, currency="EUR").reserved == (b,)


def test_concurrent_reservations_never_overrun(p, conn, db_url):
    scope = [("TENANT", f"t-{uuid.uuid4().hex[:6]}")]
    b = new_budget(p, *scope[0], 50)
    ok, refused = [], []

    def worker():
        with psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as c:
            for _ in range(10):
                try:
                    from aivedio.db.pool import in_transaction
                    in_transaction(c, lambda t: budgets.reserve(t, scopes=scope, amount=Decimal(1), currency="USD", now=T0,
                                                                business_key=f"k:{uuid.uuid4()}", config=CFG))
                    ok.append(1)
                except BudgetExceeded:
                    refused.append(1)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ok) == 50 and len(refused) == 30
    assert state(conn, b)[0] == Decimal(50) and state(conn, b)[3] == 50
