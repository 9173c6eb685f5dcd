"""Room service `invoice-reconcile` (ch. 20.10): each provider's invoice, every day, against the platform's
own cost records; and the month close. `aivedio reconcile invoices --provider P --date D` runs one day on
demand (docs/operations.md).

One day of one provider (`reconcile_day`):
1. Fetch `GET /v1/invoices?date=` for each of the provider's accounts, for the day and an overlapping
   window before it: from `billing.invoice_overlap_days` before the oldest day not yet reconciled (the
   provider's cursor: every day up to it has a COMPLETE run), at most MAX_WINDOW_DAYS back. Lines that
   come a day late, or documents the provider amended, are caught by a later run. A COMPLETE run moves
   the cursor over the days it read, when nothing lies between them and the cursor or every day between
   has a COMPLETE run, and on over the COMPLETE days after; the maintenance run catches a cursor further
   behind than the window up, CATCH_UP_DAYS of its oldest days at a time.
2. Archive the raw bytes of every document under a content-addressed key with their SHA-256, never
   overwritten (aivedio.spend.invoice_archive: S3 with Object Lock in AWS, a directory locally),
   and record the document (provider_invoice_document). A document that cannot be archived is not used.
3. Normalise the lines into provider_invoice_line, match and decide them, and look for charged attempts
   without a line (aivedio.spend.invoice_matching: the match order, every discrepancy type, the only
   automatic fixes, each an appended cost event). Everything else is an OPEN item with its evidence,
   for review. Items are keyed by what they are about, so a second run adds none (new_items 0).
4. Report: the contract's JSON document and an HTML page, archived beside the documents and returned;
   the run row keeps the figures (gross drift: the sum of the absolute differences; net drift: external
   minus internal) and, for INCOMPLETE, why. The figures are those of the lines that occurred on the day,
   and the items those of the day (about a line or cost of the day, or a line the day's invoice listed):
   what a run finds about another day of its window is in that day's report.

Late lines. A line that occurred on an earlier day is imported by the run of the day whose invoice listed
it, and counts in the figures of the day it occurred on. The maintenance run reruns each COMPLETE day of
the window whose lines or items its runs changed, so that day's run row and report carry the late line; a
day outside the window keeps the figures of its last run (`aivedio reconcile invoices` refreshes it), and
a closed month's summary never changes (its late lines are booked in the next open month).

A run is COMPLETE only when every document of its window was read and archived, no document was empty
where the platform recorded charged jobs that day ("empty is not zero"), its batches finished, and the
items add up (continuity: open items = previous open + new - resolved). Otherwise it is INCOMPLETE with
the reasons and their evidence: a 5xx, a transport error or a malformed document never crashes the run,
is never dropped and is never summed, and a rerun after the provider recovers completes the day. A line
the database cannot hold (an amount of 1e12 or more, a ninth decimal place, a NUL) makes its document
malformed. An error nobody expected finishes the run INCOMPLETE (RUN_FAILED, the error its evidence, logged)
and raises InvoiceRunFailed; the maintenance run goes on with the next day and provider. Runs on the
same source (the manifest of documents read) for the same day reuse one reconciliation_run row.

The month close (`close_month`, `aivedio reconcile invoices-close`) freezes a provider's month: its
summary is written once and never changes. An item or a correction found later for a closed month is
booked in the next open month, with the original date in its evidence, and a fix's cost event is dated
at the start of that month.

Never: a cost event updated or deleted; a fuzzy candidate accepted; a run marked COMPLETE when a source
failed or answered empty where charges were recorded; an archived object overwritten; a closed month's
summary changed. Two runs for one provider never overlap (a session advisory lock; the second is told
INVOICE_RECONCILE_BUSY)."""
from __future__ import annotations

import json
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, Iterator

from psycopg.types.json import Jsonb

from aivedio import audit
from aivedio.errors import Conflict, DomainError, InvalidRequest, NotFound
from aivedio.metrics_catalog import RECONCILIATION_BREAKS, RECONCILIATION_OPEN_ITEMS, UNRECONCILED_COST
from aivedio.observability import logger, publish
from aivedio.providers import registry
from aivedio.providers.adapter import ProviderError
from aivedio.reconcile.room import Defaults, Report, tuning
from aivedio.spend import invoice_matching as items
from aivedio.spend import invoice_report as report
from aivedio.spend.invoice_archive import archive_for, content_key, sha256_hex

NAME = "invoice-reconcile"
# Hourly: a day already COMPLETE reruns to nothing new; one the provider failed completes within the hour after
# it recovers. 500 lines or attempts per transaction; a run past max_batches is INCOMPLETE and the next carries on.
DEFAULTS = Defaults(interval_seconds=3600.0, batch_size=500, max_batches=200)
MAX_WINDOW_DAYS = 31  # how far back one run re-pulls, however old the cursor
# A provider whose cursor is further behind than the window catches up this many of its oldest days per
# maintenance run, oldest first (each its own run, each moving the cursor when it completes).
CATCH_UP_DAYS = 7
EVIDENCE_BODY_CHARS = 1000
# provider_invoice_line.amount and provider_cost_event.amount are numeric(20, 8): a line beyond it is malformed.
AMOUNT_LIMIT = Decimal("1E12")


