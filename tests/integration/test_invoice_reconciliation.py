"""The daily provider-invoice reconciliation (aivedio.spend.invoices) against the real PostgreSQL, driven
alone: a seeded fixture with one of each discrepancy type, reruns that add nothing, bad input (a 5xx, a
malformed document, an empty invoice where the platform recorded charges, a line id reused), the
maintenance run over yesterday and the overlap window, the CLI as typed (trusted, audited), and the provider simulator's
late, duplicated and orphan lines."""
from __future__ import annotations

import getpass
import json
import uuid
from collections import Counter, defaultdict
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest

from aivedio.observability import metrics
from aivedio.config import ManualClock, PlatformConfig, ProviderAccount, ProviderConfig, SimulatorBehaviour
from aivedio.providers.adapter import HttpProviderAdapter, SubmitRequest
from aivedio_tools.provider_sim import SimulatorServer
from aivedio.spend import invoices
from aivedio.spend.invoice_archive import sha256_hex
from tests.billing_support import Cli
from tests.invoice_support import (ACCOUNT, D, NOW, SECRET, InvoiceStub, Seeder, at, invoice_costs, items_of, line,
                                   platform_config, provider_config)
from tests.waiting import wait_for

pytestmark = pytest.mark.xdist_group("invoices")

TYPES = ("MISSING_INTERNAL", "MISSING_EXTERNAL", "AMOUNT_MISMATCH", "DUPLICATE_EXTERNAL", "CURRENCY_MISMATCH",
         "TASK_STATUS_MISMATCH", "UNMAPPED_PROVIDER_TASK", "LATE_CHARGE", "PROVIDER_CREDIT_NOT_APPLIED", "PENDING_WITHIN_GRACE")
CONTRACT_KEYS = {"run_id", "provider", "date", "status", "incomplete_reasons", "lines_total", "lines_matched", "currency",
                 "external_amount", "internal_amount", "gross_drift", "net_drift", "previous_open_items", "new_items",
                 "resolved_items", "open_items", "auto_fixed", "items"}
ITEM_KEYS = {"item_id", "discrepancy_type", "status", "external_line_id", "provider_job_id", "task_id", "attempt_id",
             "internal_amount", "external_amount", "currency", "resolution_code", "evidence"}


@pytest.fixture
def stub():
    s = InvoiceStub({f"key-{a}": a for a in (ACCOUNT, "account-02")})
    yield s
    s.stop()


@pytest.fixture
def world(make_platform, stub, tmp_path):
    """world(name, batch_size=None, clock=NOW) -> a platform whose one provider is the stub, archiving under tmp_path."""
    def make(name: str, *, batch_size: int | None = None, now: datetime = NOW, accounts=(ACCOUNT,)):
        p = make_platform(platform_config(provider_config(name, stub.url, accounts), batch_size=batch_size),
                          clock=ManualClock(now))
        p.settings = p.settings.model_copy(update={"home": tmp_path})
        return p
    return make


def by_type(doc: dict) -> dict[str, dict]:
    return {i["discrepancy_type"]: i for i in doc["items"]}


# --- one of each ----------------------------------------------------------------------------------------

