"""Invoice lines against the platform's own cost records (ch. 20.10.3 steps 3-8, 20.10.4, 20.10.5): the
import of a document's lines, their match to attempts, the decision of what each discrepancy is, and
the few automatic fixes. aivedio.spend.invoices runs these, in batches, for one provider and day.

Import. A line is stored once per (provider, line_id). An exact repeat of a line (the same id and the
same content, in one document or a later one) is the same line: not a second charge. The same id with
other content is kept out and becomes a DUPLICATE_EXTERNAL item showing both versions.

Match (ch. 20.10.4), always within the line's account: the charge id the platform recorded for an
attempt, then the provider job id, then the idempotency key (the attempt's provider_request_key). A
line that two keys map to different attempts is not matched. A line that none maps is
UNMAPPED_PROVIDER_TASK; candidates by account, model, time window and amount are proposed in its
evidence and never accepted.

Decide (pure functions, `decide_*`). Per attempt, from all its lines and cost events:
- a line in another currency than the attempt's cost (or, without one, the provider's): CURRENCY_MISMATCH,
  never summed or fixed;
- a charge for an attempt the platform holds live or free (no job, failed or cancelled unbilled):
  TASK_STATUS_MISMATCH, and nothing else is decided for it until a person has;
- the charge of record is the line whose charge id the platform recorded, else the first. Another
  line with the same charge id is the same charge imported twice: DUPLICATE_EXTERNAL, fixed (counted
  once). Another charge id for the same job is a second charge: DUPLICATE_EXTERNAL, for review;
- no cost recorded by the platform for a job that maps uniquely: MISSING_INTERNAL, fixed by an
  appended cost event (source INVOICE) and the parked COST_UNKNOWN it settles. Its event type is the
  one the platform's own record has or will have (spend.costs.cost_event_type of the task's state
  and the attempt's stage), so a settlement after the fix meets it on the charge key; while the task
  has not finished that type is unknown, and the item waits for review;
- a charge of the platform's own beside one an earlier run booked from the line (a late settlement
  under a composite key): the cost is recorded twice, AMOUNT_MISMATCH `attempt:<id>:booked-twice`, for
  review (found wherever the lines are: TWICE_BOOKED);
- amounts apart by more than the tolerance: AMOUNT_MISMATCH, for review; when they agree, a parked
  COST_WITHOUT_CHARGE_ID is settled by the line's charge id;
- a line billed more than the grace period after it occurred: LATE_CHARGE, booked to its attempt
  (with the missing cost event if there was none); an open PENDING_WITHIN_GRACE or MISSING_EXTERNAL of
  the attempt is resolved by any charge line that arrives;
- a credit note that offsets a charge of the attempt: PROVIDER_CREDIT_NOT_APPLIED, fixed by an
  appended CREDIT_NOTE cost event of its own (external charge id `<charge id>#<line id>`: a charge may
  have several credit notes) while the credits of that charge add up to no more than the charge; one
  that offsets nothing known, or goes beyond the charge, for review.
And per charged attempt without any charge line: PENDING_WITHIN_GRACE until its grace ends (the date it
becomes MISSING_EXTERNAL is in its evidence), then MISSING_EXTERNAL.

Never: an UPDATE or DELETE of a cost event (fixes are appended, and idempotent on the cost event's own
unique keys), a fuzzy match accepted, a second item for a discrepancy already recorded (items are keyed
by what they are about: a rerun carries the item, whatever its status), a line summed twice."""
from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass, field, replace
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any
from uuid import UUID

import psycopg
from psycopg.types.json import Jsonb

from aivedio.spend import parked
from aivedio.spend.costs import QUANTUM, cost_event_type

CHARGE_EVENT_TYPES = ("GENERATION", "FAILED_CHARGE", "CANCELLATION_FEE")
CREDIT_EVENT_TYPE = "CREDIT_NOTE"
INVOICE_SOURCE = "INVOICE"
# The platform does not know the job has finished: a charge for it contradicts what the platform holds.
LIVE_ATTEMPT_STATES = ("DISPATCHING", "SUBMITTED", "RUNNING", "SUBMIT_UNKNOWN", "MANUAL_REVIEW")
# The platform holds that no job exists: nothing can have been charged.
NO_JOB_ATTEMPT_STATES = ("NOT_ACCEPTED", "REJECTED", "ABSENT_CONFIRMED")
# Fuzzy candidates (ch. 20.10.4), proposed only: attempts of the line's account and model created within
# this window before the line (a render can take hours) or shortly after it, costing within this fraction.
FUZZY_BEFORE = timedelta(hours=6)
FUZZY_AFTER = timedelta(minutes=10)
FUZZY_AMOUNT_FRACTION = Decimal("0.20")
FUZZY_LIMIT = 5

OPEN, RESOLVED = "OPEN", "RESOLVED"
# Resolution codes: the automatic fixes, and what else closes an item by itself.
SAME_CHARGE_ID = "SAME_CHARGE_ID"  # the same charge id imported twice: counted once
MISSING_COST_BOOKED = "MISSING_COST_BOOKED"
LATE_LINE_BOOKED = "LATE_LINE_BOOKED"
CREDIT_APPLIED = "CREDIT_APPLIED"
LINE_ARRIVED = "LINE_ARRIVED"  # a PENDING_WITHIN_GRACE whose line came
LATE_LINE_ARRIVED = "LATE_LINE_ARRIVED"  # a MISSING_EXTERNAL whose line came after all
ESCALATED = "ESCALATED_MISSING_EXTERNAL"  # a PENDING_WITHIN_GRACE whose grace ended
LINE_MAPPED = "LINE_MAPPED"  # an UNMAPPED_PROVIDER_TASK whose line an exact key maps now
AUTO_FIXES = (SAME_CHARGE_ID, MISSING_COST_BOOKED, LATE_LINE_BOOKED, CREDIT_APPLIED)


def money(v: Decimal | None) -> str | None:
    """A plain decimal string with at least four places ("0.2500"), never rounded, never in exponent
    notation (str(Decimal) writes "1E-8")."""
    if v is None:
        return None
    d = Decimal(v)
    q = d.quantize(Decimal("0.0001"))
    out = q if q == d else d.normalize()
    return format(abs(out) if out == 0 else out, "f")  # no "-0.0000"


def _utc_day(t: datetime) -> date:
    return t.astimezone(timezone.utc).date()


def day_bounds(first: date, last: date | None = None) -> tuple[datetime, datetime]:
    """[first 00:00, (last or first) + 1 day 00:00) in UTC."""
    last = last or first
    return (datetime.combine(first, time(), timezone.utc), datetime.combine(last + timedelta(days=1), time(), timezone.utc))