class ReconcileBusy(Conflict):
    code = "INVOICE_RECONCILE_BUSY"


class PeriodClosed(Conflict):
    code = "INVOICE_PERIOD_CLOSED"


class MonthNotReconciled(Conflict):
    code = "INVOICE_MONTH_NOT_RECONCILED"


class UnknownInvoiceProvider(NotFound):
    code = "UNKNOWN_PROVIDER"


def _unknown_provider(platform, provider: str) -> UnknownInvoiceProvider:
    """The error names the config it looked in: a provider `serve` knows from its --config is not
    known to a command run without one."""
    source = str(platform.settings.config_file) if platform.settings.config_file else None
    known = [p.name for p in platform.config.providers]
    where = f"the config file {source}" if source else \
        "the built-in default config (no config file was given: set AIVEDIO_CONFIG or pass --config)"
    return UnknownInvoiceProvider(f"no provider {provider!r} in {where}; its providers are {', '.join(known)}",
                                  details={"provider": provider, "config_file": source, "providers": known})


class InvoiceRunFailed(DomainError):
    """Something nobody expected broke a run: its row is finished INCOMPLETE with the error as evidence."""

    code = "INVOICE_RUN_FAILED"


# --- SQL ------------------------------------------------------------------------------------------------

CURSOR = "select complete_through from provider_invoice_cursor where provider = %(provider)s"
ADVANCE_CURSOR = """
insert into provider_invoice_cursor (provider, complete_through, run_id, updated_at)
values (%(provider)s, %(day)s, %(run_id)s, %(now)s)
on conflict (provider) do update
   set complete_through = greatest(provider_invoice_cursor.complete_through, excluded.complete_through),
       run_id = case when excluded.complete_through >= provider_invoice_cursor.complete_through
                     then excluded.run_id else provider_invoice_cursor.run_id end,
       updated_at = excluded.updated_at
"""
CLOSED_MONTHS = "select period_month from provider_invoice_period where provider = %(provider)s"
START_RUN = """
insert into reconciliation_run (provider, billing_period, source_object_key, source_checksum, status, currency, started_at)
values (%(provider)s, daterange(%(day)s, %(next)s), %(key)s, %(checksum)s, 'RUNNING', %(currency)s, %(now)s)
on conflict (provider, billing_period, source_checksum) do update
   set status = 'RUNNING', started_at = excluded.started_at, finished_at = null
returning run_id
"""
OPEN_ITEMS = "select count(*)::int as n from reconciliation_item where provider = %(provider)s and status = 'OPEN'"
FINISH_RUN = """
update reconciliation_run
   set status = %(status)s, total_external_amount = %(external)s, total_internal_amount = %(internal)s, finished_at = %(now)s,
       incomplete_reasons = %(reasons)s, summary = %(summary)s
 where run_id = %(run_id)s
"""
SET_REPORT = "update reconciliation_run set report_key = %(key)s, report_sha256 = %(sha)s where run_id = %(run_id)s"
RECORD_DOCUMENT = """
insert into provider_invoice_document (provider, account_id, invoice_date, sha256, object_key, byte_size, status, line_count,
                                       detail, first_fetched_at, last_fetched_at)
values (%(provider)s, %(account)s, %(day)s, %(sha)s, %(key)s, %(size)s, %(status)s, %(lines)s, %(detail)s, %(now)s, %(now)s)
on conflict (provider, account_id, invoice_date, sha256) do update set last_fetched_at = excluded.last_fetched_at
"""
# The day's items (about a line or cost of the day, or a line the day's invoice listed first): the open ones, and
# those this run created or resolved. What this run found about another day of its window is in that day's report.
# (The candidates come by index: the day's open items, the items of the lines billed that day, the run's.)
REPORT_ITEMS = """
select i.item_id, i.discrepancy_type, i.status, i.external_line_id, i.provider_job_id, i.task_id, i.attempt_id,
       i.internal_amount, i.external_amount, i.currency, i.resolution_code, i.evidence
  from reconciliation_item i
 where i.item_id in (select item_id from reconciliation_item
                      where provider = %(provider)s and status = 'OPEN' and billing_date = %(day)s
                     union all
                     select c.item_id from provider_invoice_line l
                       join reconciliation_item c on c.provider = l.provider and c.external_line_id = l.line_id
                      where l.provider = %(provider)s and l.billed_date = %(day)s
                     union all
                     select item_id from reconciliation_item where run_id = %(run_id)s
                     union all
                     select item_id from reconciliation_item where resolved_run_id = %(run_id)s)
   and i.provider = %(provider)s
   and (i.billing_date = %(day)s
        or exists (select 1 from provider_invoice_line l
                    where l.provider = i.provider and l.line_id = i.external_line_id and l.billed_date = %(day)s))
   and (i.status = 'OPEN' or i.run_id = %(run_id)s or i.resolved_run_id = %(run_id)s)
 order by i.created_at, i.item_id
"""
# The latest run of each day of a range.
LATEST_RUNS = """
select distinct on (lower(billing_period)) lower(billing_period) as day, run_id, status, summary
  from reconciliation_run
 where provider = %(provider)s and lower(billing_period) >= %(first)s and lower(billing_period) <= %(last)s
 order by lower(billing_period), started_at desc
"""
# Provider cost not yet matched to an invoice line (the UnreconciledCost gauge is in USD).
UNRECONCILED = """
select coalesce(sum(internal_amount) filter (where discrepancy_type in ('PENDING_WITHIN_GRACE', 'MISSING_EXTERNAL')
                                               and currency = 'USD'), 0) as amount,
       count(*)::bigint as open_items
  from reconciliation_item where status = 'OPEN'
"""
PERIOD = "select * from provider_invoice_period where provider = %(provider)s and period_month = %(month)s"
PERIOD_ITEMS = """
select discrepancy_type, status, count(*)::int as n from reconciliation_item
 where provider = %(provider)s and period_month = %(month)s group by discrepancy_type, status
"""
PERIOD_OPEN_ITEMS = """
select item_id from reconciliation_item where provider = %(provider)s and period_month = %(month)s and status = 'OPEN'
 order by created_at, item_id
"""
FAIL_RUN = """
update reconciliation_run
   set status = 'INCOMPLETE', finished_at = %(now)s, incomplete_reasons = %(reasons)s,
       summary = %(summary)s
 where run_id = %(run_id)s and status = 'RUNNING'
"""
CLOSE_PERIOD = """
insert into provider_invoice_period (provider, period_month, closed_at, closed_by, summary, report_key, report_sha256)
values (%(provider)s, %(month)s, %(now)s, %(operator)s, %(summary)s, %(key)s, %(sha)s)
on conflict (provider, period_month) do nothing
returning period_month
"""
LOCK_KEY = "select pg_try_advisory_lock(hashtextextended(%(key)s, 0)) as got"
UNLOCK_KEY = "select pg_advisory_unlock(hashtextextended(%(key)s, 0))"