def seed_one_of_each(p, stub, provider: str) -> dict:
    s = Seeder(p, provider)
    a = {
        "mi": s.attempt("mi", unknown_cost=True),  # billed, cost never reported: parked COST_UNKNOWN
        "me": s.attempt("me", cost="0.25", occurred=at(D - timedelta(days=2))),  # no line, grace over
        "am": s.attempt("am", cost="0.25"),
        "dup": s.attempt("dup", cost="0.25"),
        "cur": s.attempt("cur", cost="0.25"),
        "tsm": s.attempt("tsm", state="FAILED", billable="NOT_BILLABLE"),  # the platform holds it free
        "cand": s.attempt("cand", state="SUBMIT_UNKNOWN", billable="NOT_BILLABLE", job=None, created=at(D, 10, 30)),
        "late": s.attempt("late", cost="0.25", occurred=at(D - timedelta(days=6))),
        "cr": s.attempt("cr", state="FAILED", cost="0.20"),  # failed but charged, then credited
        "pend": s.attempt("pend", cost="0.25", occurred=at(D, 12)),  # no line yet, inside its grace
        "ok": s.attempt("ok", cost="0.25"),
        "comp": s.attempt("comp", cost="0.25", charge=None),  # no charge id: composite key, parked
        "old": s.attempt("old", cost="0.25", occurred=at(D - timedelta(days=2), 9)),
    }
    stub.serve(ACCOUNT, D - timedelta(days=2), [line("ln-old", charge="ch-old", job=a["old"].job_id,
                                                     occurred=at(D - timedelta(days=2), 9))])
    ok = line("ln-ok", charge="ch-ok", job=a["ok"].job_id)
    stub.serve(ACCOUNT, D, [
        line("ln-mi", charge="ch-mi-provider", job=a["mi"].job_id, occurred=at(D, 9)),
        line("ln-am", charge="ch-am", job=a["am"].job_id, amount="0.7500"),
        line("ln-dup1", charge="ch-dup", job=a["dup"].job_id),
        line("ln-dup2", charge="ch-dup-2", job=a["dup"].job_id, occurred=at(D, 10, 5)),
        line("ln-cur", charge="ch-cur", job=a["cur"].job_id, amount="0.2300", currency="EUR"),
        line("ln-tsm", charge="ch-tsm", job=a["tsm"].job_id, amount="0.2000"),
        line("ln-ghost", charge="ch-ghost", job="job-nobody-knows", key="k-ghost", occurred=at(D, 11)),
        line("ln-late", charge="ch-late", job=a["late"].job_id, occurred=at(D - timedelta(days=6))),
        line("ln-cr", charge="ch-cr", job=a["cr"].job_id, amount="0.2000"),
        line("ln-cr-credit", charge="ch-cr", job=a["cr"].job_id, amount="0.2000", kind="credit_note", occurred=at(D, 10, 1)),
        ok, ok,  # an exact repeat: the same line
        line("ln-comp", charge="ch-comp", key=a["comp"].key),  # matched by the idempotency key alone
    ])
    return a