# --- facts ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Line:
    line_id: str
    charge_id: str
    account_id: str
    type: str  # charge | credit_note (its amount is what is credited back, a positive number)
    amount: Decimal
    currency: str
    occurred_at: datetime
    billed_date: date | None = None
    model: str | None = None
    job_id: str | None = None
    idempotency_key: str | None = None
    attempt_id: UUID | None = None
    match_method: str | None = None

    @property
    def day(self) -> date:
        return _utc_day(self.occurred_at)

    @property
    def signed(self) -> Decimal:
        return -self.amount if self.type == "credit_note" else self.amount

    def evidence(self) -> dict[str, Any]:
        return {"line_id": self.line_id, "charge_id": self.charge_id, "job_id": self.job_id,
                "idempotency_key": self.idempotency_key, "account_id": self.account_id, "model": self.model,
                "type": self.type, "amount": money(self.amount), "currency": self.currency,
                "occurred_at": self.occurred_at.isoformat(), "billed_date": self.billed_date and self.billed_date.isoformat(),
                "match_method": self.match_method}

    @classmethod
    def from_row(cls, r: dict) -> "Line":
        return cls(line_id=r["line_id"], charge_id=r["charge_id"], account_id=r["account_id"], type=r["type"],
                   amount=Decimal(r["amount"]), currency=r["currency"], occurred_at=r["occurred_at"],
                   billed_date=r.get("billed_date"), model=r.get("model"), job_id=r.get("job_id"),
                   idempotency_key=r.get("idempotency_key"), attempt_id=r.get("attempt_id"),
                   match_method=r.get("match_method"))


@dataclass(frozen=True)
class Attempt:
    attempt_id: UUID
    task_id: UUID
    tenant_id: UUID
    provider_account: str
    state: str
    billable_state: str
    provider_job_id: str | None = None
    provider_request_key: str | None = None
    model_code: str | None = None
    task_state: str | None = None  # the task's state, and the stage the attempt ended in (task_attempt.final_reason):
    final_reason: str | None = None  # what spend.costs derives a cost's event type from

    def evidence(self) -> dict[str, Any]:
        return {"attempt_id": str(self.attempt_id), "task_id": str(self.task_id), "state": self.state,
                "billable_state": self.billable_state, "provider_account": self.provider_account,
                "provider_job_id": self.provider_job_id, "provider_request_key": self.provider_request_key,
                "task_state": self.task_state, "final_reason": self.final_reason}

    @classmethod
    def from_row(cls, r: dict) -> "Attempt":
        return cls(**{k: r[k] for k in ("attempt_id", "task_id", "tenant_id", "provider_account", "state", "billable_state",
                                        "provider_job_id", "provider_request_key", "model_code")},
                   task_state=r.get("task_state"), final_reason=r.get("final_reason"))


def fix_event_type(attempt: Attempt) -> str | None:
    """The event type of a cost booked from an invoice line: the one the platform's own record of the cost
    has or will have (spend.costs.cost_event_type, from the task's state and the attempt's stage), so a
    settlement that comes after the fix meets it on the charge key instead of adding a second cost. None
    while the task has not finished: the type is not known yet."""
    try:
        return cost_event_type(attempt.task_state, attempt.final_reason)  # type: ignore[arg-type]
    except KeyError:
        return None


@dataclass(frozen=True)
class Cost:
    cost_event_id: UUID
    event_type: str
    amount: Decimal
    currency: str
    source: str
    occurred_at: datetime
    charge_id: str | None = None
    line_id: str | None = None

    @property
    def own(self) -> bool:
        """The platform's own record (a callback, a poll), as opposed to what an invoice run appended."""
        return self.source != INVOICE_SOURCE

    def evidence(self) -> dict[str, Any]:
        return {"cost_event_id": str(self.cost_event_id), "event_type": self.event_type, "amount": money(self.amount),
                "currency": self.currency, "source": self.source, "charge_id": self.charge_id,
                "occurred_at": self.occurred_at.isoformat()}

    @classmethod
    def from_row(cls, r: dict) -> "Cost":
        return cls(cost_event_id=r["cost_event_id"], event_type=r["event_type"], amount=Decimal(r["amount"]),
                   currency=r["currency"], source=r["source"], occurred_at=r["occurred_at"],
                   charge_id=r.get("external_charge_id"), line_id=r.get("external_line_id"))


@dataclass(frozen=True)
class Fix:
    """An appended provider_cost_event (source INVOICE): the only write an automatic fix makes."""

    event_type: str
    amount: Decimal  # signed: a credit note's is negative
    charge_id: str
    line_id: str
    occurred_at: datetime


@dataclass(frozen=True)
class Finding:
    discrepancy_type: str
    subject: str  # "line:<line id>" or "attempt:<attempt id>"
    billing_date: date
    currency: str
    evidence: dict[str, Any]
    status: str = OPEN
    resolution_code: str | None = None
    line: Line | None = None
    attempt: Attempt | None = None
    internal_amount: Decimal | None = None
    external_amount: Decimal | None = None
    fix: Fix | None = None

    @property
    def key(self) -> str:
        return f"{self.discrepancy_type}:{self.subject}"


@dataclass
class Decision:
    findings: list[Finding] = field(default_factory=list)
    resolve: list[tuple[str, str]] = field(default_factory=list)  # (item key, resolution code): only OPEN items move
    parked: list[tuple[str, str]] = field(default_factory=list)  # (billing_parked_event reason, resolution)


def item_key(discrepancy_type: str, subject: str) -> str:
    return f"{discrepancy_type}:{subject}"


# --- the decisions (pure) ---------------------------------------------------------------------------------

