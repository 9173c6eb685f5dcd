"""Invoice reconciliation (aivedio.spend.invoices) where it used to go wrong, against the real PostgreSQL:
a line the database cannot hold, an unexpected error in one provider's run, a fix racing the settlement, a
second credit note for one charge, a cursor far behind, and a late line for a day already COMPLETE."""
from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

import pytest

from aivedio.spend import costs
from aivedio.config import ManualClock
from aivedio.providers.adapter import Usage
from aivedio.spend import invoices
from tests.invoice_support import (ACCOUNT, D, NOW, InvoiceStub, Seeder, at, invoice_costs, items_of, line, platform_config,
                                   provider_config)

pytestmark = pytest.mark.xdist_group("invoices")


@pytest.fixture
def stub():
    s = InvoiceStub({f"key-{ACCOUNT}": ACCOUNT})
    yield s
    s.stop()


@pytest.fixture
def world(make_platform, stub, tmp_path):
    """world(*names, now=NOW) -> a platform whose providers all invoice from the stub, archiving under tmp_path."""
    def make(*names: str, now: datetime = NOW):
        p = make_platform(platform_config(*(provider_config(n, stub.url) for n in names)), clock=ManualClock(now))
        p.settings = p.settings.model_copy(update={"home": tmp_path})
        return p
    return make


def cursor_of(conn, provider: str):
    row = conn.execute("select complete_through from provider_invoice_cursor where provider = %s", (provider,)).fetchone()
    return row and row["complete_through"]


def latest_run(conn, provider: str, day):
    return conn.execute("""select * from reconciliation_run where provider = %s and lower(billing_period) = %s
                            order by started_at desc, finished_at desc limit 1""", (provider, day)).fetchone()


def settle(conn, s, *, cost: str, charge: str | None, state: str, stage: str, provider: str) -> None:
    """The platform's own record of the attempt's cost, as settlement writes it (it may come after the invoice)."""
    costs.record_provider_cost(conn, payload={"late": True}, state=state, stage=stage, tenant_id=s.tenant_id, task_id=s.task_id,
                               attempt_id=s.attempt_id, provider=provider, provider_account=ACCOUNT, provider_job_id=s.job_id,
                               charge_id=charge, provider_charged=True, usage=Usage(5.0, Decimal(cost), "USD"),
                               occurred_at=at(D))


@pytest.mark.parametrize("amount,name", [("1000000000000", "inv-amt-big"), ("-2E+15", "inv-amt-neg"),
                                         ("0.123456789", "inv-amt-places")], ids=["1e12", "huge-negative", "nine-places"])
def test_an_amount_the_database_cannot_hold_makes_the_document_malformed_not_a_crash(world, stub, conn, amount, name):
    p = world(name)
    good = Seeder(p, name).attempt("good", cost="0.25")
    stub.serve(ACCOUNT, D, [line("ln-good", charge="ch-good", job=good.job_id), line("ln-huge", charge="ch-h", amount=amount)])
    doc = invoices.reconcile_day(p, name, D).document
    assert doc["status"] == "INCOMPLETE"
    [reason] = doc["incomplete_reasons"]
    assert reason["code"] == "MALFORMED_DOCUMENT" and reason["evidence"]["archive_key"]
    [bad] = reason["evidence"]["bad_lines"]
    assert bad["line_id"] == "ln-huge" and bad["amount"] == str(Decimal(amount))
    assert conn.execute("select count(*) as n from provider_invoice_line where provider = %s", (name,)).fetchone()["n"] == 0
    assert latest_run(conn, name, D)["status"] == "INCOMPLETE"


def test_an_unexpected_error_finishes_the_run_incomplete_and_the_other_providers_still_run(world, stub, conn, monkeypatch):
    p = world("inv-err-a", "inv-err-b")
    real = invoices.items.classify_window

    def breaks_for_a(db, ctx, tally):
        if ctx.provider == "inv-err-a":
            raise RuntimeError("boom in classify")
        return real(db, ctx, tally)

    monkeypatch.setattr(invoices.items, "classify_window", breaks_for_a)
    report = invoices.run_once(p)  # yesterday is D
    assert not report.complete
    a, b = report.details["inv-err-a"], report.details["inv-err-b"]
    assert a[D.isoformat()]["status"] == "INCOMPLETE" and a[D.isoformat()]["incomplete"] == ["RUN_FAILED"]
    assert "boom in classify" in a[D.isoformat()]["error"]
    assert len(a) == 4 and {d["status"] for d in b.values()} == {"COMPLETE"} and len(b) == 4  # D, then D-3..D-1
    run = latest_run(conn, "inv-err-a", D)
    assert run["status"] == "INCOMPLETE" and run["finished_at"] is not None  # never left RUNNING
    assert [r["code"] for r in run["incomplete_reasons"]] == ["RUN_FAILED"]
    assert "boom in classify" in run["incomplete_reasons"][0]["evidence"]["error"]
    assert a[D.isoformat()]["run_id"] == str(run["run_id"])
    with pytest.raises(invoices.InvoiceRunFailed) as e:  # on demand, the error is the command's answer
        invoices.reconcile_day(p, "inv-err-a", D)
    assert e.value.details["run_id"] == str(run["run_id"])
    monkeypatch.setattr(invoices.items, "classify_window", real)
    assert invoices.reconcile_day(p, "inv-err-a", D).document["status"] == "COMPLETE"  # a rerun completes the day