def test_the_seeded_fixture_yields_one_of_each_type_and_a_rerun_adds_nothing(world, stub, conn):
    p = world("inv-seed", batch_size=2)  # every phase crosses batch boundaries
    a = seed_one_of_each(p, stub, "inv-seed")
    before = metrics.snapshot()
    r = invoices.reconcile_day(p, "inv-seed", D)
    doc = r.document
    assert set(doc) == CONTRACT_KEYS and all(set(i) == ITEM_KEYS for i in doc["items"])
    assert doc["status"] == "COMPLETE", doc["incomplete_reasons"]
    assert r.batches > 8
    new = items_of(conn, "inv-seed")
    assert Counter(i["discrepancy_type"] for i in new) == Counter(TYPES)  # exactly one of each, nothing else
    resolved = {i["discrepancy_type"]: i["resolution_code"] for i in new if i["status"] == "RESOLVED"}
    assert resolved == {"MISSING_INTERNAL": "MISSING_COST_BOOKED", "LATE_CHARGE": "LATE_LINE_BOOKED",
                        "PROVIDER_CREDIT_NOT_APPLIED": "CREDIT_APPLIED"}
    assert (doc["previous_open_items"], doc["new_items"], doc["resolved_items"], doc["open_items"], doc["auto_fixed"]) == \
        (0, 10, 3, 7, 3)
    # Day D in USD (the EUR line is not summed; ln-late occurred on D-6): external 2.45 = 0.25 (mi) + 0.75 (am) + 0.50
    # (dup) + 0.20 (tsm) + 0.25 (ghost) + 0.20 - 0.20 (cr) + 0.25 (ok, once) + 0.25 (comp); internal 1.70 = am, dup,
    # cur, ok, comp, pend at 0.25 + cr at 0.20. Gross: mi .25 + am .50 + dup .25 + tsm .20 + ghost .25 + cr .20 +
    # cur .25 + pend .25.
    assert (doc["external_amount"], doc["internal_amount"], doc["gross_drift"], doc["net_drift"]) == \
        ("2.4500", "1.7000", "2.1500", "0.7500")
    assert (doc["lines_total"], doc["lines_matched"]) == (11, 6)
    after = metrics.snapshot()
    unreconciled = conn.execute("""select coalesce(sum(internal_amount), 0) as s from reconciliation_item where status = 'OPEN'
                                    and discrepancy_type in ('PENDING_WITHIN_GRACE', 'MISSING_EXTERNAL')""").fetchone()["s"]
    assert after["UnreconciledCost"] - before.get("UnreconciledCost", 0) == pytest.approx(float(unreconciled))  # a gauge
    assert after["ReconciliationBreaks"] - before.get("ReconciliationBreaks", 0) == 6  # the open items but the pending one

    items = by_type(doc)
    assert items["AMOUNT_MISMATCH"]["internal_amount"] == "0.2500" and items["AMOUNT_MISMATCH"]["external_amount"] == "0.7500"
    assert items["DUPLICATE_EXTERNAL"]["external_line_id"] == "ln-dup2" and items["DUPLICATE_EXTERNAL"]["status"] == "OPEN"
    assert items["CURRENCY_MISMATCH"]["currency"] == "EUR"
    assert items["TASK_STATUS_MISMATCH"]["attempt_id"] == str(a["tsm"].attempt_id)
    # An item about another day of the window is in that day's report, not in this one (me's cost was on D-2).
    assert "MISSING_EXTERNAL" not in items
    missing = next(i for i in new if i["discrepancy_type"] == "MISSING_EXTERNAL")
    assert missing["attempt_id"] == a["me"].attempt_id and missing["billing_date"] == D - timedelta(days=2)
    pending = items["PENDING_WITHIN_GRACE"]
    assert pending["attempt_id"] == str(a["pend"].attempt_id)
    assert pending["evidence"]["becomes_missing_external_on"] == (D + timedelta(days=2)).isoformat()
    unmapped = items["UNMAPPED_PROVIDER_TASK"]
    assert unmapped["external_line_id"] == "ln-ghost" and unmapped["attempt_id"] is None
    assert [c["attempt_id"] for c in unmapped["evidence"]["candidates"]] == [str(a["cand"].attempt_id)]  # proposed only
    ghost = conn.execute("select attempt_id from provider_invoice_line where provider = 'inv-seed' and line_id = 'ln-ghost'"
                         ).fetchone()
    assert ghost["attempt_id"] is None

    # The fixes are appended cost events (source INVOICE): the missing cost and the credit note; ln-late's
    # attempt had its cost already.
    fixes = {(c["attempt_id"], c["event_type"], c["amount"], c["external_line_id"]) for c in invoice_costs(conn, "inv-seed")}
    assert fixes == {(a["mi"].attempt_id, "GENERATION", Decimal("0.25"), "ln-mi"),
                     (a["cr"].attempt_id, "CREDIT_NOTE", Decimal("-0.20"), "ln-cr-credit")}
    parked = {r["reason"]: r for r in conn.execute(
        "select reason, status, resolution from billing_parked_event where attempt_id = any(%s)",
        ([a["mi"].attempt_id, a["comp"].attempt_id],)).fetchall()}
    assert parked["COST_UNKNOWN"]["status"] == "RESOLVED" and "ln-mi" in parked["COST_UNKNOWN"]["resolution"]
    assert parked["COST_WITHOUT_CHARGE_ID"]["status"] == "RESOLVED" and "ch-comp" in parked["COST_WITHOUT_CHARGE_ID"]["resolution"]

    # The report: the same document archived as JSON, and an HTML page, beside the documents.
    home = Path(p.settings.home) / "invoices"
    assert json.loads((home / r.report_key).read_text()) == json.loads(json.dumps(doc, default=str))
    page = (home / r.report_html_key).read_text()
    assert "AMOUNT_MISMATCH" in page and "<script" not in page
    raw = stub.answers[(ACCOUNT, D.isoformat())][1]
    assert (home / "inv-seed" / D.isoformat() / f"{sha256_hex(raw)}.json").read_bytes() == raw

    again = invoices.reconcile_day(p, "inv-seed", D).document
    assert again["run_id"] == doc["run_id"]  # the same source: the same run
    assert (again["status"], again["previous_open_items"], again["new_items"], again["resolved_items"], again["open_items"],
            again["auto_fixed"]) == ("COMPLETE", 7, 0, 0, 7, 0)
    assert {k: again[k] for k in ("external_amount", "internal_amount", "gross_drift", "net_drift")} == \
        {k: doc[k] for k in ("external_amount", "internal_amount", "gross_drift", "net_drift")}
    assert len(items_of(conn, "inv-seed")) == 10 and len(invoice_costs(conn, "inv-seed")) == 2
    cursor = conn.execute("select complete_through from provider_invoice_cursor where provider = 'inv-seed'").fetchone()
    assert cursor["complete_through"] == D
    earlier = invoices.reconcile_day(p, "inv-seed", D - timedelta(days=2)).document
    assert [(i["discrepancy_type"], i["attempt_id"]) for i in earlier["items"]] == [("MISSING_EXTERNAL", str(a["me"].attempt_id))]


