"""The provider cost report (issue 6, "Provider costs", ch. 20.9.1 and 20.9.2) on the real PostgreSQL.

Three tasks settle in the period: A succeeds on its first attempt (0.25 USD); B succeeds on its
second attempt (0.25) after a first attempt that was also billed (0.25, a duplicate); C fails but
the provider billed it (0.10). An orphan job's charge has no attempt (0.15). An EUR cost and media
costs sit beside them. Then, in USD, never summed with EUR:
- provider cost 1.00 spread over 2 successful videos and 10 delivered seconds: 0.50 per video,
  0.10 per second, 6.00 per playable minute;
- the duplicate-generation cost rate is (0.25 + 0.15) / 1.00 = 0.40;
- media costs are attributed by tenant and kind, and an all-in figure adds them.
A redelivered cost event adds nothing; the CLI prints the same report."""
from __future__ import annotations

import json
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest

from aivedio.spend import costs
from aivedio.billing.settlement import settle
from tests.billing_support import ADMIN, T0, Cli, make_attempt, make_task, new_wallet, terminal

pytestmark = pytest.mark.timeout(120)
START, END = T0 - timedelta(hours=1), T0 + timedelta(hours=1)


@pytest.fixture(scope="module")
def world(db_url, redis_url):
    from aivedio.config import PlatformConfig, Settings
    from aivedio.context import build_platform
    from tests.conftest import TEST_HOME

    p = build_platform(Settings(database_url=db_url, redis_url="none", home=TEST_HOME), PlatformConfig(), pool_size=3)
    w = new_wallet(p, credits=10_000)

    def settle_one(task, attempt, **kw):
        with p.db.connection() as c:
            return settle(c, terminal(task, w.tenant_id, attempt_id=attempt, **kw), T0, event_type=kw.get("event_type") or
                          {"SUCCEEDED": "TaskSucceeded", "FAILED": "TaskFailed"}[kw.get("state", "SUCCEEDED")], event_id=uuid.uuid4())

    a = p.db.transaction(lambda c: make_task(c, w))
    a1 = p.db.transaction(lambda c: make_attempt(c, w, a))
    settle_one(a, a1, cost="0.25")
    b = p.db.transaction(lambda c: make_task(c, w))
    b1 = p.db.transaction(lambda c: make_attempt(c, w, b, attempt_no=1))
    b2 = p.db.transaction(lambda c: make_attempt(c, w, b, attempt_no=2))
    with p.db.connection() as c:  # the first attempt's charge, as a poll or the invoice reports it
        for _ in range(2):
            costs.record_provider_cost(c, payload={}, state="SUCCEEDED", stage="PROVIDER_SUCCEEDED", tenant_id=w.tenant_id, task_id=b,
                                       attempt_id=b1, provider="provider-a", provider_account="account-01", provider_job_id="job-b1",
                                       charge_id="ch-b1", provider_charged=True,
                                       usage=type("U", (), {"cost_amount": Decimal("0.25"), "currency": "USD"})(), occurred_at=T0)
    settle_one(b, b2, cost="0.25")
    c_ = p.db.transaction(lambda c: make_task(c, w))
    c1 = p.db.transaction(lambda c: make_attempt(c, w, c_))
    settle_one(c_, c1, state="FAILED", stage="PROVIDER_FAILED", provider_charged=True, cost="0.10", seconds="2")
    with p.db.connection() as c:
        c.execute("""insert into provider_cost_event (provider, provider_account_id, external_charge_id, event_type, amount, currency,
                                                      source, occurred_at) values
                     ('provider-a', 'account-01', 'ch-orphan', 'GENERATION', 0.15, 'USD', 'INVOICE', %s),
                     ('provider-b', 'eu-01', 'ch-eur', 'GENERATION', 0.30, 'EUR', 'INVOICE', %s),
                     ('provider-a', 'account-01', 'ch-old', 'GENERATION', 9.99, 'USD', 'INVOICE', %s)""",
                  (T0, T0, T0 - timedelta(days=3)))
        for i, (kind, amount) in enumerate((("TRANSCODE", "0.02"), ("STORAGE", "0.01"), ("EGRESS", "0.03"), ("EGRESS", "0.03"))):
            costs.record_media_cost(c, source_key=f"cdn-log:{i % 3}", kind=kind, amount=Decimal(amount), currency="USD",
                                    occurred_at=T0, tenant_id=w.tenant_id, task_id=a, tags={"asset_type": "final"})
    yield p, w
    p.close()


def test_cost_per_success_with_failures_and_duplicates_spread_over_successes(world, conn):
    p, w = world
    r = costs.cost_report(conn, start=START, end=END)
    assert (r["successful_videos"], r["successful_seconds"]) == (2, 10)
    usd = r["currencies"]["USD"]
    assert Decimal(usd["provider_cost"]) == Decimal("1.00")  # the 9.99 outside the period is not in it
    assert Decimal(usd["duplicate_cost"]) == Decimal("0.40") and Decimal(usd["unmapped_cost"]) == Decimal("0.15")
    assert Decimal(usd["failed_cost"]) == Decimal("0.10") and Decimal(usd["delivered_attempt_cost"]) == Decimal("0.50")
    assert Decimal(usd["cost_per_successful_video"]) == Decimal("0.50")
    assert Decimal(usd["cost_per_successful_second"]) == Decimal("0.10")
    assert Decimal(usd["cost_per_playable_minute"]) == Decimal("6.00")
    assert Decimal(usd["duplicate_generation_cost_rate"]) == Decimal("0.40")
    assert usd["by_event_type"] == {"FAILED_CHARGE": "0.10000000", "GENERATION": "0.90000000"}
    # media: three distinct source lines (the fourth repeats a key), attributed to the tenant
    assert Decimal(usd["media_cost"]) == Decimal("0.06")
    assert {k: Decimal(v) for k, v in usd["media_by_tenant"][str(w.tenant_id)].items()} == {
        "TRANSCODE": Decimal("0.02"), "STORAGE": Decimal("0.01"), "EGRESS": Decimal("0.03")}
    assert Decimal(usd["all_in_cost_per_successful_video"]) == Decimal("0.53")
    eur = r["currencies"]["EUR"]  # never summed with USD
    assert Decimal(eur["provider_cost"]) == Decimal("0.30") and eur["cost_per_successful_video"] is not None
    assert conn.execute("select count(*) as n from provider_cost_event where external_charge_id = 'ch-b1'").fetchone()["n"] == 1


def test_by_provider(world, conn):
    r = costs.cost_report(conn, start=START, end=END, provider="provider-b")
    assert set(r["currencies"]) == {"EUR"} and r["successful_videos"] == 0
    assert r["currencies"]["EUR"]["cost_per_successful_video"] is None


def test_costs_cli(world, db_url, monkeypatch, capsys):
    monkeypatch.setenv("AIVEDIO_DATABASE_URL", db_url)
    monkeypatch.setenv("AIVEDIO_REDIS_URL", "none")
    cli = Cli(monkeypatch)
    args = ["admin", "costs", "report", "--from", START.isoformat(), "--to", END.isoformat(), "--json"]
    assert cli.main([*args, "--operator", ADMIN]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert Decimal(doc["currencies"]["USD"]["duplicate_generation_cost_rate"]) == Decimal("0.40")
    assert cli.main(args) == 0  # the CLI is trusted: as typed, with no --operator
    assert json.loads(capsys.readouterr().out) == doc