def test_a_fix_has_the_settlements_type_so_a_late_settlement_adds_no_second_cost(world, stub, conn):
    p = world("inv-type")
    # The provider cancelled the job: attempt CANCELLED, task FAILED (attempts.lifecycle); not settled yet.
    s = Seeder(p, "inv-type").attempt("c", state="CANCELLED", task_state="FAILED", stage="PROVIDER_FAILED")
    stub.serve(ACCOUNT, D, [line("ln-c", charge="ch-c", job=s.job_id)])
    invoices.reconcile_day(p, "inv-type", D)
    assert [(c["event_type"], c["external_charge_id"]) for c in invoice_costs(conn, "inv-type")] == [("FAILED_CHARGE", "ch-c")]
    settle(conn, s, cost="0.25", charge="ch-c", state="FAILED", stage="PROVIDER_FAILED", provider="inv-type")
    rows = conn.execute("select amount from provider_cost_event where attempt_id = %s", (s.attempt_id,)).fetchall()
    assert [r["amount"] for r in rows] == [Decimal("0.25")]  # one cost: the settlement met the fix on the charge key
    report = costs.cost_report(conn, start=at(D, 0), end=at(D + timedelta(days=1), 0), provider="inv-type")
    assert report["currencies"]["USD"]["provider_cost"] == "0.25000000"


def test_a_settlement_under_a_composite_key_after_a_fix_is_an_item_not_a_silent_sum(world, stub, conn):
    p = world("inv-twice")
    s = Seeder(p, "inv-twice").attempt("t")  # succeeded, its cost not recorded yet
    stub.serve(ACCOUNT, D, [line("ln-t", charge="ch-t", job=s.job_id)])
    invoices.reconcile_day(p, "inv-twice", D)
    settle(conn, s, cost="0.25", charge=None, state="SUCCEEDED", stage="PROVIDER_SUCCEEDED", provider="inv-twice")
    # Weeks later, the line long out of the window: the double record is still found.
    later = invoices.reconcile_day(p, "inv-twice", D + timedelta(days=40)).document
    [item] = [i for i in items_of(conn, "inv-twice") if i["discrepancy_type"] == "AMOUNT_MISMATCH"]
    assert item["item_key"] == f"AMOUNT_MISMATCH:attempt:{s.attempt_id}:booked-twice" and item["status"] == "OPEN"
    assert (item["internal_amount"], item["external_amount"]) == (Decimal("0.5"), Decimal("0.25"))
    assert later["new_items"] == 1
    parked = conn.execute("select status from billing_parked_event where attempt_id = %s and reason = 'COST_WITHOUT_CHARGE_ID'",
                          (s.attempt_id,)).fetchone()
    assert parked["status"] == "OPEN"  # left for the person who sorts the double record out
    assert invoices.reconcile_day(p, "inv-twice", D + timedelta(days=41)).document["new_items"] == 0