# --- the parts of a run ---------------------------------------------------------------------------------

@contextmanager
def provider_lock(platform, provider: str) -> Iterator[bool]:
    """A session advisory lock per provider, held for a whole run or close (its batches are separate
    transactions). Yields False when another process holds it."""
    key = f"invoice-reconcile:{provider}"
    with platform.db.connection() as conn:
        got = conn.execute(LOCK_KEY, {"key": key}).fetchone()["got"]
        try:
            yield got
        finally:
            if got:
                conn.execute(UNLOCK_KEY, {"key": key})


def window(day: date, cursor: date | None, overlap_days: int) -> list[date]:
    """The days a run for `day` fetches: `overlap_days` before the oldest day not reconciled yet."""
    oldest = day if cursor is None else min(day, cursor + timedelta(days=1))
    first = max(oldest - timedelta(days=overlap_days), day - timedelta(days=MAX_WINDOW_DAYS))
    return [first + timedelta(days=i) for i in range((day - first).days + 1)]


@dataclass
class Fetched:
    account_id: str
    day: date
    status: str  # OK | MALFORMED | ERROR (nothing usable came back) | UNARCHIVED
    lines: list[items.Line]
    raws: list[dict]
    key: str | None = None
    sha256: str | None = None
    size: int = 0
    evidence: dict | None = None

    def manifest(self) -> dict:
        doc: dict[str, Any] = {"account_id": self.account_id, "date": self.day.isoformat(), "status": self.status}
        if self.sha256:
            doc.update(sha256=self.sha256, key=self.key)
        elif self.evidence:
            doc.update({k: self.evidence.get(k) for k in ("http_status", "reason")})
        return doc