def decide_attempt(attempt: Attempt, lines: list[Line], costs: list[Cost], *, provider_currency: str, tolerance: Decimal,
                   grace_days: int) -> Decision:
    """What the lines matched to one attempt say against its cost events (see the module docstring)."""
    out = Decision()
    own = [c for c in costs if c.own]
    own_charges = [c for c in own if c.event_type in CHARGE_EVENT_TYPES and c.amount != 0]
    # Charges an earlier run booked from a line (a fix): beside an own charge, the cost is recorded twice.
    booked_charges = [c for c in costs if not c.own and c.event_type in CHARGE_EVENT_TYPES and c.amount != 0]
    currency = own_charges[0].currency if own_charges else own[0].currency if own else provider_currency
    subject_a = f"attempt:{attempt.attempt_id}"
    good: list[Line] = []
    for ln in sorted(lines, key=lambda x: (x.occurred_at, x.line_id)):
        if ln.currency != currency:
            out.findings.append(Finding("CURRENCY_MISMATCH", f"line:{ln.line_id}", ln.day, ln.currency, line=ln, attempt=attempt,
                                        external_amount=ln.amount, evidence={
                                            "line": ln.evidence(), "attempt": attempt.evidence(), "expected_currency": currency,
                                            "why": "a line in another currency than the attempt's cost is neither summed nor fixed"}))
        else:
            good.append(ln)
    charges = [ln for ln in good if ln.type == "charge"]
    credits = [ln for ln in good if ln.type == "credit_note"]
    internal = sum((c.amount for c in own_charges), Decimal(0)) if own_charges else None
    base = {"attempt": attempt.evidence(), "internal_costs": [c.evidence() for c in own]}

    twice = bool(own_charges and booked_charges)
    if twice:
        # The platform's own record came after a fix booked the line (a late settlement, under another type or a
        # composite key): both cost events stand (append-only) and the cost report sums both. A person decides.
        first = charges[0] if charges else None
        booked = sum((c.amount for c in booked_charges), Decimal(0))
        out.findings.append(Finding(
            "AMOUNT_MISMATCH", f"{subject_a}:booked-twice", first.day if first else _utc_day(booked_charges[0].occurred_at),
            currency, line=first, attempt=attempt, internal_amount=internal + booked,
            external_amount=sum((c.amount for c in charges), Decimal(0)) if charges else None,
            evidence={**base, "invoice_costs": [c.evidence() for c in booked_charges],
                      "lines": [c.evidence() for c in charges],
                      "why": "the platform's own cost record and a cost booked from the invoice line both exist for this "
                             "job: the cost is recorded twice (not summed here; the cost report counts both)"}))

    if charges and (attempt.state in LIVE_ATTEMPT_STATES or attempt.state in NO_JOB_ATTEMPT_STATES
                    or (attempt.billable_state == "NOT_BILLABLE" and not own_charges)):
        why = ("the platform still holds this attempt live" if attempt.state in LIVE_ATTEMPT_STATES else
               "the platform holds that this attempt created no job" if attempt.state in NO_JOB_ATTEMPT_STATES else
               "the platform holds this attempt as not billable")
        out.findings.append(Finding("TASK_STATUS_MISMATCH", subject_a, charges[0].day, currency, line=charges[0], attempt=attempt,
                                    internal_amount=internal, external_amount=sum((c.amount for c in charges), Decimal(0)),
                                    evidence={**base, "lines": [c.evidence() for c in charges], "why": why}))
        return out

    primary: Line | None = None
    if charges:
        recorded = {c.charge_id for c in own_charges}
        primary = next((c for c in charges if c.charge_id in recorded), charges[0])
        for ln in charges:
            if ln is primary:
                continue
            same = ln.charge_id == primary.charge_id
            out.findings.append(Finding(
                "DUPLICATE_EXTERNAL", f"line:{ln.line_id}", ln.day, currency, line=ln, attempt=attempt, external_amount=ln.amount,
                status=RESOLVED if same else OPEN, resolution_code=SAME_CHARGE_ID if same else None,
                evidence={**base, "line": ln.evidence(), "charge_of_record": primary.evidence(),
                          "why": "the same charge id under another line id: one charge, counted once" if same else
                                 "a second charge for the same job"}))
        late = primary.billed_date is not None and (primary.billed_date - primary.day).days > grace_days
        ev = {**base, "line": primary.evidence(), "grace_days": grace_days}
        if internal is None:
            kind, code = ("LATE_CHARGE", LATE_LINE_BOOKED) if late else ("MISSING_INTERNAL", MISSING_COST_BOOKED)
            subject = f"line:{primary.line_id}" if late else subject_a
            event_type = fix_event_type(attempt)
            if event_type is None:
                out.findings.append(Finding(kind, subject, primary.day, currency, line=primary, attempt=attempt,
                                            external_amount=primary.amount, evidence={
                                                **ev, "why": "the platform recorded no cost for this job, and its task has not "
                                                             "finished: the type of its own cost record is not known yet, so "
                                                             "the line is not booked"}))
            else:
                fix = Fix(event_type, primary.amount, primary.charge_id, primary.line_id, primary.occurred_at)
                out.findings.append(Finding(kind, subject, primary.day, currency, line=primary, attempt=attempt,
                                            external_amount=primary.amount, status=RESOLVED, resolution_code=code, fix=fix,
                                            evidence={**ev, "why": "the platform recorded no cost for a job that maps "
                                                                   "uniquely: booked from the invoice line"}))
                out.parked.append(("COST_UNKNOWN", f"INVOICE_LINE {primary.line_id}: {money(primary.amount)} {currency}"))
        elif abs(primary.amount - internal) > tolerance:
            out.findings.append(Finding("AMOUNT_MISMATCH", subject_a, primary.day, currency, line=primary, attempt=attempt,
                                        internal_amount=internal, external_amount=primary.amount,
                                        evidence={**ev, "difference": money(primary.amount - internal),
                                                  "tolerance": money(tolerance)}))
        else:
            if not twice:  # a composite-keyed record beside a booked fix is the double record: it stays for the person
                out.parked.append(("COST_WITHOUT_CHARGE_ID", f"INVOICE_LINE {primary.line_id}: charge id {primary.charge_id}"))
            if late:
                out.findings.append(Finding("LATE_CHARGE", f"line:{primary.line_id}", primary.day, currency, line=primary,
                                            attempt=attempt, internal_amount=internal, external_amount=primary.amount,
                                            status=RESOLVED, resolution_code=LATE_LINE_BOOKED,
                                            evidence={**ev, "days_late": (primary.billed_date - primary.day).days}))
        out.resolve.append((item_key("PENDING_WITHIN_GRACE", subject_a), LINE_ARRIVED))
        out.resolve.append((item_key("MISSING_EXTERNAL", subject_a), LATE_LINE_ARRIVED))

    out.findings.extend(_decide_credits(attempt, credits, charges, own_charges, costs, currency, base))
    return out


def _decide_credits(attempt: Attempt, credits: list[Line], charges: list[Line], own_charges: list[Cost], costs: list[Cost],
                    currency: str, base: dict) -> list[Finding]:
    """Credit notes, per charge id in the order they came. Each is its own fix (keyed by its line, so a second
    credit note for the same charge is booked, not taken for the first), applied while the credits of that
    charge add up to no more than the charge."""
    out: list[Finding] = []
    booked = {c.line_id for c in costs if not c.own and c.event_type == CREDIT_EVENT_TYPE and c.line_id}
    # Credits on the platform's own record carry no line id: they cover the charge's credit lines, in order, up to
    # their sum.
    own_left: dict[str, Decimal] = defaultdict(Decimal)
    for c in costs:
        if c.own and c.event_type == CREDIT_EVENT_TYPE and c.charge_id:
            own_left[c.charge_id] += abs(c.amount)
    credited: dict[str, Decimal] = defaultdict(Decimal, {k: v for k, v in own_left.items()})
    for cr in credits:
        if cr.line_id in booked:
            credited[cr.charge_id] += cr.amount
    for cr in credits:
        if cr.line_id in booked:
            continue  # an earlier run booked it: its item says so
        if own_left[cr.charge_id] >= cr.amount:
            own_left[cr.charge_id] -= cr.amount
            continue  # on the platform's own record already
        offsets = [c.amount for c in charges if c.charge_id == cr.charge_id] + \
                  [c.amount for c in own_charges if c.charge_id == cr.charge_id]
        charge = max(offsets) if offsets else None
        total = credited[cr.charge_id] + cr.amount
        ev = {**base, "line": cr.evidence(), "offsets_charge": cr.charge_id, "charge_amount": money(charge),
              "credited_before": money(credited[cr.charge_id]), "credited_with_this": money(total)}
        if charge is not None and total <= charge:
            credited[cr.charge_id] = total
            out.append(Finding("PROVIDER_CREDIT_NOT_APPLIED", f"line:{cr.line_id}", cr.day, currency, line=cr, attempt=attempt,
                               external_amount=-cr.amount, status=RESOLVED, resolution_code=CREDIT_APPLIED,
                               fix=Fix(CREDIT_EVENT_TYPE, -cr.amount, credit_charge_key(cr), cr.line_id, cr.occurred_at),
                               evidence=ev))
        else:
            why = ("the credit note offsets no known charge of this attempt" if charge is None else
                   "the credit note is larger than the charge it names" if cr.amount > charge else
                   "the credit notes for this charge add up to more than the charge")
            out.append(Finding("PROVIDER_CREDIT_NOT_APPLIED", f"line:{cr.line_id}", cr.day, currency, line=cr, attempt=attempt,
                               external_amount=-cr.amount, evidence={**ev, "why": why}))
    return out