def test_a_line_id_reused_with_other_content_and_a_charge_id_imported_twice(world, stub, conn):
    p = world("inv-dups")
    s = Seeder(p, "inv-dups")
    a = s.attempt("x", cost="0.25")
    first = line("ln-x", charge="ch-x", job=a.job_id)
    stub.serve(ACCOUNT, D, [first, first])
    assert invoices.reconcile_day(p, "inv-dups", D).document["new_items"] == 0  # an exact repeat is the same line
    # The next day's document lists ln-x again with another amount, and the same charge under another line id.
    stub.serve(ACCOUNT, D + timedelta(days=1), [{**first, "amount": "0.9900"}, line("ln-x-again", charge="ch-x", job=a.job_id)])
    p.clock.advance(86400)
    doc = invoices.reconcile_day(p, "inv-dups", D + timedelta(days=1)).document
    got = sorted((i["discrepancy_type"], i["status"], i["resolution_code"], i["external_line_id"]) for i in doc["items"])
    assert got == [("DUPLICATE_EXTERNAL", "OPEN", None, "ln-x"), ("DUPLICATE_EXTERNAL", "RESOLVED", "SAME_CHARGE_ID", "ln-x-again")]
    reused = next(i for i in doc["items"] if i["status"] == "OPEN")
    assert reused["evidence"]["stored"]["amount"] == "0.2500" and reused["evidence"]["incoming"]["amount"] == "0.9900"
    stored = conn.execute("select amount from provider_invoice_line where provider = 'inv-dups' and line_id = 'ln-x'").fetchone()
    assert stored["amount"] == Decimal("0.25")  # the first version stands
    day = invoices.reconcile_day(p, "inv-dups", D).document
    assert (day["external_amount"], day["internal_amount"], day["gross_drift"]) == ("0.2500", "0.2500", "0.0000")  # once


# --- bad input ------------------------------------------------------------------------------------------

def test_a_5xx_makes_the_day_incomplete_and_a_rerun_after_recovery_completes_it(world, stub, conn):
    p = world("inv-5xx")
    a = Seeder(p, "inv-5xx").attempt("y", cost="0.25")
    stub.serve(ACCOUNT, D, status=503, body=b'{"error": {"code": "UNAVAILABLE", "message": "try later"}}')
    doc = invoices.reconcile_day(p, "inv-5xx", D).document
    assert doc["status"] == "INCOMPLETE"
    [reason] = doc["incomplete_reasons"]
    assert reason["code"] == "PROVIDER_UNAVAILABLE"
    assert reason["evidence"]["http_status"] == 503 and reason["evidence"]["date"] == D.isoformat()
    assert "try later" in reason["evidence"]["body"]
    assert by_type(doc)["PENDING_WITHIN_GRACE"]["attempt_id"] == str(a.attempt_id)  # nothing was summed or dropped
    assert conn.execute("select count(*) as n from provider_invoice_cursor where provider = 'inv-5xx'").fetchone()["n"] == 0
    run = conn.execute("select status, incomplete_reasons from reconciliation_run where run_id = %s", (doc["run_id"],)).fetchone()
    assert run["status"] == "INCOMPLETE" and run["incomplete_reasons"][0]["code"] == "PROVIDER_UNAVAILABLE"

    stub.serve(ACCOUNT, D, [line("ln-y", charge="ch-y", job=a.job_id)])
    after = invoices.reconcile_day(p, "inv-5xx", D).document
    assert after["status"] == "COMPLETE" and after["run_id"] != doc["run_id"]
    assert (after["new_items"], after["resolved_items"], after["open_items"], after["lines_matched"]) == (0, 1, 0, 1)
    assert by_type(after)["PENDING_WITHIN_GRACE"]["resolution_code"] == "LINE_ARRIVED"
    assert conn.execute("select complete_through from provider_invoice_cursor where provider = 'inv-5xx'"
                        ).fetchone()["complete_through"] == D


@pytest.mark.parametrize("body", [
    b'{"lines": [{"line_id": "ln-bad", "charge_id": "c", "account_id": "account-01", "model": "m", "type": "refund", '
    b'"amount": "1.00", "currency": "USD", "occurred_at": "2026-06-24T10:00:00Z"}]}',
    b"<html>maintenance</html>",
], ids=["unknown-line-type", "not-json"])
def test_a_malformed_document_is_archived_and_makes_the_day_incomplete_with_evidence(world, stub, conn, body):
    name = f"inv-bad-{uuid.uuid4().hex[:6]}"
    p = world(name)
    stub.serve(ACCOUNT, D, body=body)
    r = invoices.reconcile_day(p, name, D)
    assert r.document["status"] == "INCOMPLETE"
    [reason] = r.document["incomplete_reasons"]
    ev = reason["evidence"]
    assert reason["code"] == "MALFORMED_DOCUMENT" and ev["sha256"] == sha256_hex(body) and ev["http_status"] == 200
    assert (Path(p.settings.home) / "invoices" / ev["archive_key"]).read_bytes() == body  # kept as the provider said it
    assert conn.execute("select count(*) as n from provider_invoice_line where provider = %s", (name,)).fetchone()["n"] == 0
    doc_row = conn.execute("select status, line_count from provider_invoice_document where provider = %s and invoice_date = %s",
                           (name, D)).fetchone()
    assert doc_row == {"status": "MALFORMED", "line_count": None}