def _fetch(provider: str, account_id: str, day: date, adapter, archive) -> Fetched:
    """One document: fetched, archived, parsed. Every failure becomes a status with its evidence."""
    if isinstance(adapter, Exception):
        return Fetched(account_id, day, "ERROR", [], [], evidence={"reason": "no_adapter", "http_status": None,
                                                                   "error": str(adapter)})
    try:
        inv = adapter.invoices(day, account_id)
    except ProviderError as e:
        body = e.body if e.body is not None else e.raw.body.encode()
        ev = {"reason": e.reason, "http_status": e.status, "error": e.message, "url": e.raw.url,
              "body": e.raw.body[:EVIDENCE_BODY_CHARS], "transport_error": e.raw.error}
        if e.reason == "malformed_response" and e.status == 200:
            # What the provider said is kept as it said it, even when it cannot be read.
            try:
                stored = archive.put(content_key(f"{provider}/{day.isoformat()}", body), body)
            except Exception as ae:  # noqa: BLE001 - an archive outage must not lose the evidence
                return Fetched(account_id, day, "MALFORMED", [], [], evidence={**ev, "archive_error": str(ae)})
            return Fetched(account_id, day, "MALFORMED", [], [], stored.key, stored.sha256, stored.size, ev)
        return Fetched(account_id, day, "ERROR", [], [], evidence=ev)
    except Exception as e:  # noqa: BLE001 - a provider's adapter may raise anything; the run must say so, not crash
        return Fetched(account_id, day, "ERROR", [], [], evidence={"reason": "adapter_error", "http_status": None,
                                                                   "error": f"{type(e).__name__}: {e}"})
    body = inv.body or items.canonical({"lines": [_line_doc(ln) for ln in inv.lines]})
    try:
        raws = json.loads(body)["lines"]
    except (ValueError, KeyError, TypeError):
        raws = [_line_doc(ln) for ln in inv.lines]
    try:
        stored = archive.put(content_key(f"{provider}/{day.isoformat()}", body), body)
    except Exception as e:  # noqa: BLE001 - ch. 20.10.3: nothing is reconciled from a document that is not archived
        return Fetched(account_id, day, "UNARCHIVED", [], [], sha256=sha256_hex(body),
                       evidence={"reason": "archive_failed", "error": f"{type(e).__name__}: {e}"})
    bad = [p for p in (_line_problem(ln) for ln in inv.lines) if p]
    if bad:
        # One line the database cannot hold makes the document unusable, as a line the protocol does not allow does.
        return Fetched(account_id, day, "MALFORMED", [], [], stored.key, stored.sha256, stored.size, evidence={
            "reason": "malformed_response", "http_status": inv.raw.status, "url": inv.raw.url,
            "error": f"{len(bad)} line(s) out of range: {bad[0]['why']}", "bad_lines": bad[:20]})
    lines = [items.Line(line_id=ln.line_id, charge_id=ln.charge_id, account_id=ln.account_id, type=ln.type,
                        amount=Decimal(ln.amount), currency=ln.currency, occurred_at=ln.occurred_at, billed_date=day,
                        model=ln.model, job_id=ln.job_id, idempotency_key=ln.idempotency_key) for ln in inv.lines]
    return Fetched(account_id, day, "OK", lines, raws, stored.key, stored.sha256, stored.size)


def _line_problem(ln) -> dict | None:
    """Why a parsed line cannot be stored as it is (None when it can): an amount that numeric(20, 8) cannot hold
    (1e12 or more, or a ninth decimal place, which the database would round away), or a NUL in a text field."""
    amount = Decimal(ln.amount)
    why = None
    if abs(amount) >= AMOUNT_LIMIT:
        why = f"amount {ln.amount} does not fit numeric(20, 8): its magnitude is 1e12 or more"
    elif amount != amount.quantize(items.QUANTUM):
        why = f"amount {ln.amount} has more than 8 decimal places"
    elif any("\x00" in v for v in (ln.line_id, ln.charge_id, ln.account_id, ln.model, ln.type, ln.currency, ln.job_id,
                                    ln.idempotency_key) if isinstance(v, str)):
        why = "a text field holds a NUL character, which PostgreSQL cannot store"
    return None if why is None else {"line_id": ln.line_id[:200].replace("\x00", "\\0"), "amount": str(ln.amount), "why": why}


def _line_doc(ln) -> dict:
    return {"line_id": ln.line_id, "charge_id": ln.charge_id, "job_id": ln.job_id, "idempotency_key": ln.idempotency_key,
            "account_id": ln.account_id, "model": ln.model, "type": ln.type, "amount": str(ln.amount),
            "currency": ln.currency, "occurred_at": ln.occurred_at.isoformat()}


def _reason(code: str, message: str, **evidence: Any) -> dict:
    return {"code": code, "message": message, "evidence": json.loads(json.dumps(evidence, default=str))}


def _fetch_reasons(f: Fetched) -> list[dict]:
    ev = {"account_id": f.account_id, "date": f.day.isoformat(), **(f.evidence or {})}
    if f.status == "ERROR":
        return [_reason("PROVIDER_UNAVAILABLE", "the provider did not give this invoice (a rerun after it recovers completes "
                        "the day)", **ev)]
    if f.status == "MALFORMED":
        return [_reason("MALFORMED_DOCUMENT", "the invoice document is not one of the protocol: none of its lines was used",
                        archive_key=f.key, sha256=f.sha256, bytes=f.size, **ev)]
    if f.status == "UNARCHIVED":
        return [_reason("ARCHIVE_FAILED", "the document could not be archived, so it was not used", sha256=f.sha256, **ev)]
    return []


@dataclass
class DayResult:
    document: dict  # the contract's JSON document
    report_key: str | None
    report_html_key: str | None
    html: str
    examined: int
    batches: int
    complete: bool
    touched: frozenset[date] = frozenset()  # the other days whose lines or items this run changed


# --- one day ------------------------------------------------------------------------------------------------