def credit_charge_key(cr: Line) -> str:
    """The external_charge_id of a credit booked from a line: per line, as the cost event is unique per (charge id,
    event type) and a charge may have more than one credit note."""
    return f"{cr.charge_id}#{cr.line_id}"


def decide_unmatched(line: Line, *, reason: str, known_account: bool, candidates: list[dict], detail: dict) -> Finding:
    """A line no exact key maps to one attempt: UNMAPPED_PROVIDER_TASK, with candidates proposed only."""
    return Finding("UNMAPPED_PROVIDER_TASK", f"line:{line.line_id}", line.day, line.currency, line=line,
                   external_amount=line.signed, evidence={
                       "line": line.evidence(), "reason": reason, "known_account": known_account, **detail,
                       "candidates": candidates,
                       "candidates_note": "proposed by account, model, time window and amount; never accepted (ch. 20.10.4)"})


def decide_internal(attempt: Attempt, *, since: datetime, amount: Decimal | None, currency: str, day: date,
                    grace_days: int, missing_recorded: bool) -> Decision:
    """A charged attempt with no charge line in any document read so far, as of the invoices through `day`."""
    out = Decision()
    subject = f"attempt:{attempt.attempt_id}"
    x = _utc_day(since)
    becomes = x + timedelta(days=grace_days)
    ev = {"attempt": attempt.evidence(), "charged_on": x.isoformat(), "grace_days": grace_days,
          "becomes_missing_external_on": becomes.isoformat(), "invoices_read_through": day.isoformat(),
          "internal_cost": "unknown (parked COST_UNKNOWN)" if amount is None else money(amount)}
    if day >= becomes:
        out.findings.append(Finding("MISSING_EXTERNAL", subject, x, currency, attempt=attempt, internal_amount=amount, evidence=ev))
        out.resolve.append((item_key("PENDING_WITHIN_GRACE", subject), ESCALATED))
    elif not missing_recorded:
        out.findings.append(Finding("PENDING_WITHIN_GRACE", subject, x, currency, attempt=attempt, internal_amount=amount,
                                    evidence=ev))
    return out


# --- the run's context and tally --------------------------------------------------------------------------

@dataclass
class Ctx:
    provider: str
    currency: str
    accounts: frozenset[str]
    day: date
    window_first: date
    run_id: UUID
    now: datetime
    grace_days: int
    tolerance: Decimal
    batch_size: int
    max_batches: int
    closed_months: frozenset[date] = frozenset()

    def booking(self, day: date) -> tuple[date, bool]:
        """The month an item of `day` is booked in: its own, or the next open one when its own is closed."""
        own = month_start(day)
        m = own
        while m in self.closed_months:
            m = next_month(m)
        return m, m != own


