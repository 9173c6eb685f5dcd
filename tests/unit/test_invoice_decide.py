"""The pure decisions of invoice reconciliation (aivedio.spend.invoice_matching.decide_*), without a database:
what each combination of an attempt, its lines and its cost events is."""
from __future__ import annotations

import uuid
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

import pytest

from aivedio.spend.invoice_matching import Attempt, Cost, Ctx, Line, decide_attempt, decide_internal, money, next_month

T = datetime(2026, 6, 24, 10, tzinfo=timezone.utc)
DAY = T.date()
TOL = Decimal("0.0001")


STAGE = {"SUCCEEDED": "PROVIDER_SUCCEEDED", "FAILED": "PROVIDER_FAILED", "CANCELLED": "PROVIDER_RUNNING"}


def attempt(state="SUCCEEDED", billable="BILLABLE", task_state=None, stage=None) -> Attempt:
    """An attempt whose task ended as the attempt did (attempts.lifecycle.finish), unless told otherwise."""
    return Attempt(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), "acct", state, billable, "job-1", "key-1", "m",
                   task_state=task_state or state, final_reason=stage or STAGE.get(state))


def ln(line_id="l1", charge="ch-1", amount="0.25", kind="charge", currency="USD", billed=DAY, at=T) -> Line:
    return Line(line_id, charge, "acct", kind, Decimal(amount), currency, at, billed, "m", "job-1")


def cost(amount="0.25", charge="ch-1", event_type="GENERATION", source="API", currency="USD", line=None) -> Cost:
    return Cost(uuid.uuid4(), event_type, Decimal(amount), currency, source, T, charge, line)


def decide(a, lines, costs, grace=2):
    return decide_attempt(a, lines, costs, provider_currency="USD", tolerance=TOL, grace_days=grace)


def kinds(d) -> list[tuple[str, str, str | None]]:
    return sorted((f.discrepancy_type, f.status, f.resolution_code) for f in d.findings)


def test_an_agreeing_line_is_no_finding_and_settles_what_waited_for_it():
    d = decide(attempt(), [ln()], [cost(amount="0.25009")])  # within the tolerance
    assert d.findings == []
    assert [code for _, code in d.resolve] == ["LINE_ARRIVED", "LATE_LINE_ARRIVED"]
    assert [r for r, _ in d.parked] == ["COST_WITHOUT_CHARGE_ID"]


def test_amount_beyond_the_tolerance_is_a_mismatch_for_review():
    [f] = decide(attempt(), [ln(amount="0.2502")], [cost()]).findings
    assert (f.discrepancy_type, f.status, f.fix) == ("AMOUNT_MISMATCH", "OPEN", None)
    assert f.evidence["difference"] == "0.0002"


def test_no_recorded_cost_is_booked_from_the_line_and_a_late_line_is_a_late_charge():
    [f] = decide(attempt(), [ln()], []).findings
    assert (f.discrepancy_type, f.status, f.resolution_code) == ("MISSING_INTERNAL", "RESOLVED", "MISSING_COST_BOOKED")
    assert (f.fix.event_type, f.fix.amount, f.fix.line_id) == ("GENERATION", Decimal("0.25"), "l1")
    [late] = decide(attempt("FAILED"), [ln(billed=DAY + timedelta(days=3))], []).findings
    assert (late.discrepancy_type, late.fix.event_type) == ("LATE_CHARGE", "FAILED_CHARGE")
    assert decide(attempt(), [ln(billed=DAY + timedelta(days=2))], [cost()]).findings == []  # inside the grace


def test_duplicates_the_same_charge_id_is_counted_once_another_is_a_second_charge():
    d = decide(attempt(), [ln("l1"), ln("l2", at=T + timedelta(seconds=1)),
                           ln("l3", charge="ch-2", at=T + timedelta(seconds=2))], [cost()])
    assert kinds(d) == [("DUPLICATE_EXTERNAL", "OPEN", None), ("DUPLICATE_EXTERNAL", "RESOLVED", "SAME_CHARGE_ID")]
    assert {f.line.line_id for f in d.findings} == {"l2", "l3"}
    # The charge of record is the one whose id the platform recorded, whatever its order.
    d = decide(attempt(), [ln("l1", charge="ch-x"), ln("l2", at=T + timedelta(seconds=1))], [cost()])
    assert [f.line.line_id for f in d.findings] == ["l1"]