def reconcile_day(platform, provider: str, day: date, *, now: datetime | None = None) -> DayResult:
    """Reconcile one provider's invoice for one UTC day (the module docstring says how)."""
    pc = platform.config.provider(provider)
    if pc is None:
        raise _unknown_provider(platform, provider)
    t = tuning(platform, NAME)
    billing = platform.config.billing
    now = now or platform.clock.now()
    archive = archive_for(platform)
    with provider_lock(platform, provider) as held:
        if not held:
            raise ReconcileBusy(f"an invoice run for {provider} is in progress", details={"provider": provider})
        cursor_row = platform.db.fetchone(CURSOR, {"provider": provider})
        cursor = cursor_row["complete_through"] if cursor_row else None
        days = window(day, cursor, billing.invoice_overlap_days)
        try:
            adapter = registry.adapter(platform, provider)
        except Exception as e:  # noqa: BLE001 - no credentials in this process, say: every document is then unavailable
            adapter = e
        fetched = [_fetch(provider, a.account_id, d, adapter, archive) for d in days for a in pc.accounts]

        manifest = {"provider": provider, "date": day.isoformat(), "window": [days[0].isoformat(), days[-1].isoformat()],
                    "documents": [f.manifest() for f in fetched]}
        manifest_bytes = items.canonical(manifest)
        manifest_key = content_key(f"{provider}/{day.isoformat()}/manifests", manifest_bytes)
        reasons = [r for f in fetched for r in _fetch_reasons(f)]
        try:
            archive.put(manifest_key, manifest_bytes)
        except Exception as e:  # noqa: BLE001 - the run still records what it read
            reasons.append(_reason("ARCHIVE_FAILED", "the run's manifest could not be archived", key=manifest_key, error=str(e)))

        def start(conn):
            run_id = conn.execute(START_RUN, {"provider": provider, "day": day, "next": day + timedelta(days=1),
                                              "key": manifest_key, "checksum": sha256_hex(manifest_bytes),
                                              "currency": pc.currency, "now": now}).fetchone()["run_id"]
            closed = frozenset(r["period_month"] for r in conn.execute(CLOSED_MONTHS, {"provider": provider}).fetchall())
            return run_id, conn.execute(OPEN_ITEMS, {"provider": provider}).fetchone()["n"], closed

        run_id, previous_open, closed = platform.db.transaction(start)
        try:
            ctx = items.Ctx(provider=provider, currency=pc.currency, accounts=frozenset(a.account_id for a in pc.accounts), day=day,
                            window_first=days[0], run_id=run_id, now=now, grace_days=billing.invoice_grace_days,
                            tolerance=Decimal(billing.invoice_amount_tolerance), batch_size=t.batch_size,
                            max_batches=t.max_batches, closed_months=closed)
            tally = items.Tally()
            for f in fetched:
                _import(platform, ctx, tally, f)
            items.classify_window(platform.db, ctx, tally)
            unbilled = items.check_internal(platform.db, ctx, tally)
            for f in fetched:
                charged = unbilled.get((f.account_id, f.day), set())
                if f.status == "OK" and not f.lines and charged:
                    reasons.append(_reason("EMPTY_WHERE_CHARGED", "the provider answered an empty invoice for a day the platform "
                                           "recorded charged jobs on: empty is not zero", account_id=f.account_id,
                                           date=f.day.isoformat(), charged_attempts=len(charged), attempt_ids=sorted(charged)[:20],
                                           archive_key=f.key, sha256=f.sha256))
            if tally.more:
                reasons.append(_reason("MORE_TO_DO", "the run reached max_batches; the next run carries on",
                                       batch_size=t.batch_size, max_batches=t.max_batches))
            doc = platform.db.transaction(lambda conn: _finish(conn, ctx, tally, pc.currency, reasons, previous_open, cursor, days))
        except Exception as e:  # noqa: BLE001 - the run is finished INCOMPLETE with what broke it, never left RUNNING
            _fail(platform, provider, day, run_id, reasons, e, now)
            raise InvoiceRunFailed(f"the invoice run for {provider} {day.isoformat()} failed: {type(e).__name__}: {e}",
                                   details={"provider": provider, "date": day.isoformat(), "run_id": str(run_id),
                                            "error": f"{type(e).__name__}: {e}"[:EVIDENCE_BODY_CHARS]}) from e
    return _publish_reports(platform, archive, ctx, doc, tally)


def _fail(platform, provider: str, day: date, run_id, reasons: list[dict], e: Exception, now: datetime) -> None:
    """Finish a run that an unexpected error stopped: INCOMPLETE, the error its evidence (the reasons found
    before it too). What its batches committed stands; a rerun carries on from there."""
    error = f"{type(e).__name__}: {e}"[:EVIDENCE_BODY_CHARS]
    failed = [*reasons, _reason("RUN_FAILED", "the run stopped on an unexpected error; what it had not reached waits for "
                                "a rerun", error=error, traceback=traceback.format_exc()[-3000:])]
    logger.exception("invoice reconciliation failed", extra={"provider": provider, "date": day.isoformat(),
                                                             "run_id": str(run_id), "error": error})
    try:
        platform.db.transaction(lambda conn: conn.execute(FAIL_RUN, {
            "run_id": run_id, "now": now, "reasons": Jsonb(failed),
            "summary": Jsonb({"status": "INCOMPLETE", "error": error, "incomplete_reasons": [r["code"] for r in failed]})}))
    except Exception:  # noqa: BLE001 - the database itself may be what failed; the log says so
        logger.exception("invoice reconciliation run could not be marked INCOMPLETE",
                         extra={"provider": provider, "date": day.isoformat(), "run_id": str(run_id)})