def test_an_unknown_account_and_an_unknown_job_are_unmapped(world, stub, conn):
    p = world("inv-unk")
    stub.serve(ACCOUNT, D, [line("ln-acct", charge="ch-a", job="job-a", account="account-99"),
                            line("ln-job", charge="ch-b", job="job-b")])
    doc = invoices.reconcile_day(p, "inv-unk", D).document
    reasons = {i["external_line_id"]: i["evidence"]["reason"] for i in doc["items"]}
    assert reasons == {"ln-acct": "UNKNOWN_ACCOUNT", "ln-job": "UNKNOWN_JOB"}
    assert {i["discrepancy_type"] for i in doc["items"]} == {"UNMAPPED_PROVIDER_TASK"}
    assert doc["status"] == "COMPLETE" and doc["gross_drift"] == doc["external_amount"] == "0.5000"


def test_empty_where_charged_is_incomplete_and_the_maintenance_run_completes_it_when_the_late_line_comes(world, stub, conn):
    p = world("inv-empty", now=datetime(2026, 6, 25, 6, 0, tzinfo=timezone.utc))
    a = Seeder(p, "inv-empty").attempt("z", cost="0.25", occurred=at(D, 23))
    report = invoices.run_once(p)  # yesterday is D
    assert not report.complete and report.details["inv-empty"][D.isoformat()]["incomplete"] == ["EMPTY_WHERE_CHARGED"]
    assert [d["status"] for d in report.details["inv-empty"].values()] == ["INCOMPLETE"] + ["COMPLETE"] * 3  # D, then D-3..D-1
    run = conn.execute("select incomplete_reasons from reconciliation_run where provider = 'inv-empty' and lower(billing_period) = %s",
                       (D,)).fetchone()
    assert run["incomplete_reasons"][0]["evidence"]["attempt_ids"] == [str(a.attempt_id)]
    # The line comes a day late, on the next day's invoice; the next maintenance run reads it, then completes D.
    stub.serve(ACCOUNT, D + timedelta(days=1), [line("ln-z", charge="ch-z", job=a.job_id, occurred=at(D, 23))])
    p.clock.advance(86400)
    report = invoices.run_once(p)
    days = report.details["inv-empty"]
    assert list(days) == [(D + timedelta(days=1)).isoformat(), D.isoformat()]  # yesterday first, then the unfinished day
    assert all(d["status"] == "COMPLETE" for d in days.values()) and report.complete
    [item] = items_of(conn, "inv-empty")
    assert (item["discrepancy_type"], item["status"], item["resolution_code"]) == ("PENDING_WITHIN_GRACE", "RESOLVED",
                                                                                    "LINE_ARRIVED")
    latest = invoices.reconcile_day(p, "inv-empty", D).document
    assert (latest["external_amount"], latest["internal_amount"], latest["gross_drift"]) == ("0.2500", "0.2500", "0.0000")
    assert conn.execute("select complete_through from provider_invoice_cursor where provider = 'inv-empty'"
                        ).fetchone()["complete_through"] == D + timedelta(days=1)


def test_each_account_has_its_invoice_and_one_empty_where_charged_is_named(world, stub, conn):
    p = world("inv-accts", accounts=(ACCOUNT, "account-02"))
    one = Seeder(p, "inv-accts").attempt("one", cost="0.25")
    two = Seeder(p, "inv-accts", account="account-02").attempt("two", cost="0.25")
    stub.serve(ACCOUNT, D, [line("ln-one", charge="ch-one", job=one.job_id)])
    doc = invoices.reconcile_day(p, "inv-accts", D).document
    assert doc["status"] == "INCOMPLETE" and [r["code"] for r in doc["incomplete_reasons"]] == ["EMPTY_WHERE_CHARGED"]
    ev = doc["incomplete_reasons"][0]["evidence"]
    assert (ev["account_id"], ev["date"], ev["attempt_ids"]) == ("account-02", D.isoformat(), [str(two.attempt_id)])
    assert (ACCOUNT, D.isoformat()) in stub.requests and ("account-02", D.isoformat()) in stub.requests
    stub.serve("account-02", D, [line("ln-two", charge="ch-two", job=two.job_id, account="account-02")])
    doc = invoices.reconcile_day(p, "inv-accts", D).document
    assert doc["status"] == "COMPLETE" and doc["lines_matched"] == 2 and doc["gross_drift"] == "0.0000"