@pytest.mark.parametrize("state,billable", [("RUNNING", "NOT_BILLABLE"), ("SUBMIT_UNKNOWN", "NOT_BILLABLE"),
                                            ("NOT_ACCEPTED", "NOT_BILLABLE"), ("FAILED", "NOT_BILLABLE")])
def test_a_charge_the_platform_holds_impossible_is_a_status_mismatch_and_nothing_else(state, billable):
    d = decide(attempt(state, billable), [ln(), ln("l2", charge="ch-2")], [])
    assert kinds(d) == [("TASK_STATUS_MISMATCH", "OPEN", None)] and d.resolve == [] and d.parked == []
    assert d.findings[0].external_amount == Decimal("0.50")


def test_currency_mismatch_is_kept_out_of_everything_else():
    d = decide(attempt(), [ln(currency="EUR")], [cost()])
    assert kinds(d) == [("CURRENCY_MISMATCH", "OPEN", None)]
    assert d.findings[0].evidence["expected_currency"] == "USD"


def test_credit_notes_offsetting_a_charge_are_applied_others_wait():
    a = attempt("FAILED")
    charge = [ln(), ln("c1", kind="credit_note")]
    [f] = decide(a, charge, [cost(event_type="FAILED_CHARGE")]).findings
    assert (f.discrepancy_type, f.resolution_code, f.fix.event_type, f.fix.amount) == \
        ("PROVIDER_CREDIT_NOT_APPLIED", "CREDIT_APPLIED", "CREDIT_NOTE", Decimal("-0.25"))
    assert decide(a, charge, [cost(event_type="FAILED_CHARGE"), cost("-0.25", charge="ch-1#c1", event_type="CREDIT_NOTE",
                                                                      source="INVOICE", line="c1")]).findings == []  # booked
    assert decide(a, charge, [cost(event_type="FAILED_CHARGE"), cost("-0.25", event_type="CREDIT_NOTE")]).findings == []  # own
    [big] = decide(a, [ln(), ln("c1", amount="0.50", kind="credit_note")], [cost(event_type="FAILED_CHARGE")]).findings
    assert (big.status, big.fix) == ("OPEN", None) and "larger" in big.evidence["why"]
    [none] = decide(a, [ln("c1", charge="ch-unknown", kind="credit_note")], [cost(event_type="FAILED_CHARGE")]).findings
    assert none.status == "OPEN" and "offsets no known charge" in none.evidence["why"]


def test_a_charged_attempt_without_a_line_is_pending_until_its_grace_ends():
    a = attempt()
    [p] = decide_internal(a, since=T, amount=Decimal("0.25"), currency="USD", day=DAY + timedelta(days=1), grace_days=2,
                          missing_recorded=False).findings
    assert p.discrepancy_type == "PENDING_WITHIN_GRACE" and p.evidence["becomes_missing_external_on"] == "2026-06-26"
    d = decide_internal(a, since=T, amount=None, currency="USD", day=DAY + timedelta(days=2), grace_days=2,
                        missing_recorded=False)
    assert [f.discrepancy_type for f in d.findings] == ["MISSING_EXTERNAL"] and d.resolve[0][1] == "ESCALATED_MISSING_EXTERNAL"
    assert d.findings[0].evidence["internal_cost"].startswith("unknown")
    assert decide_internal(a, since=T, amount=Decimal("1"), currency="USD", day=DAY, grace_days=2,
                           missing_recorded=True).findings == []  # an older day rerun after it was missing


