"""The month close of invoice reconciliation (aivedio.spend.invoices.close_month, `aivedio reconcile
invoices-close`): refused while the month runs, unreconciled or closed; audited; frozen once
closed, so what is found or corrected later is booked in the next open month with its original date."""
from __future__ import annotations

import json
from datetime import date, datetime, timezone
from pathlib import Path

import psycopg
import pytest

from aivedio.config import ManualClock
from aivedio.errors import InvalidRequest
from aivedio.spend import invoices
from tests.billing_support import Cli
from tests.invoice_support import ACCOUNT, SECRET, InvoiceStub, Seeder, at, items_of, line, platform_config, provider_config

pytestmark = pytest.mark.xdist_group("invoices")

JUNE, JULY = date(2026, 6, 1), date(2026, 7, 1)
JUNE_20, JUNE_30 = date(2026, 6, 20), date(2026, 6, 30)
FINANCE = "op:finance"


@pytest.fixture
def stub():
    s = InvoiceStub({f"key-{ACCOUNT}": ACCOUNT})
    yield s
    s.stop()


def test_a_closed_month_is_frozen_and_later_corrections_land_in_the_next(make_platform, stub, conn, db_url, tmp_path,
                                                                          monkeypatch, capsys):
    p = make_platform(platform_config(provider_config("inv-month", stub.url)),
                      clock=ManualClock(datetime(2026, 6, 30, 12, tzinfo=timezone.utc)))
    p.settings = p.settings.model_copy(update={"home": tmp_path})
    s = Seeder(p, "inv-month")
    old = s.attempt("old", unknown_cost=True, occurred=at(JUNE_20))  # billed, its cost never reported; no line in June
    pend = s.attempt("pend", cost="0.25", occurred=at(JUNE_30, 9))  # charged on the last day; its line comes late
    filler = s.attempt("filler", cost="0.25", occurred=at(JUNE_30, 8))
    stub.serve(ACCOUNT, JUNE_30, [line("ln-filler", charge="ch-filler", job=filler.job_id, occurred=at(JUNE_30, 8))])
    june_30 = invoices.reconcile_day(p, "inv-month", JUNE_30).document
    pending = {i["discrepancy_type"]: i for i in june_30["items"]}["PENDING_WITHIN_GRACE"]

    with pytest.raises(InvalidRequest) as e:  # June is not over
        invoices.close_month(p, "inv-month", JUNE, operator=FINANCE)
    assert e.value.code == "INVOICE_MONTH_NOT_OVER"
    p.clock.advance(2 * 86400)  # July 2nd
    with pytest.raises(invoices.MonthNotReconciled) as e:
        invoices.close_month(p, "inv-month", JUNE, operator=FINANCE)
    assert len(e.value.details["incomplete_days"]) == 29 and JUNE_30.isoformat() not in e.value.details["incomplete_days"]
    with pytest.raises(InvalidRequest):
        invoices.close_month(p, "inv-month", JUNE, operator=FINANCE, allow_incomplete=True)  # no reason

    cfg = tmp_path / "platform.toml"
    cfg.write_text(f'[[providers]]\nname = "inv-month"\nbase_url = "{stub.url}"\nwebhook_secret = "{SECRET}"\n'
                   f'[[providers.accounts]]\naccount_id = "{ACCOUNT}"\napi_key = "key-{ACCOUNT}"\n')
    for k, v in {"AIVEDIO_DATABASE_URL": db_url, "AIVEDIO_REDIS_URL": "none", "AIVEDIO_CONFIG": str(cfg),
                 "AIVEDIO_HOME": str(tmp_path)}.items():
        monkeypatch.setenv(k, v)
    # The CLI runs on the wall clock: June 2026 is over by then, and the close is the same function.
    args = ["reconcile", "invoices-close", "--provider", "inv-month", "--month", "2026-06", "--allow-incomplete",
            "--reason", "only the last day was reconciled in this test", "--json"]
    assert Cli(monkeypatch).main([*args, "--operator", FINANCE]) == 0
    closed = json.loads(capsys.readouterr().out)
    assert closed["month"] == "2026-06" and closed["closed_by"] == FINANCE and closed["open_items_carried"] == 1
    assert closed["open_item_ids"] == [pending["item_id"]] and closed["external_amount"] == "0.2500"
    assert closed["items_by_type"] == {"PENDING_WITHIN_GRACE": {"OPEN": 1}}
    summary_file = tmp_path / "invoices" / closed["report_key"]
    assert json.loads(summary_file.read_text())["open_item_ids"] == closed["open_item_ids"]
    assert (tmp_path / "invoices" / closed["report_html_key"]).read_text().startswith("<!doctype html>")
    [audit] = conn.execute("select operator, target, reason from audit_log where action = 'invoice.close'").fetchall()
    assert audit == {"operator": FINANCE, "target": "invoice-period:inv-month:2026-06",
                     "reason": "only the last day was reconciled in this test"}
    assert Cli(monkeypatch).main([*args, "--operator", FINANCE]) == 1
    assert json.loads(capsys.readouterr().out)["error"] == "INVOICE_PERIOD_CLOSED"

    # July 1st's invoice carries both June lines late: each is booked in July, with its June date in evidence.
    stub.serve(ACCOUNT, JULY, [line("ln-old", charge="ch-old", job=old.job_id, occurred=at(JUNE_20)),
                               line("ln-pend", charge="ch-pend", job=pend.job_id, occurred=at(JUNE_30, 9))])
    july = invoices.reconcile_day(p, "inv-month", JULY).document
    assert july["status"] == "COMPLETE", july["incomplete_reasons"]
    rows = {i["discrepancy_type"]: i for i in items_of(conn, "inv-month")}
    late = rows["LATE_CHARGE"]  # ln-old: 11 days late, and its cost was never recorded: booked from the line
    assert (late["status"], late["period_month"], late["billing_date"]) == ("RESOLVED", JULY, JUNE_20)
    assert late["evidence"]["original_date"] == JUNE_20.isoformat() and late["evidence"]["original_period"] == JUNE.isoformat()
    fix = conn.execute("select occurred_at, amount from provider_cost_event where cost_event_id = %s",
                       (late["resolution_cost_event_id"],)).fetchone()
    assert fix["occurred_at"] == datetime(2026, 7, 1, tzinfo=timezone.utc)  # dated in the open month
    carried = rows["PENDING_WITHIN_GRACE"]  # June's open item, resolved in July
    assert (carried["status"], carried["resolution_code"], carried["period_month"], carried["resolved_period_month"]) == \
        ("RESOLVED", "LINE_ARRIVED", JUNE, JULY)
    # The closed month's summary never changes.
    period = conn.execute("select summary from provider_invoice_period where provider = 'inv-month'").fetchone()
    assert period["summary"]["open_items_carried"] == 1 and period["summary"]["items_by_type"] == closed["items_by_type"]
    with pytest.raises(psycopg.errors.RaiseException):
        conn.execute("update provider_invoice_period set summary = '{}' where provider = 'inv-month'")
    assert Path(summary_file).exists()
