"""What the media bucket's storage costs, computed by the platform from what it stored (ch. 20.9.5):
each object's size, the storage class its retention class moves it through, and how long it is kept.

Why the platform computes it: AWS cost allocation works on the bucket's tags, never on an object's,
so the Cost and Usage Report shows the media bucket's storage as lines of the whole bucket (tagged
`aivedio:cost-scope = media-storage` by infra_cdk/data.py), with no tenant or task on them. So:

- **Per task**, when an output version is stored, its whole storage life is booked once as a
  STORAGE media cost (`lifetime_cost`): the hours it spends in each storage class until its
  retention class expires it, or for `storage_horizon_months` for a class kept until someone deletes
  it (final outputs, sources). That is the cost the task causes, known when the task ends.
- **Per month**, the same model gives what AWS should bill for the bucket's storage in that month
  (`expected_month`: every output alive in it, in the class its age puts it in), and `check_month`
  compares it with the bucket's TimedStorage lines imported from the CUR
  (aivedio.spend.media_costs keeps them in bucket_storage_cost). A difference above
  `storage_check_tolerance_pct` is parked for finance as STORAGE_COST_MISMATCH, with both figures.

A GB here is AWS's storage GB, 2^30 bytes. Per-task costs are spread over months of 730 hours (AWS's
average month); the monthly check uses the month's own hours, as a byte-hour bill does. Requests,
early deletion and retrieval are billed by AWS too and are not modelled: the check reads the
bucket's TimedStorage lines only."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

import psycopg

from aivedio.config import MediaConfig
from aivedio.media.retention import RetentionClass, by_name
from aivedio.spend import parked
from aivedio.spend.costs import QUANTUM

GB = Decimal(2 ** 30)
HOURS_PER_MONTH = Decimal(730)
STANDARD, STANDARD_IA, GLACIER_IR = "STANDARD", "STANDARD_IA", "GLACIER_IR"
MISMATCH_REASON = "STORAGE_COST_MISMATCH"
TIMED_STORAGE = "TimedStorage"  # the usage types of stored bytes (USE1-TimedStorage-ByteHrs, ...-SIA-ByteHrs, ...)


@dataclass(frozen=True)
class StoragePrices:
    """Per GB-month (2^30 bytes for 730 hours) in `currency`, by storage class."""

    currency: str
    per_gb_month: dict[str, Decimal]

    @classmethod
    def of(cls, m: MediaConfig) -> StoragePrices:
        return cls(m.cost_currency, {STANDARD: Decimal(m.storage_cost_per_gb_month),
                                     STANDARD_IA: Decimal(m.storage_ia_cost_per_gb_month),
                                     GLACIER_IR: Decimal(m.storage_glacier_ir_cost_per_gb_month)})


KEPT_DAYS = 36_500  # an object no retention class expires stays until someone deletes it


def stages(rc: RetentionClass, horizon_days: int = KEPT_DAYS) -> list[tuple[str, int, int]]:
    """The storage classes an object of `rc` passes through: (class, from day, to day), days since
    it was stored; the last ends when `rc` expires it, or at `horizon_days` when it never does."""
    end = rc.expire_after_days if rc.expire_after_days is not None else horizon_days
    starts = [(STANDARD, 0)]
    if rc.infrequent_access_after_days is not None:
        starts.append((STANDARD_IA, rc.infrequent_access_after_days))
    if rc.glacier_ir_after_days is not None:
        starts.append((GLACIER_IR, rc.glacier_ir_after_days))
    out = []
    for i, (cls, begin) in enumerate(starts):
        stop = min(end, starts[i + 1][1]) if i + 1 < len(starts) else end
        if stop > begin:
            out.append((cls, begin, stop))
    return out


def lifetime_cost(size_bytes: int, retention_class: str, prices: StoragePrices, horizon_months: int) -> Decimal:
    """What storing `size_bytes` under `retention_class` costs over its whole life."""
    total = Decimal(0)
    for cls, begin, stop in stages(by_name(retention_class), horizon_months * 30):
        total += Decimal(size_bytes) / GB * prices.per_gb_month[cls] * Decimal((stop - begin) * 24) / HOURS_PER_MONTH
    return total


def month_bounds(month: date) -> tuple[datetime, datetime]:
    start = datetime(month.year, month.month, 1, tzinfo=timezone.utc)
    nxt = datetime(month.year + (month.month == 12), month.month % 12 + 1, 1, tzinfo=timezone.utc)
    return start, nxt


# Stored bytes by the day they were stored and their retention class (a final output is a task's
# non-interactive render: aivedio.media.pipeline.retention_class). Grouping by day keeps the read
# to a few rows a day whatever the number of objects; the day's midpoint stands for its objects.
STORED_BY_DAY = """
select date_trunc('day', o.created_at) as day, case when t.interactive then 'proxy' else 'final' end as retention_class,
       sum(o.size_bytes)::bigint as bytes