def test_a_second_credit_note_for_the_same_charge_is_booked_and_credits_beyond_the_charge_wait(world, stub, conn):
    p = world("inv-credit")
    s = Seeder(p, "inv-credit").attempt("k", state="FAILED", cost="0.30")
    stub.serve(ACCOUNT, D, [line("ln-k", charge="ch-k", job=s.job_id, amount="0.3000"),
                            line("ln-k-c1", charge="ch-k", job=s.job_id, amount="0.1000", kind="credit_note",
                                 occurred=at(D, 11)),
                            line("ln-k-c2", charge="ch-k", job=s.job_id, amount="0.1000", kind="credit_note",
                                 occurred=at(D, 12))])
    doc = invoices.reconcile_day(p, "inv-credit", D).document
    assert doc["auto_fixed"] == 2
    booked = {c["external_line_id"]: c for c in invoice_costs(conn, "inv-credit")}
    assert {k: (c["event_type"], c["external_charge_id"], c["amount"]) for k, c in booked.items()} == {
        "ln-k-c1": ("CREDIT_NOTE", "ch-k#ln-k-c1", Decimal("-0.1")), "ln-k-c2": ("CREDIT_NOTE", "ch-k#ln-k-c2", Decimal("-0.1"))}
    fixed = {i["external_line_id"]: i for i in items_of(conn, "inv-credit")}
    assert {k: i["resolution_cost_event_id"] for k, i in fixed.items()} == \
        {k: c["cost_event_id"] for k, c in booked.items()}  # each item names its own cost event
    # A third credit note the next day takes the credits past the charge: for review, not booked.
    stub.serve(ACCOUNT, D + timedelta(days=1), [line("ln-k-c3", charge="ch-k", job=s.job_id, amount="0.2000",
                                                     kind="credit_note", occurred=at(D + timedelta(days=1)))])
    p.clock.advance(86400)
    nxt = invoices.reconcile_day(p, "inv-credit", D + timedelta(days=1)).document
    [c3] = nxt["items"]
    assert (c3["external_line_id"], c3["status"]) == ("ln-k-c3", "OPEN")
    assert "add up to more than the charge" in c3["evidence"]["why"] and c3["evidence"]["credited_with_this"] == "0.4000"
    assert len(invoice_costs(conn, "inv-credit")) == 2


def test_a_cursor_far_behind_the_window_catches_up_in_bounded_runs(world, stub, conn, monkeypatch):
    monkeypatch.setattr(invoices, "MAX_WINDOW_DAYS", 3)  # a window of 4 days, a cursor 12 behind
    monkeypatch.setattr(invoices, "CATCH_UP_DAYS", 3)
    p = world("inv-idle")
    conn.execute("insert into provider_invoice_cursor (provider, complete_through) values ('inv-idle', %s)",
                 (D - timedelta(days=12),))
    seen = []
    for _ in range(3):
        report = invoices.run_once(p)  # yesterday is D
        seen.append((len(report.details["inv-idle"]), cursor_of(conn, "inv-idle")))
        assert report.complete
    assert seen == [(7, D - timedelta(days=9)),  # D, D-3..D-1, and the oldest three: D-11..D-9
                    (4, D - timedelta(days=6)),  # D again, D-8..D-6
                    (3, D)]  # D, D-5, D-4, and then over D-3..D, COMPLETE already


def test_the_cursor_moves_over_a_gap_whose_days_are_all_complete(world, stub, conn, monkeypatch):
    monkeypatch.setattr(invoices, "MAX_WINDOW_DAYS", 3)
    p = world("inv-gap")
    for d in (D - timedelta(days=5), D - timedelta(days=4)):
        assert invoices.reconcile_day(p, "inv-gap", d).document["status"] == "COMPLETE"
    conn.execute("update provider_invoice_cursor set complete_through = %s where provider = 'inv-gap'", (D - timedelta(days=6),))
    invoices.reconcile_day(p, "inv-gap", D)  # its window, D-3..D, does not reach back to D-5: the runs of the gap say
    assert cursor_of(conn, "inv-gap") == D


def test_a_late_line_refreshes_the_figures_of_the_complete_day_it_occurred_on(world, stub, conn):
    day = D - timedelta(days=1)
    p = world("inv-refresh", now=NOW - timedelta(days=1))  # yesterday is D-1
    s = Seeder(p, "inv-refresh")
    x = s.attempt("x", cost="0.25", occurred=at(day, 9))
    y = s.attempt("y", cost="0.25", occurred=at(day, 23))  # its line comes on the next day's invoice
    stub.serve(ACCOUNT, day, [line("ln-x", charge="ch-x", job=x.job_id, occurred=at(day, 9))])
    assert invoices.run_once(p).details["inv-refresh"][day.isoformat()]["status"] == "COMPLETE"
    before = latest_run(conn, "inv-refresh", day)["summary"]
    assert (before["external_amount"], before["internal_amount"]) == ("0.2500", "0.5000")
    stub.serve(ACCOUNT, D, [line("ln-y", charge="ch-y", job=y.job_id, occurred=at(day, 23))])
    p.clock.advance(86400)
    report = invoices.run_once(p)
    assert list(report.details["inv-refresh"]) == [D.isoformat(), day.isoformat()]  # D, then D-1 again: its late line
    after = latest_run(conn, "inv-refresh", day)["summary"]
    assert (after["external_amount"], after["internal_amount"], after["gross_drift"]) == ("0.5000", "0.5000", "0.0000")
