"""The idempotency-record purge: deletes the records whose TTL has passed.

An idempotency_record answers for its key until expires_at (admission sets it from
Timers.idempotency_ttl_seconds when it claims and when it completes the key); after that admission
no longer replays it (aivedio.admission.service.holds_key), and it is only dead weight on the
table every admission reads. This service deletes such records, oldest first, in batches of
BATCH_SIZE, each batch its own short transaction, until a batch comes back short (nothing more is
due) or MAX_BATCHES ran (the next run carries on). Rows another transaction holds (a takeover of
that very key, say) are skipped, never waited for. A record that is still live is never touched:
the statement reads expires_at against the same clock admission writes it with.

The key itself stays spent after its record is gone: its task keeps the key (one task per key), and
admission answers a reuse with IDEMPOTENCY_KEY_REUSED.

The same run purges the other idempotency records the platform keeps, which would otherwise grow
forever: a provider's webhook receipts (webhook_receipt: each webhook id received, so a redelivery
is answered as a duplicate) once older than `timers.webhook_receipt_ttl_seconds`, longer than any
provider redelivers, and the parked webhooks that were applied, found duplicate or stale that long
ago. A webhook still PARKED (its job never mapped) is never purged: it is evidence for the
invoice's reconciliation. Each table in batches of its own, counted apart.

Runs on the `idempotency-purge` schedule (aivedio.events_routing.SCHEDULES): an EventBridge rule in
AWS, a loop under `aivedio serve`."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime

from aivedio.observability import logger
from aivedio.reconcile.room import Defaults, Report, tuning

NAME = "idempotency-purge"
# 1,000 records per transaction, at most 200 per run (the next run carries on), every 30 minutes.
DEFAULTS = Defaults(interval_seconds=1800.0, batch_size=1000, max_batches=200)

PURGE_EXPIRED = """
delete from idempotency_record r
 using (select tenant_id, idempotency_key from idempotency_record
         where expires_at <= %(now)s
         order by expires_at
         limit %(limit)s
           for update skip locked) due
 where r.tenant_id = due.tenant_id and r.idempotency_key = due.idempotency_key
"""


PURGE_RECEIPTS = """
delete from webhook_receipt r
 using (select provider, webhook_id from webhook_receipt
         where received_at < %(before)s
         order by received_at
         limit %(limit)s
           for update skip locked) due
 where r.provider = due.provider and r.webhook_id = due.webhook_id
"""
# Applied, duplicate or stale: done with. A PARKED one stays (its job was never mapped).
PURGE_PARKED_DONE = """
delete from parked_webhook p
 using (select provider, webhook_id from parked_webhook
         where state <> 'PARKED' and done_at < %(before)s
         order by done_at
         limit %(limit)s
           for update skip locked) due
 where p.provider = due.provider and p.webhook_id = due.webhook_id
"""


@dataclass(frozen=True)
class PurgeReport:
    deleted: int
    batches: int
    complete: bool  # the last batch was short: nothing more was due at `now` (of every table)
    receipts_deleted: int = 0
    parked_webhooks_deleted: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    def as_report(self) -> Report:
        gone = self.deleted + self.receipts_deleted + self.parked_webhooks_deleted
        return Report(NAME, examined=gone, repaired=gone, batches=self.batches, complete=self.complete,
                      details={"idempotency_records": self.deleted, "webhook_receipts": self.receipts_deleted,
                               "parked_webhooks": self.parked_webhooks_deleted})


def _purge(platform, statement: str, params: dict, batch_size: int, max_batches: int) -> tuple[int, int, bool]:
    """(deleted, batches, complete): batches of `statement` until a short one, or max_batches."""
    deleted = batches = 0
    while batches < max_batches:
        n = platform.db.transaction(lambda conn: conn.execute(statement, {**params, "limit": batch_size}).rowcount)
        batches += 1
        deleted += n
        if n < batch_size:
            return deleted, batches, True
    return deleted, batches, False


def run_once(platform, *, now: datetime | None = None, batch_size: int | None = None,
             max_batches: int | None = None) -> PurgeReport:
    """One pass over each table: batches until a short one (or max_batches). Safe to run twice at once."""
    t = tuning(platform, NAME)
    now = now or platform.clock.now()
    batch_size, max_batches = batch_size or t.batch_size, max_batches or t.max_batches
    deleted, batches, complete = _purge(platform, PURGE_EXPIRED, {"now": now}, batch_size, max_batches)
    before = now - t.delta(platform.config.timers.webhook_receipt_ttl_seconds)
    receipts, _, receipts_done = _purge(platform, PURGE_RECEIPTS, {"before": before}, batch_size, max_batches)
    parked, _, parked_done = _purge(platform, PURGE_PARKED_DONE, {"before": before}, batch_size, max_batches)
    report = PurgeReport(deleted=deleted, batches=batches, complete=complete and receipts_done and parked_done,
                         receipts_deleted=receipts, parked_webhooks_deleted=parked)
    if deleted or receipts or parked or not report.complete:
        logger.info("idempotency records purged", extra=report.as_dict())
    return report