def _import(platform, ctx: items.Ctx, tally: items.Tally, f: Fetched) -> None:
    """Record an archived document, and store its lines in batches (each its own transaction)."""
    if f.key and f.status in ("OK", "MALFORMED"):
        platform.db.transaction(lambda conn: conn.execute(RECORD_DOCUMENT, {
            "provider": ctx.provider, "account": f.account_id, "day": f.day, "sha": f.sha256, "key": f.key, "size": f.size,
            "status": f.status, "lines": len(f.lines) if f.status == "OK" else None,
            "detail": (f.evidence or {}).get("error"), "now": ctx.now}))
    if f.status != "OK":
        return
    for i in range(0, len(f.lines), ctx.batch_size):
        lines, raws = f.lines[i:i + ctx.batch_size], f.raws[i:i + ctx.batch_size]
        items.counted(platform.db, tally, lambda conn, tl: items.import_lines(conn, ctx, tl, lines=lines, raws=raws,
                                                                             billed=f.day, source_sha256=f.sha256))
        tally.batches += 1


def _finish(conn, ctx: items.Ctx, tally: items.Tally, currency: str, reasons: list[dict], previous_open: int,
            cursor: date | None, days: list[date]) -> dict:
    reasons = list(reasons)  # this transaction may run again: it adds to a copy
    figures = items.day_figures(conn, ctx.provider, ctx.day, currency)
    open_now = conn.execute(OPEN_ITEMS, {"provider": ctx.provider}).fetchone()["n"]
    expected = previous_open + tally.new - tally.resolved
    if open_now != expected:
        reasons.append(_reason("CONTINUITY", "open items do not equal previous open + new - resolved: something changed the "
                               "items beside this run", previous_open=previous_open, new=tally.new, resolved=tally.resolved,
                               expected_open=expected, open=open_now))
    status = "INCOMPLETE" if reasons else "COMPLETE"
    rows = conn.execute(REPORT_ITEMS, {"provider": ctx.provider, "day": ctx.day, "run_id": ctx.run_id}).fetchall()
    doc = report.day_document(run_id=ctx.run_id, provider=ctx.provider, day=ctx.day, status=status, incomplete_reasons=reasons,
                              figures=figures, currency=currency, previous_open=previous_open, new=tally.new,
                              resolved=tally.resolved, open_now=open_now, auto_fixed=tally.auto_fixed, items=rows)
    summary = {k: v for k, v in doc.items() if k != "items"}
    summary.update(window=[days[0].isoformat(), days[-1].isoformat()], lines_imported=tally.imported,
                   lines_repeated=tally.repeats, parked_resolved=tally.parked_resolved, new_by_type=dict(tally.by_type),
                   lines_other_currency=figures["lines_other_currency"], costs_other_currency=figures["costs_other_currency"])
    conn.execute(FINISH_RUN, {"run_id": ctx.run_id, "status": status, "external": figures["external_amount"],
                              "internal": figures["internal_amount"], "now": ctx.now, "reasons": Jsonb(reasons),
                              "summary": Jsonb(json.loads(json.dumps(summary, default=str)))})
    if status == "COMPLETE":
        through = _cursor_through(conn, ctx.provider, ctx.day, cursor, days)
        if through is not None:
            conn.execute(ADVANCE_CURSOR, {"provider": ctx.provider, "day": through, "run_id": ctx.run_id, "now": ctx.now})
    return doc


def _cursor_through(conn, provider: str, day: date, cursor: date | None, days: list[date]) -> date | None:
    """How far the cursor may move after `day`'s COMPLETE run (None: not at all). It moves over the days this
    run read when nothing lies between them and the cursor, or when every day between has a COMPLETE run (a
    cursor further behind than the window), and on over the days after that have a COMPLETE run already."""
    one = timedelta(days=1)
    first = cursor + one if cursor is not None else day
    latest = {r["day"]: r["status"] for r in conn.execute(LATEST_RUNS, {"provider": provider, "first": first,
                                                                        "last": date.max}).fetchall()}
    latest[day] = "COMPLETE"  # this run, whatever order runs of the same instant sort in
    if cursor is not None and days[0] > first:
        gap = (first + timedelta(days=i) for i in range((days[0] - first).days))
        if any(latest.get(d) != "COMPLETE" for d in gap):
            return None
    through = max(day, cursor) if cursor is not None else day
    while latest.get(through + one) == "COMPLETE":
        through += one
    return through if cursor is None or through > cursor else None