def test_a_continuity_break_makes_the_run_incomplete(world, stub, conn, monkeypatch):
    p = world("inv-cont")
    s = Seeder(p, "inv-cont")
    s.attempt("k", cost="0.25")
    billed = s.attempt("b", cost="0.25")
    stub.serve(ACCOUNT, D, [line("ln-b", charge="ch-b", job=billed.job_id)])  # not empty: only continuity can fail
    assert invoices.reconcile_day(p, "inv-cont", D).document["open_items"] == 1  # pending
    real = invoices.items.check_internal

    def and_someone_resolves_an_item_meanwhile(db, ctx, tally):
        out = real(db, ctx, tally)
        db.transaction(lambda c: c.execute("""update reconciliation_item set status = 'RESOLVED', resolved_at = now()
                                                where provider = 'inv-cont' and status = 'OPEN'"""))
        return out

    monkeypatch.setattr(invoices.items, "check_internal", and_someone_resolves_an_item_meanwhile)
    doc = invoices.reconcile_day(p, "inv-cont", D).document
    assert doc["status"] == "INCOMPLETE"
    [reason] = doc["incomplete_reasons"]
    assert reason["code"] == "CONTINUITY"
    assert {k: reason["evidence"][k] for k in ("previous_open", "new", "resolved", "expected_open", "open")} == \
        {"previous_open": 1, "new": 0, "resolved": 0, "expected_open": 1, "open": 0}


def test_the_overlap_window_reaches_back_from_the_cursor():
    assert invoices.window(D, None, 3)[0] == D - timedelta(days=3)
    assert invoices.window(D, D - timedelta(days=1), 3) == [D - timedelta(days=i) for i in (3, 2, 1, 0)]
    assert invoices.window(D, D - timedelta(days=10), 2)[0] == D - timedelta(days=11)  # from the oldest unreconciled day
    assert invoices.window(D, D - timedelta(days=100), 2)[0] == D - timedelta(days=invoices.MAX_WINDOW_DAYS)
    assert invoices.window(D, D + timedelta(days=5), 1) == [D - timedelta(days=1), D]  # an old day rerun


def test_missing_external_after_the_grace_and_a_late_line_resolves_it(world, stub, conn):
    p = world("inv-grace")
    a = Seeder(p, "inv-grace").attempt("g", cost="0.25", occurred=at(D - timedelta(days=2)))
    stub.serve(ACCOUNT, D - timedelta(days=3), [line("ln-other", charge="ch-other", job="job-other",
                                                     occurred=at(D - timedelta(days=3)))])
    stub.serve(ACCOUNT, D - timedelta(days=2), [line("ln-filler", charge="ch-f", job="job-f", occurred=at(D - timedelta(days=2)))])
    def item(kind: str) -> dict:
        return next(i for i in items_of(conn, "inv-grace") if i["discrepancy_type"] == kind)

    first = invoices.reconcile_day(p, "inv-grace", D - timedelta(days=1)).document
    assert first["new_items"] == 3 and first["items"] == []  # about D-3 and D-2 (two unmapped lines, a cost): in theirs
    assert item("PENDING_WITHIN_GRACE")["attempt_id"] == a.attempt_id
    assert sorted(i["discrepancy_type"] for i in invoices.reconcile_day(p, "inv-grace", D - timedelta(days=2)).document["items"]) \
        == ["PENDING_WITHIN_GRACE", "UNMAPPED_PROVIDER_TASK"]  # the cost, and ln-filler
    invoices.reconcile_day(p, "inv-grace", D)
    assert item("MISSING_EXTERNAL")["status"] == "OPEN"
    assert item("PENDING_WITHIN_GRACE")["resolution_code"] == "ESCALATED_MISSING_EXTERNAL"
    # Three days later the provider bills it after all.
    late_day = D + timedelta(days=3)
    stub.serve(ACCOUNT, late_day, [line("ln-g", charge="ch-g", job=a.job_id, occurred=at(D - timedelta(days=2)))])
    third = invoices.reconcile_day(p, "inv-grace", late_day).document
    assert item("MISSING_EXTERNAL")["resolution_code"] == "LATE_LINE_ARRIVED"
    t = by_type(third)  # the late line is on this day's invoice: its item is in this day's report
    assert list(t) == ["LATE_CHARGE"]
    assert t["LATE_CHARGE"]["status"] == "RESOLVED" and t["LATE_CHARGE"]["evidence"]["days_late"] == 5


# --- the command ----------------------------------------------------------------------------------------