def test_money_and_booking_periods():
    assert (money(Decimal("0.25")), money(Decimal("1.23456")), money(Decimal("-0.2")), money(None)) == \
        ("0.2500", "1.23456", "-0.2000", None)
    ctx = Ctx(provider="p", currency="USD", accounts=frozenset(), day=DAY, window_first=DAY, run_id=uuid.uuid4(),
              now=T, grace_days=2, tolerance=TOL, batch_size=10, max_batches=1,
              closed_months=frozenset({date(2026, 5, 1), date(2026, 6, 1)}))
    assert ctx.booking(date(2026, 5, 20)) == (date(2026, 7, 1), True)
    assert ctx.booking(date(2026, 7, 3)) == (date(2026, 7, 1), False)
    assert next_month(date(2026, 12, 1)) == date(2027, 1, 1)


def test_money_is_never_in_exponent_notation():
    assert (money(Decimal("1E-8")), money(Decimal("1E+3")), money(Decimal("-0.00000001")), money(Decimal("-0"))) == \
        ("0.00000001", "1000.0000", "-0.00000001", "0.0000")


def test_a_fix_has_the_type_the_platforms_own_record_gets_from_the_task():
    # The provider cancelled the job: the attempt is CANCELLED, the task FAILED; settlement records FAILED_CHARGE.
    [f] = decide(attempt("CANCELLED", task_state="FAILED", stage="PROVIDER_FAILED"), [ln()], []).findings
    assert (f.discrepancy_type, f.fix.event_type) == ("MISSING_INTERNAL", "FAILED_CHARGE")
    # A job the provider completed is GENERATION, whatever the task became after it.
    [f] = decide(attempt("SUCCEEDED", task_state="FAILED", stage="MEDIA_DELIVERY_FAILED"), [ln()], []).findings
    assert f.fix.event_type == "GENERATION"
    # The task has not finished: the type is not known, so nothing is booked and a person looks.
    [f] = decide(attempt("FAILED", task_state="CANCEL_REQUESTED", stage="PROVIDER_QUEUED"), [ln()], []).findings
    assert (f.discrepancy_type, f.status, f.fix, f.resolution_code) == ("MISSING_INTERNAL", "OPEN", None, None)


def test_an_own_charge_beside_a_charge_booked_from_the_line_is_reported_not_summed():
    own = cost(charge="composite:job-1")  # the settlement came after the fix, without a charge id
    booked = cost(charge="ch-1", source="INVOICE", line="l1")
    d = decide(attempt(), [ln()], [own, booked])
    [f] = d.findings
    assert (f.discrepancy_type, f.subject, f.status) == ("AMOUNT_MISMATCH", f"attempt:{f.attempt.attempt_id}:booked-twice",
                                                         "OPEN")
    assert (f.internal_amount, f.external_amount) == (Decimal("0.50"), Decimal("0.25"))
    assert d.parked == []  # the composite-keyed record stays parked for the person
    # The fix alone is the record: deciding again gives the same fix, which its item and line keys make a no-op.
    assert [f.discrepancy_type for f in decide(attempt(), [ln()], [booked]).findings] == ["MISSING_INTERNAL"]


def test_each_credit_note_of_a_charge_is_its_own_fix_while_they_add_up_to_no_more_than_the_charge():
    a = attempt("FAILED")
    charge = cost(event_type="FAILED_CHARGE")
    c1, c2, c3 = (ln(f"c{i}", amount="0.10", kind="credit_note", at=T + timedelta(minutes=i)) for i in (1, 2, 3))
    fs = decide(a, [ln(), c1, c2, c3], [charge]).findings
    assert [(f.line.line_id, f.status, f.fix.charge_id if f.fix else None) for f in fs] == \
        [("c1", "RESOLVED", "ch-1#c1"), ("c2", "RESOLVED", "ch-1#c2"), ("c3", "OPEN", None)]
    assert "add up to more than the charge" in fs[2].evidence["why"]
    # c1 booked by an earlier run counts toward the charge: c2 is booked, c3 still waits.
    fs = decide(a, [ln(), c1, c2, c3], [charge, cost("-0.10", charge="ch-1#c1", event_type="CREDIT_NOTE", source="INVOICE",
                                                     line="c1")]).findings
    assert [(f.line.line_id, f.status) for f in fs] == [("c2", "RESOLVED"), ("c3", "OPEN")]