def _publish_reports(platform, archive, ctx: items.Ctx, doc: dict, tally: items.Tally) -> DayResult:
    prefix = f"{ctx.provider}/{ctx.day.isoformat()}/reports"
    data, page = report.to_bytes(doc), report.day_html(doc)
    json_key = html_key = None
    try:
        json_key = archive.put(content_key(prefix, data), data).key
        html_key = archive.put(content_key(prefix, page.encode(), ".html"), page.encode(), "text/html; charset=utf-8").key
        platform.db.transaction(lambda conn: conn.execute(SET_REPORT, {"key": json_key, "sha": sha256_hex(data),
                                                                       "run_id": ctx.run_id}))
    except Exception as e:  # noqa: BLE001 - the run is recorded; its report file can be written again from it
        logger.warning("invoice report not archived", extra={"provider": ctx.provider, "date": ctx.day.isoformat(),
                                                              "run_id": str(ctx.run_id), "error": str(e)})
    if tally.breaks:
        publish(RECONCILIATION_BREAKS, tally.breaks)
    unreconciled = platform.db.fetchone(UNRECONCILED)
    publish(UNRECONCILED_COST, float(unreconciled["amount"]))
    publish(RECONCILIATION_OPEN_ITEMS, unreconciled["open_items"])
    log = logger.info if doc["status"] == "COMPLETE" else logger.warning
    log("invoice reconciliation", extra={"provider": ctx.provider, "date": ctx.day.isoformat(), "run_id": str(ctx.run_id),
                                         "status": doc["status"], "new_items": doc["new_items"], "open_items": doc["open_items"],
                                         "incomplete": [r["code"] for r in doc["incomplete_reasons"]],
                                         "report_key": json_key, "report_html_key": html_key})
    return DayResult(doc, json_key, html_key, page, tally.examined, tally.batches, doc["status"] == "COMPLETE" and not tally.more,
                     frozenset(tally.touched - {ctx.day}))


# --- the schedule ---------------------------------------------------------------------------------------------

def run_once(platform) -> Report:
    """For each provider: yesterday (UTC), then each earlier day of its window that has no COMPLETE run yet
    (oldest first: yesterday's run has imported the late lines they were waiting for); for a cursor further
    behind than the window, its oldest CATCH_UP_DAYS days without a COMPLETE run (so a provider idle for long
    catches up in bounded runs); last, each COMPLETE day of the window whose lines or items these runs changed
    (a late line), so that its figures and report are current. A day that fails is that day's INCOMPLETE run;
    the other days and providers still run."""
    out = Report(NAME)
    yesterday = platform.clock.now().astimezone(timezone.utc).date() - timedelta(days=1)
    for pc in platform.config.providers:
        details: dict[str, Any] = {}
        out.details[pc.name] = details
        try:
            planned, done = _plan(platform, pc.name, yesterday)
        except Exception as e:  # noqa: BLE001 - one provider's trouble must not stop the others
            logger.exception("invoice reconciliation not planned", extra={"provider": pc.name, "error": str(e)})
            out.complete = False
            details["error"] = f"{type(e).__name__}: {e}"[:EVIDENCE_BODY_CHARS]
            continue
        touched: set[date] = set()
        ran: set[date] = set()
        for d in planned:
            if not _run_day(platform, pc.name, d, out, details, touched):
                break
            ran.add(d)
        else:
            for d in sorted((touched & done) - ran):
                if not _run_day(platform, pc.name, d, out, details, set()):
                    break
    return out


def _plan(platform, provider: str, yesterday: date) -> tuple[list[date], set[date]]:
    """The days run_once runs for a provider, in order, and the days of its window COMPLETE already."""
    cursor_row = platform.db.fetchone(CURSOR, {"provider": provider})
    cursor = cursor_row["complete_through"] if cursor_row else None
    earlier = window(yesterday, cursor, platform.config.billing.invoice_overlap_days)[:-1]
    first = earlier[0] if earlier else yesterday
    gap_first = cursor + timedelta(days=1) if cursor is not None and cursor + timedelta(days=1) < first else first
    complete = {r["day"] for r in platform.db.fetchall(LATEST_RUNS, {"provider": provider, "first": gap_first,
                                                                     "last": yesterday}) if r["status"] == "COMPLETE"}
    gap = (gap_first + timedelta(days=i) for i in range((first - gap_first).days))
    catch_up = [d for d in gap if d not in complete][:CATCH_UP_DAYS]
    return [yesterday] + [d for d in earlier if d not in complete] + catch_up, {d for d in complete if d >= first}


def _run_day(platform, provider: str, d: date, out: Report, details: dict, touched: set[date]) -> bool:
    """One day of run_once, its outcome in `details`. False: stop this provider (another run holds it)."""
    try:
        r = reconcile_day(platform, provider, d)
    except ReconcileBusy:
        out.complete = False
        details[d.isoformat()] = {"status": "BUSY"}
        return False
    except Exception as e:  # noqa: BLE001 - one day's failure is that day's INCOMPLETE run; the next day still runs
        if not isinstance(e, InvoiceRunFailed):  # _fail logged those
            logger.exception("invoice reconciliation failed", extra={"provider": provider, "date": d.isoformat(),
                                                                     "error": str(e)})
        out.complete = False
        details[d.isoformat()] = {"status": "INCOMPLETE", "incomplete": ["RUN_FAILED"],
                                  "run_id": e.details.get("run_id") if isinstance(e, DomainError) else None,
                                  "error": f"{type(e).__name__}: {e}"[:EVIDENCE_BODY_CHARS]}
        return True
    out.examined += r.examined
    out.repaired += r.document["auto_fixed"]
    out.batches += r.batches
    out.complete &= r.complete
    touched |= r.touched
    details[d.isoformat()] = {"status": r.document["status"], "new_items": r.document["new_items"],
                              "open_items": r.document["open_items"],
                              "incomplete": [x["code"] for x in r.document["incomplete_reasons"]]}
    return True