def test_the_cli_as_documented_prints_the_contract_document_and_audits_who_ran_it(world, stub, conn, db_url, monkeypatch, capsys, tmp_path):
    p = world("inv-cli")
    a = Seeder(p, "inv-cli").attempt("c", cost="0.25")
    stub.serve(ACCOUNT, D, [line("ln-c", charge="ch-c", job=a.job_id, amount="0.3000")])
    cfg = tmp_path / "platform.toml"
    cfg.write_text(f'[[providers]]\nname = "inv-cli"\nbase_url = "{stub.url}"\nwebhook_secret = "{SECRET}"\n'
                   f'[[providers.accounts]]\naccount_id = "{ACCOUNT}"\napi_key = "key-{ACCOUNT}"\n')
    for k, v in {"AIVEDIO_DATABASE_URL": db_url, "AIVEDIO_REDIS_URL": "none", "AIVEDIO_CONFIG": str(cfg),
                 "AIVEDIO_HOME": str(tmp_path)}.items():
        monkeypatch.setenv(k, v)
    cli = Cli(monkeypatch)
    args = ["reconcile", "invoices", "--provider", "inv-cli", "--date", D.isoformat(), "--json"]
    # Without the config serve was given, the provider is unknown: the error says which config it read.
    monkeypatch.delenv("AIVEDIO_CONFIG")
    assert cli.main(args) == 1
    unknown = json.loads(capsys.readouterr().out)
    assert unknown["error"] == "UNKNOWN_PROVIDER" and "no config file was given" in unknown["message"]
    assert unknown["details"]["config_file"] is None and "inv-cli" not in unknown["details"]["providers"]
    monkeypatch.setenv("AIVEDIO_CONFIG", str(cfg))
    assert cli.main(args) == 0  # as documented: the CLI is trusted, no --operator or role is needed
    out = capsys.readouterr().out
    doc = json.loads(out)
    assert out.count("\n") == 1 and set(doc) == CONTRACT_KEYS
    assert doc["provider"] == "inv-cli" and doc["date"] == D.isoformat() and doc["status"] == "COMPLETE"
    assert [i["discrepancy_type"] for i in doc["items"]] == ["AMOUNT_MISMATCH"]
    assert doc["net_drift"] == "0.0500" and doc["gross_drift"] == "0.0500"
    audit = conn.execute("select operator, action, target from audit_log where action = 'invoice.reconcile'").fetchall()
    # Each run asked for is audited before it starts, the one that found no such provider too.
    assert audit == [{"operator": f"cli:{getpass.getuser()}", "action": "invoice.reconcile",
                      "target": f"invoice:inv-cli:{D.isoformat()}"}] * 2
    with pytest.raises(SystemExit):  # argparse refuses a date that is not YYYY-MM-DD
        cli.main(["reconcile", "invoices", "--provider", "inv-cli", "--date", "2026-6-4", "--json"])


# --- the provider simulator ---------------------------------------------------------------------------------