from task_output o join generation_task t on t.tenant_id = o.tenant_id and t.task_id = o.task_id
where o.created_at < %(end)s and o.size_bytes > 0
group by 1, 2"""


def expected_month(conn: psycopg.Connection, month: date, prices: StoragePrices) -> Decimal:
    """What the bucket's stored bytes should cost in `month`: each day's outputs, in the storage
    class their age puts them in for each hour of the month they are kept (a final output for as
    long as it is there: the per-task horizon is a booking rule, not a deletion)."""
    start, end = month_bounds(month)
    month_hours = Decimal((end - start).total_seconds() / 3600)
    total = Decimal(0)
    for row in conn.execute(STORED_BY_DAY, {"end": end}):
        stored_at = row["day"] + timedelta(hours=12)
        for cls, begin, stop in stages(by_name(row["retention_class"])):
            lo, hi = max(start, stored_at + timedelta(days=begin)), min(end, stored_at + timedelta(days=stop))
            if hi > lo:
                hours = Decimal((hi - lo).total_seconds() / 3600)
                total += Decimal(row["bytes"]) / GB * prices.per_gb_month[cls] * hours / month_hours
    return total


BILLED_IN_MONTH = """
select currency, sum(amount) as amount, count(*) as lines from bucket_storage_cost
where usage_month = %(month)s and strpos(usage_type, %(timed)s) > 0
group by currency"""


def check_month(conn: psycopg.Connection, month: date, m: MediaConfig) -> dict:
    """The bucket's storage bill for `month` (its TimedStorage lines of the CUR) against what the
    platform expects; a difference above the tolerance is parked (once per pair of figures)."""
    month = month.replace(day=1)
    prices = StoragePrices.of(m)
    expected = expected_month(conn, month, prices).quantize(QUANTUM)
    billed = {r["currency"]: r for r in conn.execute(BILLED_IN_MONTH, {"month": month, "timed": TIMED_STORAGE})}
    if not billed:
        return {"month": month.isoformat(), "status": "NO_BILL", "expected": str(expected), "currency": prices.currency}
    bill = billed.get(prices.currency)
    amount = Decimal(bill["amount"]) if bill else Decimal(0)
    tolerance = max(amount, expected) * Decimal(m.storage_check_tolerance_pct) / 100
    doc = {"month": month.isoformat(), "currency": prices.currency, "expected": str(expected),
           "billed": str(amount), "lines": bill["lines"] if bill else 0,
           "other_currencies": sorted(c for c in billed if c != prices.currency),
           "tolerance_pct": m.storage_check_tolerance_pct}
    if abs(amount - expected) <= tolerance and not doc["other_currencies"]:
        return {**doc, "status": "MATCHED"}
    parked.park(conn, reason=MISMATCH_REASON, event_type="BucketStorageMonth", payload=doc,
                detail=f"media bucket storage for {doc['month']}: billed {doc['billed']} {prices.currency}, expected "
                       f"{doc['expected']} (tolerance {m.storage_check_tolerance_pct} %)"
                       + (f"; lines in {', '.join(doc['other_currencies'])} too" if doc["other_currencies"] else ""))
    return {**doc, "status": "MISMATCH"}
