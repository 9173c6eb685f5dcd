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


@dataclass(frozen=True)
class PurgeReport:
    deleted: int
    batches: int
    complete: bool  # the last batch was short: nothing more was due at `now`

    def as_dict(self) -> dict:
        return asdict(self)

    def as_report(self) -> Report:
        return Report(NAME, examined=self.deleted, repaired=self.deleted, batches=self.batches, complete=self.complete)


def purge_batch(conn, *, now: datetime, limit: int) -> int:
    """Delete up to `limit` records expired by `now`, in the caller's transaction. Returns how many."""
    return conn.execute(PURGE_EXPIRED, {"now": now, "limit": limit}).rowcount


def run_once(platform, *, now: datetime | None = None, batch_size: int | None = None,
             max_batches: int | None = None) -> PurgeReport:
    """One pass: batches until a short one (or max_batches). Safe to run twice at once."""
    t = tuning(platform, NAME)
    now = now or platform.clock.now()
    batch_size, max_batches = batch_size or t.batch_size, max_batches or t.max_batches
    deleted = batches = 0
    complete = False
    while batches < max_batches:
        n = platform.db.transaction(lambda conn: purge_batch(conn, now=now, limit=batch_size))
        batches += 1
        deleted += n
        if n < batch_size:
            complete = True
            break
    report = PurgeReport(deleted=deleted, batches=batches, complete=complete)
    if deleted or not complete:
        logger.info("idempotency records purged", extra=report.as_dict())
    return report