def test_the_simulators_late_duplicated_and_orphan_lines_end_matched_or_in_an_item(make_platform, conn, tmp_path):
    behaviour = SimulatorBehaviour(seed=23, queue_seconds_min=0, queue_seconds_max=0, latency_seconds_min=1,
                                   latency_seconds_max=2, failure_rate=0.3, failed_but_charged_rate=1.0, credit_note_rate=0.5,
                                   invoice_late_rate=0.5, invoice_duplicate_rate=0.5)
    sim_pc = ProviderConfig(name="inv-sim", webhook_secret=SECRET, accounts=[ProviderAccount(account_id=ACCOUNT,
                                                                                              api_key="sim-key-01")],
                            simulator=behaviour)
    sim = SimulatorServer(sim_pc, behaviour, 100.0, port=0).start()
    try:
        pc = sim_pc.model_copy(update={"base_url": sim.base_url})
        p = make_platform(PlatformConfig(providers=[pc]))
        p.settings = p.settings.model_copy(update={"home": tmp_path})
        adapter = HttpProviderAdapter(pc, sim.base_url)
        seeder = Seeder(p, "inv-sim")
        mapped, orphans = [], []
        for i in range(14):
            key = f"inv-sim-{i:02d}"  # fixed: the simulator draws from the key, so the run reproduces
            req = SubmitRequest(model="video-model-x", prompt="a fox", duration_seconds=4, resolution="720p",
                                client_request_id=key)
            (orphans if i >= 11 else mapped).append((key, adapter.submit(ACCOUNT, key, req).job_id))
        jobs = {job_id: wait_for(lambda j=job_id: (lambda d: d if d.terminal else None)(adapter.get(ACCOUNT, j)))
                for _, job_id in mapped + orphans}
        for key, job_id in mapped:  # the platform's record of each job, as settlement writes it
            job = jobs[job_id]
            charged = job.charge_id is not None
            s = seeder.attempt(f"s{job_id[-6:]}", state=job.status.upper(), billable="BILLABLE" if charged else "NOT_BILLABLE",
                               job=job_id, cost=str(job.usage.cost_amount) if charged else None, charge=job.charge_id,
                               occurred=job.finished_at)
            p.db.transaction(lambda c, s=s, key=key: c.execute(
                "update task_attempt set provider_request_key = %s where attempt_id = %s", (key, s.attempt_id)))
        today = datetime.now(timezone.utc).date()
        first = invoices.reconcile_day(p, "inv-sim", today).document
        tomorrow = invoices.reconcile_day(p, "inv-sim", today + timedelta(days=1)).document  # the late lines
        final = invoices.reconcile_day(p, "inv-sim", today).document
        adapter.close()
        truth = sim.truth
    finally:
        sim.stop()
    assert final["status"] == "COMPLETE" and tomorrow["status"] == "COMPLETE", (final["incomplete_reasons"],
                                                                                   tomorrow["incomplete_reasons"])
    lines = {ln["line_id"]: ln for ln in truth["invoice_lines"]}
    assert any(ln["copies"] == 2 for ln in lines.values()) and any(ln["billed_date"] != ln["occurred_at"][:10]
                                                                   for ln in lines.values())
    rows = {r["line_id"]: r for r in conn.execute("select * from provider_invoice_line where provider = 'inv-sim'").fetchall()}
    assert set(rows) == set(lines)  # every line once, duplicates included
    items = items_of(conn, "inv-sim")
    with_item = defaultdict(list)
    for i in items:
        with_item[i["external_line_id"]].append(i)
    orphan_jobs = {j for _, j in orphans}
    for lid, ln in lines.items():
        open_items = [i for i in with_item[lid] if i["status"] == "OPEN"]
        if ln["job_id"] in orphan_jobs:
            assert [i["discrepancy_type"] for i in with_item[lid]] == ["UNMAPPED_PROVIDER_TASK"], lid
        elif ln["type"] == "credit_note":
            assert [(i["discrepancy_type"], i["resolution_code"]) for i in with_item[lid]] == \
                [("PROVIDER_CREDIT_NOT_APPLIED", "CREDIT_APPLIED")]
        else:
            assert rows[lid]["attempt_id"] is not None and not open_items, (lid, with_item[lid])
    assert {i["discrepancy_type"] for i in items} <= {"UNMAPPED_PROVIDER_TASK", "PROVIDER_CREDIT_NOT_APPLIED",
                                                      "PENDING_WITHIN_GRACE"}
    assert all(i["status"] == "RESOLVED" for i in items if i["discrepancy_type"] == "PENDING_WITHIN_GRACE")
    # The day's totals from the simulator's own truth: external per job (charges less credits, each line
    # once), internal what the platform recorded, gross the sum of absolute differences per job.
    for doc, day in ((final, today), (tomorrow, today + timedelta(days=1))):
        ext, inn = defaultdict(Decimal), defaultdict(Decimal)
        for ln in lines.values():
            if ln["occurred_at"][:10] == day.isoformat():
                ext[ln["job_id"]] += Decimal(ln["amount"]) * (-1 if ln["type"] == "credit_note" else 1)
        for key, job_id in mapped:
            job = jobs[job_id]
            if job.charge_id is not None and job.finished_at.astimezone(timezone.utc).date() == day:
                inn[job_id] += job.usage.cost_amount
        external, internal = sum(ext.values(), Decimal(0)), sum(inn.values(), Decimal(0))
        gross = sum((abs(ext[j] - inn[j]) for j in set(ext) | set(inn)), Decimal(0))
        assert (Decimal(doc["external_amount"]), Decimal(doc["internal_amount"]), Decimal(doc["gross_drift"]),
                Decimal(doc["net_drift"])) == (external, internal, gross, external - internal), day
    assert Decimal(final["external_amount"]) > 0
    # Today's documents did not change, so the last run is the first one's source again: the same run, nothing new;
    # what it had pending waited for lines on tomorrow's invoice.
    assert final["run_id"] == first["run_id"] and final["new_items"] == 0
    assert sum(i["discrepancy_type"] == "PENDING_WITHIN_GRACE" for i in first["items"]) == len(
        {ln["job_id"] for ln in lines.values() if ln["type"] == "charge" and ln["job_id"] not in orphan_jobs
         and ln["billed_date"] != ln["occurred_at"][:10]})