# --- the month close ---------------------------------------------------------------------------------------

def close_month(platform, provider: str, month: date, *, operator: str, allow_incomplete: bool = False,
                reason: str | None = None) -> dict:
    """Freeze a provider's month (needs invoice.close; audited). Refused while the month is not over, when
    it is closed already, and, unless `allow_incomplete` (with a reason), when a day of it has no COMPLETE run."""
    pc = platform.config.provider(provider)
    if pc is None:
        raise _unknown_provider(platform, provider)
    month = items.month_start(month)
    end = items.next_month(month)
    now = platform.clock.now()
    if end > now.astimezone(timezone.utc).date():
        raise InvalidRequest("the month is not over yet", {"month": f"{month:%Y-%m} ends on {end.isoformat()}"},
                             code="INVOICE_MONTH_NOT_OVER")
    if allow_incomplete and not (reason or "").strip():
        raise InvalidRequest("closing with unreconciled days needs a reason", {"reason": "required with allow_incomplete"})
    archive = archive_for(platform)
    with provider_lock(platform, provider) as held:
        if not held:
            raise ReconcileBusy(f"an invoice run for {provider} is in progress", details={"provider": provider})

        def read(conn) -> dict:
            q = {"provider": provider, "month": month}
            if conn.execute(PERIOD, q).fetchone() is not None:
                raise PeriodClosed(f"{provider} {month:%Y-%m} is closed already", details={"provider": provider,
                                                                                          "month": f"{month:%Y-%m}"})
            runs = {r["day"]: r for r in conn.execute(LATEST_RUNS, {"provider": provider, "first": month,
                                                                     "last": end - timedelta(days=1)}).fetchall()}
            days = [{"date": d.isoformat(), "status": runs[d]["status"] if d in runs else "NOT_RUN",
                     "run_id": str(runs[d]["run_id"]) if d in runs else None}
                    for d in (month + timedelta(days=i) for i in range((end - month).days))]
            totals = {k: sum((Decimal(runs[d]["summary"].get(k) or 0) for d in runs), Decimal(0))
                      for k in ("external_amount", "internal_amount", "gross_drift", "net_drift")}
            by_type: dict[str, dict[str, int]] = {}
            for r in conn.execute(PERIOD_ITEMS, q).fetchall():
                by_type.setdefault(r["discrepancy_type"], {})[r["status"]] = r["n"]
            carried = [str(r["item_id"]) for r in conn.execute(PERIOD_OPEN_ITEMS, q).fetchall()]
            return {"provider": provider, "month": f"{month:%Y-%m}", "closed_at": now.isoformat(), "closed_by": operator,
                    "reason": reason, "currency": pc.currency, "days": days,
                    "incomplete_days": [d["date"] for d in days if d["status"] != "COMPLETE"],
                    **{k: items.money(v) for k, v in totals.items()}, "items_by_type": by_type,
                    "open_items_carried": len(carried), "open_item_ids": carried}

        summary = platform.db.transaction(read)
        if summary["incomplete_days"] and not allow_incomplete:
            raise MonthNotReconciled(f"{provider} {month:%Y-%m} has days without a COMPLETE run",
                                     details={"incomplete_days": summary["incomplete_days"]})
        data, page = report.to_bytes(summary), report.month_html(summary)
        prefix = f"{provider}/{month:%Y-%m}/close"
        try:
            stored = archive.put(content_key(prefix, data), data)
            html_stored = archive.put(content_key(prefix, page.encode(), ".html"), page.encode(), "text/html; charset=utf-8")
        except Exception as e:  # noqa: BLE001 - a close without its archived report is not a close
            raise DomainError(f"the close report could not be archived: {e}", code="INVOICE_ARCHIVE_FAILED") from None

        def write(conn) -> None:
            row = conn.execute(CLOSE_PERIOD, {"provider": provider, "month": month, "now": now, "operator": operator,
                                              "summary": Jsonb(summary), "key": stored.key, "sha": stored.sha256}).fetchone()
            if row is None:
                raise PeriodClosed(f"{provider} {month:%Y-%m} is closed already", details={"provider": provider})
            audit.append(conn, operator=operator, action="invoice.close", target=f"invoice-period:{provider}:{month:%Y-%m}",
                         new={k: summary[k] for k in ("external_amount", "internal_amount", "gross_drift", "net_drift",
                                                      "open_items_carried", "incomplete_days")} | {"report_key": stored.key},
                         reason=reason)

        platform.db.transaction(write)
    return {**summary, "report_key": stored.key, "report_sha256": stored.sha256, "report_html_key": html_stored.key}