@dataclass
class Tally:
    new: int = 0
    resolved: int = 0
    auto_fixed: int = 0
    breaks: int = 0  # new items that wait for a person
    batches: int = 0
    examined: int = 0
    imported: int = 0
    repeats: int = 0
    parked_resolved: int = 0
    more: bool = False  # max_batches ran out: the next run carries on
    by_type: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # The days whose figures or items this run changed: the day of each line it imported, of each item it
    # created or resolved (a late line changes the day it occurred on; see aivedio.spend.invoices).
    touched: set[date] = field(default_factory=set)

    def merge(self, other: "Tally") -> None:
        for k in ("new", "resolved", "auto_fixed", "breaks", "batches", "examined", "imported", "repeats", "parked_resolved"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        for k, v in other.by_type.items():
            self.by_type[k] += v
        self.touched |= other.touched


def counted(db, tally: Tally, fn):
    """db.transaction(fn(conn, t)) where t counts only what the committed attempt did (a transaction retried
    after a serialization failure starts its counts again), then added to `tally`."""
    box: list[Tally] = []

    def attempt(conn):
        box[:] = [Tally()]
        return fn(conn, box[0])

    out = db.transaction(attempt)
    tally.merge(box[0])
    return out


def month_start(d: date) -> date:
    return d.replace(day=1)


def next_month(m: date) -> date:
    return (m.replace(day=28) + timedelta(days=4)).replace(day=1)


# --- SQL ----------------------------------------------------------------------------------------------------

IMPORT_LINES = """
with incoming as (
    select * from unnest(%(line_ids)s::text[], %(charge_ids)s::text[], %(job_ids)s::text[], %(keys)s::text[],
                         %(accounts)s::text[], %(models)s::text[], %(types)s::text[], %(amounts)s::numeric[],
                         %(currencies)s::text[], %(occurred)s::timestamptz[], %(digests)s::text[], %(raws)s::jsonb[])
        with ordinality as u(line_id, charge_id, job_id, idempotency_key, account_id, model, type, amount, currency,
                             occurred_at, line_sha256, raw, n)),
ins as (
    insert into provider_invoice_line (provider, line_id, charge_id, job_id, idempotency_key, account_id, model, type, amount,
                                       currency, occurred_at, run_id, first_seen_at, billed_date, source_sha256, line_sha256, raw)
    select %(provider)s, line_id, charge_id, job_id, idempotency_key, account_id, model, type, amount, currency, occurred_at,
           %(run_id)s, %(now)s, %(billed)s, %(source)s, line_sha256, raw
      from incoming
    on conflict (provider, line_id) do nothing
    returning line_id)
select u.line_id, (ins.line_id is not null) as new, l.line_sha256 as stored_sha256, l.raw as stored_raw
  from incoming u
  left join ins on ins.line_id = u.line_id
  left join provider_invoice_line l on l.provider = %(provider)s and l.line_id = u.line_id
 order by u.n
"""

# The lines a run looks at: those that occurred in its window, and those a document of the window listed
# (here: those not mapped to an attempt yet).
WINDOW_LINES = """
select * from provider_invoice_line
 where provider = %(provider)s and line_id > %(after)s and attempt_id is null
   and ((occurred_at >= %(start)s and occurred_at < %(end)s) or (billed_date >= %(first)s and billed_date <= %(last)s))
 order by line_id
 limit %(limit)s
   for update skip locked
"""

WINDOW_ATTEMPTS = """
select distinct attempt_id from provider_invoice_line
 where provider = %(provider)s and attempt_id is not null and attempt_id > %(after)s
   and ((occurred_at >= %(start)s and occurred_at < %(end)s) or (billed_date >= %(first)s and billed_date <= %(last)s))
 order by attempt_id
 limit %(limit)s
"""

MATCH_BY_CHARGE = """
select distinct external_charge_id as value, provider_account_id as account_id, attempt_id
  from provider_cost_event
 where provider = %(provider)s and external_charge_id = any(%(values)s) and attempt_id is not null
"""
MATCH_BY_JOB = """
select provider_job_id as value, provider_account as account_id, attempt_id
  from task_attempt where provider = %(provider)s and provider_job_id = any(%(values)s)
"""
MATCH_BY_KEY = """
select provider_request_key as value, provider_account as account_id, attempt_id
  from task_attempt where provider = %(provider)s and provider_request_key = any(%(values)s)
"""
MATCHERS = (("CHARGE_ID", "charge_id", MATCH_BY_CHARGE), ("PROVIDER_JOB_ID", "job_id", MATCH_BY_JOB),
            ("IDEMPOTENCY_KEY", "idempotency_key", MATCH_BY_KEY))

SET_MATCHES = """
update provider_invoice_line l set attempt_id = m.attempt_id, match_method = m.method, matched_at = %(now)s
  from unnest(%(line_ids)s::text[], %(attempts)s::uuid[], %(methods)s::text[]) as m(line_id, attempt_id, method)
 where l.provider = %(provider)s and l.line_id = m.line_id and l.attempt_id is null
"""

ATTEMPTS = """
select a.attempt_id, a.task_id, a.tenant_id, a.provider_account, a.state, a.billable_state, a.provider_job_id,
       a.provider_request_key, a.model_code, a.final_reason, t.state as task_state
  from task_attempt a join generation_task t on t.task_id = a.task_id
 where a.attempt_id = any(%(ids)s)
"""
ATTEMPT_LINES = "select * from provider_invoice_line where provider = %(provider)s and attempt_id = any(%(ids)s)"
ATTEMPT_COSTS = """
select cost_event_id, attempt_id, external_charge_id, external_line_id, event_type, amount, currency, source, occurred_at
  from provider_cost_event where provider = %(provider)s and attempt_id = any(%(ids)s)
"""
OPEN_PARKED = """
select parked_id, attempt_id, reason from billing_parked_event
 where status = 'OPEN' and reason in ('COST_UNKNOWN', 'COST_WITHOUT_CHARGE_ID') and attempt_id = any(%(ids)s)
"""
# Attempts with a cost booked from an invoice line and, beside it, a charge of the platform's own (it came
# later), not reported yet: decided again wherever their lines are, so the double record becomes an item.
TWICE_BOOKED = """
select distinct f.attempt_id from provider_cost_event f
 where f.provider = %(provider)s and f.source = 'INVOICE' and f.attempt_id > %(after)s and f.amount <> 0
   and f.event_type in ('GENERATION', 'FAILED_CHARGE', 'CANCELLATION_FEE')
   and exists (select 1 from provider_cost_event e
                where e.attempt_id = f.attempt_id and e.source <> 'INVOICE' and e.amount <> 0
                  and e.event_type in ('GENERATION', 'FAILED_CHARGE', 'CANCELLATION_FEE'))
   and not exists (select 1 from reconciliation_item i
                    where i.provider = f.provider and i.item_key = 'AMOUNT_MISMATCH:attempt:' || f.attempt_id || ':booked-twice')
 order by f.attempt_id
 limit %(limit)s
"""
EXISTING_KEYS = "select item_key from reconciliation_item where provider = %(provider)s and item_key = any(%(keys)s)"

FUZZY_CANDIDATES = """
select a.attempt_id, a.task_id, a.provider_account, a.provider_job_id, a.provider_request_key, a.state, a.created_at,
       coalesce(a.actual_cost_amount, a.estimated_cost_amount) as amount
  from task_attempt a
 where a.provider = %(provider)s and (%(account)s::text is null or a.provider_account = %(account)s)
   and a.model_code = %(model)s
   and a.created_at >= %(from)s and a.created_at <= %(to)s
   and abs(coalesce(a.actual_cost_amount, a.estimated_cost_amount) - %(amount)s) <= %(slack)s
   and not exists (select 1 from provider_invoice_line l where l.provider = a.provider and l.attempt_id = a.attempt_id
                      and l.type = 'charge')
 order by abs(extract(epoch from (a.created_at - %(at)s))), a.attempt_id
 limit %(limit)s
"""
ORPHAN_JOB = """
select provider_job_id, provider_account, attempt_id, reason, created_at from orphan_provider_job
 where provider = %(provider)s and provider_job_id = %(job_id)s
"""

BOOK_COST = """
insert into provider_cost_event (attempt_id, tenant_id, task_id, provider, provider_account_id, external_charge_id,
                                 external_line_id, event_type, amount, currency, source, occurred_at, raw_payload_hash)
values (%(attempt_id)s, %(tenant_id)s, %(task_id)s, %(provider)s, %(account)s, %(charge_id)s, %(line_id)s, %(event_type)s,
        %(amount)s, %(currency)s, 'INVOICE', %(occurred_at)s, %(hash)s)
on conflict do nothing
returning cost_event_id
"""
BOOKED_COST = """
select cost_event_id from provider_cost_event
 where provider = %(provider)s and (external_line_id = %(line_id)s
       or (provider_account_id = %(account)s and external_charge_id = %(charge_id)s and event_type = %(event_type)s))
 order by created_at limit 1
"""

INSERT_ITEM = """
insert into reconciliation_item (run_id, provider, item_key, discrepancy_type, tenant_id, task_id, attempt_id, external_line_id,
                                 provider_job_id, internal_amount, external_amount, currency, status, resolution_code,
                                 resolution_cost_event_id, evidence, billing_date, period_month, created_at, resolved_at,
                                 resolved_run_id, resolved_period_month)
values (%(run_id)s, %(provider)s, %(key)s, %(type)s, %(tenant_id)s, %(task_id)s, %(attempt_id)s, %(line_id)s, %(job_id)s,
        %(internal)s, %(external)s, %(currency)s, %(status)s, %(code)s, %(cost_event_id)s, %(evidence)s, %(billing_date)s,
        %(period)s, %(now)s, %(resolved_at)s, %(resolved_run_id)s, %(resolved_period)s)
on conflict (provider, item_key) where item_key is not null do nothing
returning item_id
"""

RESOLVE_ITEM = """
update reconciliation_item
   set status = 'RESOLVED', resolution_code = %(code)s, resolved_at = %(now)s, resolved_run_id = %(run_id)s,
       resolved_period_month = %(period)s, evidence = evidence || %(evidence)s
 where provider = %(provider)s and item_key = %(key)s and status = 'OPEN'
returning billing_date
"""

# Charged attempts of the window (by their first own cost, or a parked COST_UNKNOWN), and the attempts of
# open PENDING_WITHIN_GRACE items, that no charge line maps to yet.
INTERNAL_CANDIDATES = """
with cand as (
    select e.attempt_id from provider_cost_event e
     where e.provider = %(provider)s and e.occurred_at >= %(start)s and e.occurred_at < %(end)s and e.source <> 'INVOICE'
       and e.amount <> 0 and e.event_type <> 'CREDIT_NOTE' and e.attempt_id is not null
    union
    select p.attempt_id from billing_parked_event p join task_attempt a on a.attempt_id = p.attempt_id
     where p.reason = 'COST_UNKNOWN' and p.status = 'OPEN' and a.provider = %(provider)s
       and p.created_at >= %(start)s and p.created_at < %(end)s
    union
    select i.attempt_id from reconciliation_item i
     where i.provider = %(provider)s and i.status = 'OPEN' and i.discrepancy_type = 'PENDING_WITHIN_GRACE'
       and i.attempt_id is not null)
select a.attempt_id, a.task_id, a.tenant_id, a.provider_account, a.state, a.billable_state, a.provider_job_id,
       a.provider_request_key, a.model_code, c.first_cost_at, c.amount, c.currency, u.unknown_since
  from cand join task_attempt a on a.attempt_id = cand.attempt_id
  left join lateral (select min(e.occurred_at) as first_cost_at, sum(e.amount) as amount, min(e.currency) as currency
                       from provider_cost_event e
                      where e.attempt_id = a.attempt_id and e.source <> 'INVOICE' and e.amount <> 0
                        and e.event_type <> 'CREDIT_NOTE') c on true
  left join lateral (select min(p.created_at) as unknown_since from billing_parked_event p
                      where p.attempt_id = a.attempt_id and p.reason = 'COST_UNKNOWN' and p.status = 'OPEN') u on true
 where a.attempt_id > %(after)s
   and not exists (select 1 from provider_invoice_line l
                    where l.provider = %(provider)s and l.attempt_id = a.attempt_id and l.type = 'charge')
 order by a.attempt_id
 limit %(limit)s
"""


# --- import -------------------------------------------------------------------------------------------------

def canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()


def import_lines(conn: psycopg.Connection, ctx: Ctx, tally: Tally, *, lines: list[Line], raws: list[dict], billed: date,
                 source_sha256: str) -> None:
    """Store one batch of a document's lines (each a Line and the object the provider sent for it)."""
    seen: dict[str, str] = {}
    rows: list[tuple[Line, dict, str]] = []
    for ln, raw in zip(lines, raws):
        digest = hashlib.sha256(canonical(raw)).hexdigest()
        if ln.line_id in seen:  # listed twice in this document
            if seen[ln.line_id] == digest:
                tally.repeats += 1
            else:
                _reused_line_id(conn, ctx, tally, ln, raw, digest, stored=next(r for l2, r, _ in rows if l2.line_id == ln.line_id))
            continue
        seen[ln.line_id] = digest
        rows.append((ln, raw, digest))
    if not rows:
        return
    result = conn.execute(IMPORT_LINES, {
        "provider": ctx.provider, "run_id": ctx.run_id, "now": ctx.now, "billed": billed, "source": source_sha256,
        "line_ids": [r[0].line_id for r in rows], "charge_ids": [r[0].charge_id for r in rows],
        "job_ids": [r[0].job_id for r in rows], "keys": [r[0].idempotency_key for r in rows],
        "accounts": [r[0].account_id for r in rows], "models": [r[0].model for r in rows], "types": [r[0].type for r in rows],
        "amounts": [r[0].amount for r in rows], "currencies": [r[0].currency for r in rows],
        "occurred": [r[0].occurred_at for r in rows], "digests": [r[2] for r in rows],
        "raws": [Jsonb(r[1]) for r in rows]}).fetchall()
    for (ln, raw, digest), res in zip(rows, result):
        if res["new"]:
            tally.imported += 1
            tally.touched.add(ln.day)
        elif res["stored_sha256"] == digest:
            tally.repeats += 1  # an exact repeat of a line already imported: the same line
        else:
            _reused_line_id(conn, ctx, tally, ln, raw, digest, stored=res["stored_raw"])


def _reused_line_id(conn, ctx: Ctx, tally: Tally, ln: Line, raw: dict, digest: str, *, stored: Any) -> None:
    """The same line id with other content: kept out of the lines (never summed), shown for review."""
    # The item is about the document that listed the line again: its day.
    f = Finding("DUPLICATE_EXTERNAL", f"line:{ln.line_id}:{digest[:16]}", ln.billed_date or ln.day, ln.currency,
                external_amount=ln.signed,
                evidence={"why": "a line id already imported came again with other content; the first version stands",
                          "stored": stored, "incoming": raw})
    _record(conn, ctx, tally, replace(f, line=ln))


# --- classification -------------------------------------------------------------------------------------------

def classify_window(db, ctx: Ctx, tally: Tally) -> None:
    """Match every line of the window, then decide every attempt they map to (so a decision sees all of an
    attempt's lines whatever batch they came in), batch by batch, each batch its own transaction."""
    start, end = day_bounds(ctx.window_first, ctx.day)
    q = {"provider": ctx.provider, "start": start, "end": end, "first": ctx.window_first, "last": ctx.day,
         "limit": ctx.batch_size}

    def match_batch(conn, t: Tally, after: str) -> list[str]:
        rows = conn.execute(WINDOW_LINES, {**q, "after": after}).fetchall()
        match_lines(conn, ctx, t, [Line.from_row(r) for r in rows])
        return [r["line_id"] for r in rows]

    def decide_batch(conn, t: Tally, after: UUID) -> list[UUID]:
        ids = [r["attempt_id"] for r in conn.execute(WINDOW_ATTEMPTS, {**q, "after": after}).fetchall()]
        decide_attempts(conn, ctx, t, ids)
        return ids

    def twice_batch(conn, t: Tally, after: UUID) -> list[UUID]:
        ids = [r["attempt_id"] for r in conn.execute(TWICE_BOOKED, {**q, "after": after}).fetchall()]
        decide_attempts(conn, ctx, t, ids)
        return ids

    _batches(db, ctx, tally, match_batch, "")
    _batches(db, ctx, tally, decide_batch, UUID(int=0))
    _batches(db, ctx, tally, twice_batch, UUID(int=0))


def _batches(db, ctx: Ctx, tally: Tally, batch, after) -> None:
    """Run batch(conn, tally, after) -> keys, each its own transaction, until a short batch, or max_batches
    (then the next run carries on)."""
    for _ in range(ctx.max_batches):
        keys = counted(db, tally, lambda conn, t: batch(conn, t, after))
        tally.batches += 1
        tally.examined += len(keys)
        if len(keys) < ctx.batch_size:
            return
        after = keys[-1]
    tally.more = True


def match_lines(conn: psycopg.Connection, ctx: Ctx, tally: Tally, lines: list[Line]) -> None:
    """Map the lines not mapped yet to their attempts; a line none maps is UNMAPPED_PROVIDER_TASK."""
    unmatched = [ln for ln in lines if ln.attempt_id is None]
    if not unmatched:
        return
    verdicts = _match(conn, ctx, unmatched)
    matched = {lid: v for lid, v in verdicts.items() if v[0] is not None}
    if matched:
        conn.execute(SET_MATCHES, {"provider": ctx.provider, "now": ctx.now, "line_ids": list(matched),
                                   "attempts": [v[0] for v in matched.values()], "methods": [v[1] for v in matched.values()]})
        # A line an earlier run could not map, mapped now (the job was adopted since): its item is settled.
        _apply(conn, ctx, tally, Decision(resolve=[(item_key("UNMAPPED_PROVIDER_TASK", f"line:{lid}"), LINE_MAPPED)
                                                   for lid in matched]), [])
    for ln in unmatched:
        if ln.line_id in matched:
            continue
        reason, detail = verdicts[ln.line_id][2], verdicts[ln.line_id][3]
        known = ln.account_id in ctx.accounts
        _apply(conn, ctx, tally, Decision(findings=[decide_unmatched(
            ln, reason=reason if known else "UNKNOWN_ACCOUNT", known_account=known,
            candidates=_candidates(conn, ctx, ln, known), detail={**detail, **_orphan(conn, ctx, ln)})]), [])


def decide_attempts(conn: psycopg.Connection, ctx: Ctx, tally: Tally, attempt_ids: list[UUID]) -> None:
    """Decide each attempt from all its lines and cost events, and write what the decisions say."""
    if not attempt_ids:
        return
    q = {"provider": ctx.provider, "ids": attempt_ids}
    attempts = {r["attempt_id"]: Attempt.from_row(r) for r in conn.execute(ATTEMPTS, q).fetchall()}
    by_attempt: dict[UUID, list[Line]] = defaultdict(list)
    for r in conn.execute(ATTEMPT_LINES, q).fetchall():
        by_attempt[r["attempt_id"]].append(Line.from_row(r))
    costs: dict[UUID, list[Cost]] = defaultdict(list)
    for r in conn.execute(ATTEMPT_COSTS, q).fetchall():
        costs[r["attempt_id"]].append(Cost.from_row(r))
    parked_rows: dict[UUID, list[dict]] = defaultdict(list)
    for r in conn.execute(OPEN_PARKED, q).fetchall():
        parked_rows[r["attempt_id"]].append(r)
    for aid in attempt_ids:
        decision = decide_attempt(attempts[aid], by_attempt[aid], costs[aid], provider_currency=ctx.currency,
                                  tolerance=ctx.tolerance, grace_days=ctx.grace_days)
        _apply(conn, ctx, tally, decision, parked_rows.get(aid, []))


def _match(conn: psycopg.Connection, ctx: Ctx, lines: list[Line]) -> dict[str, tuple[UUID | None, str | None, str, dict]]:
    """line id -> (attempt id, method, reason, detail): the first exact key that maps the line, within its
    account, to one attempt, unless another key maps it to a different one."""
    found: dict[str, dict[str, set[tuple[str, UUID]]]] = {ln.line_id: {} for ln in lines}
    for method, attr, sql in MATCHERS:
        values = sorted({getattr(ln, attr) for ln in lines if getattr(ln, attr)})
        if not values:
            continue
        hits: dict[str, set[tuple[str, UUID]]] = defaultdict(set)
        for r in conn.execute(sql, {"provider": ctx.provider, "values": values}).fetchall():
            hits[r["value"]].add((r["account_id"], r["attempt_id"]))
        for ln in lines:
            v = getattr(ln, attr)
            if v and hits.get(v):
                found[ln.line_id][method] = hits[v]
    out: dict[str, tuple[UUID | None, str | None, str, dict]] = {}
    for ln in lines:
        own = {m: {aid for acct, aid in h if acct == ln.account_id} for m, h in found[ln.line_id].items()}
        other = {m: sorted(f"{acct}:{aid}" for acct, aid in h if acct != ln.account_id) for m, h in found[ln.line_id].items()}
        other = {m: v for m, v in other.items() if v}
        chosen = next(((m, s) for m, s in own.items() if s), None)
        detail: dict[str, Any] = {"matches": {m: sorted(str(a) for a in s) for m, s in own.items() if s}}
        if other:
            detail["other_account_matches"] = other
        if chosen is None:
            out[ln.line_id] = (None, None, "OTHER_ACCOUNT" if other else "UNKNOWN_JOB", detail)
            continue
        method, attempts = chosen
        every = set().union(*(s for s in own.values() if s))
        if len(attempts) > 1 or len(every) > 1:
            out[ln.line_id] = (None, None, "AMBIGUOUS", detail)
        else:
            out[ln.line_id] = (next(iter(attempts)), method, "MATCHED", detail)
    return out


def _candidates(conn: psycopg.Connection, ctx: Ctx, ln: Line, known_account: bool) -> list[dict]:
    amount = ln.amount
    rows = conn.execute(FUZZY_CANDIDATES, {
        "provider": ctx.provider, "account": ln.account_id if known_account else None, "model": ln.model,
        "from": ln.occurred_at - FUZZY_BEFORE, "to": ln.occurred_at + FUZZY_AFTER, "at": ln.occurred_at,
        "amount": amount, "slack": max(amount * FUZZY_AMOUNT_FRACTION, ctx.tolerance), "limit": FUZZY_LIMIT}).fetchall()
    return [{"attempt_id": str(r["attempt_id"]), "task_id": str(r["task_id"]), "provider_account": r["provider_account"],
             "provider_job_id": r["provider_job_id"], "state": r["state"], "created_at": r["created_at"].isoformat(),
             "amount": money(r["amount"])} for r in rows]


def _orphan(conn: psycopg.Connection, ctx: Ctx, ln: Line) -> dict:
    if not ln.job_id:
        return {}
    r = conn.execute(ORPHAN_JOB, {"provider": ctx.provider, "job_id": ln.job_id}).fetchone()
    if r is None:
        return {}
    return {"orphan_provider_job": {k: (str(v) if v is not None and not isinstance(v, str) else v) for k, v in r.items()}}


def check_internal(db, ctx: Ctx, tally: Tally) -> dict[tuple[str, date], set[str]]:
    """Charged attempts without a charge line: PENDING_WITHIN_GRACE or MISSING_EXTERNAL. Returns them by
    (account, the day they were charged), for the "empty is not zero" check."""
    start, end = day_bounds(ctx.window_first, ctx.day)
    unbilled: dict[tuple[str, date], set[str]] = defaultdict(set)

    def batch(conn, t: Tally, after: UUID) -> list[UUID]:
        rows = conn.execute(INTERNAL_CANDIDATES, {"provider": ctx.provider, "start": start, "end": end, "after": after,
                                                  "limit": ctx.batch_size}).fetchall()
        keys = [item_key("MISSING_EXTERNAL", f"attempt:{r['attempt_id']}") for r in rows]
        recorded = {r["item_key"] for r in conn.execute(EXISTING_KEYS, {"provider": ctx.provider, "keys": keys}).fetchall()}
        for r in rows:
            since = r["first_cost_at"] or r["unknown_since"]
            if since is None:  # an open PENDING item whose parked cost another repair settled: nothing to add here
                continue
            a = Attempt.from_row(r)
            unbilled[(a.provider_account, _utc_day(since))].add(str(a.attempt_id))
            _apply(conn, ctx, t, decide_internal(
                a, since=since, amount=Decimal(r["amount"]) if r["amount"] is not None else None,
                currency=r["currency"] or ctx.currency, day=ctx.day, grace_days=ctx.grace_days,
                missing_recorded=item_key("MISSING_EXTERNAL", f"attempt:{a.attempt_id}") in recorded), [])
        return [r["attempt_id"] for r in rows]

    _batches(db, ctx, tally, batch, UUID(int=0))
    return unbilled


# --- writes ---------------------------------------------------------------------------------------------

def _apply(conn: psycopg.Connection, ctx: Ctx, tally: Tally, decision: Decision, parked_rows: list[dict]) -> None:
    fixed = False
    for f in decision.findings:
        fixed |= _record(conn, ctx, tally, f)
    period, _ = ctx.booking(ctx.day)
    for key, code in decision.resolve:
        rows = conn.execute(RESOLVE_ITEM, {"provider": ctx.provider, "key": key, "code": code, "now": ctx.now,
                                           "run_id": ctx.run_id, "period": period,
                                           "evidence": Jsonb({"resolved_by_run": str(ctx.run_id), "resolution": code})}
                            ).fetchall()
        tally.resolved += len(rows)
        tally.touched.update(r["billing_date"] for r in rows if r["billing_date"] is not None)
    for reason, resolution in decision.parked:
        # A parked cost is settled by the line only when the decision fixed (COST_UNKNOWN) or confirmed it.
        if reason == "COST_UNKNOWN" and not fixed:
            continue
        for p in parked_rows:
            if p["reason"] == reason and parked.resolve(conn, p["parked_id"], resolution, ctx.now):
                tally.parked_resolved += 1


def _record(conn: psycopg.Connection, ctx: Ctx, tally: Tally, f: Finding) -> bool:
    """Insert the item (nothing when its key exists), after its fix if it has one. True when the fix's cost
    event exists (booked now or by an earlier run)."""
    period, moved = ctx.booking(f.billing_date)
    evidence = dict(f.evidence)
    if moved:
        evidence.update(original_date=f.billing_date.isoformat(), original_period=month_start(f.billing_date).isoformat(),
                        booked_in_period=period.isoformat(), why_moved="the original period is closed")
    cost_event_id = None
    if f.fix is not None and f.attempt is not None:
        cost_event_id = _book(conn, ctx, f, period, moved)
    resolved = f.status == RESOLVED
    row = conn.execute(INSERT_ITEM, {
        "run_id": ctx.run_id, "provider": ctx.provider, "key": f.key, "type": f.discrepancy_type,
        "tenant_id": f.attempt.tenant_id if f.attempt else None, "task_id": f.attempt.task_id if f.attempt else None,
        "attempt_id": f.attempt.attempt_id if f.attempt else None, "line_id": f.line.line_id if f.line else None,
        "job_id": (f.line.job_id if f.line and f.line.job_id else f.attempt.provider_job_id if f.attempt else None),
        "internal": f.internal_amount, "external": f.external_amount, "currency": f.currency, "status": f.status,
        "code": f.resolution_code, "cost_event_id": cost_event_id, "evidence": Jsonb(json.loads(json.dumps(evidence, default=str))),
        "billing_date": f.billing_date, "period": period, "now": ctx.now, "resolved_at": ctx.now if resolved else None,
        "resolved_run_id": ctx.run_id if resolved else None, "resolved_period": period if resolved else None}).fetchone()
    if row is not None:
        tally.new += 1
        tally.by_type[f.discrepancy_type] += 1
        tally.touched.add(f.billing_date)
        if resolved:
            tally.resolved += 1
            tally.auto_fixed += f.resolution_code in AUTO_FIXES
        elif f.discrepancy_type != "PENDING_WITHIN_GRACE":
            tally.breaks += 1
    return cost_event_id is not None


def _book(conn: psycopg.Connection, ctx: Ctx, f: Finding, period: date, moved: bool) -> UUID | None:
    """Append the fix's cost event (idempotent on the event's own keys); its id, new or found."""
    fix, a = f.fix, f.attempt
    assert fix is not None and a is not None
    # A correction of a closed period is booked at the start of the next open one (ch. 20.10: later corrections
    # land in the next period); the line keeps its own time.
    occurred = datetime.combine(period, time(), timezone.utc) if moved else fix.occurred_at
    q = {"attempt_id": a.attempt_id, "tenant_id": a.tenant_id, "task_id": a.task_id, "provider": ctx.provider,
         "account": a.provider_account, "charge_id": fix.charge_id, "line_id": fix.line_id, "event_type": fix.event_type,
         "amount": Decimal(fix.amount).quantize(QUANTUM), "currency": f.currency, "occurred_at": occurred,
         "hash": hashlib.sha256(f"invoice|{fix.line_id}|{fix.amount}|{f.currency}".encode()).hexdigest()}
    row = conn.execute(BOOK_COST, q).fetchone()
    if row is None:
        row = conn.execute(BOOKED_COST, q).fetchone()
    return row["cost_event_id"] if row else None


# --- the day's figures ----------------------------------------------------------------------------------

DAY_LINES = """
select l.line_id, l.charge_id, l.attempt_id, l.type, l.amount, l.currency,
       exists (select 1 from reconciliation_item i where i.provider = l.provider
                  and i.item_key = 'DUPLICATE_EXTERNAL:line:' || l.line_id and i.resolution_code = 'SAME_CHARGE_ID') as same_charge,
       exists (select 1 from reconciliation_item i where i.provider = l.provider and i.external_line_id = l.line_id
                  and i.status = 'OPEN') as open_item
  from provider_invoice_line l
 where l.provider = %(provider)s and l.occurred_at >= %(start)s and l.occurred_at < %(end)s
"""
# The platform's own costs the day is compared with: those of attempts whose first charge line is of the
# day, and those of the day with no charge line (a pair straddling midnight is compared on the line's day).
DAY_COSTS = """
select e.cost_event_id, e.attempt_id, e.amount, e.currency, e.occurred_at,
       (select min(l.occurred_at) from provider_invoice_line l
         where l.provider = e.provider and l.attempt_id = e.attempt_id and l.type = 'charge') as first_line_at
  from provider_cost_event e
 where e.provider = %(provider)s and e.source <> 'INVOICE' and e.amount <> 0
   and ((e.occurred_at >= %(start)s and e.occurred_at < %(end)s)
        or e.attempt_id in (select l.attempt_id from provider_invoice_line l
                             where l.provider = %(provider)s and l.occurred_at >= %(start)s and l.occurred_at < %(end)s
                               and l.attempt_id is not null))
"""


def day_figures(conn: psycopg.Connection, provider: str, day: date, currency: str) -> dict[str, Any]:
    """External and internal totals of the day in the provider's currency, gross drift (the sum of the
    absolute differences per attempt, per charge of the unmapped lines, per cost without an attempt) and net
    drift (external - internal)."""
    start, end = day_bounds(day)
    q = {"provider": provider, "start": start, "end": end}
    ext: dict[Any, Decimal] = defaultdict(Decimal)
    inn: dict[Any, Decimal] = defaultdict(Decimal)
    lines_total = lines_matched = other_currency = 0
    for r in conn.execute(DAY_LINES, q).fetchall():
        lines_total += 1
        if r["currency"] != currency:
            other_currency += 1
            continue
        if r["same_charge"]:
            continue  # the same charge imported twice: counted once
        amount = -Decimal(r["amount"]) if r["type"] == "credit_note" else Decimal(r["amount"])
        # An unmapped line is compared by its charge: a credit note offsets the charge it names.
        ext[r["attempt_id"] or ("charge", r["charge_id"])] += amount
        if r["attempt_id"] is not None and not r["open_item"]:
            lines_matched += 1
    excluded_costs = 0
    for r in conn.execute(DAY_COSTS, q).fetchall():
        if _utc_day(r["first_line_at"] or r["occurred_at"]) != day:
            continue
        if r["currency"] != currency:
            excluded_costs += 1
            continue
        inn[r["attempt_id"] or ("cost", r["cost_event_id"])] += Decimal(r["amount"])
    external, internal = sum(ext.values(), Decimal(0)), sum(inn.values(), Decimal(0))
    gross = sum((abs(ext.get(k, Decimal(0)) - inn.get(k, Decimal(0))) for k in set(ext) | set(inn)), Decimal(0))
    return {"lines_total": lines_total, "lines_matched": lines_matched, "external_amount": external, "internal_amount": internal,
            "gross_drift": gross, "net_drift": external - internal, "lines_other_currency": other_currency,
            "costs_other_currency": excluded_costs}

