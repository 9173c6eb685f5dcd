"""Provider and media costs (ch. 20.5.5, 20.9.1, 20.9.2): what the platform pays, kept apart from
what the user is charged. Amounts are Decimal with their currency and are never summed across
currencies: every figure of the report is per currency.

Recording. A terminal event carries the provider's usage and cost. The attempt gets its actual cost
(task_attempt.actual_cost_amount/currency, beside the estimate the scheduler wrote), and the cost
becomes a provider_cost_event, unique on (provider, account, external charge id, event type), so a
redelivered event adds nothing. A cost without a charge id gets a conservative composite key and is
parked for reconciliation (the invoice decides), as is a billed job whose cost is unknown, a cost
in another currency than one already recorded for the attempt, or a cost with no attempt.

Report. Over a period: every provider cost (failed, cancelled and duplicate attempts included)
spread over the successful, delivered videos: cost per successful video, per successful second and
per playable minute; the duplicate-generation cost rate (cost of billed attempts that did not
deliver a task that another attempt delivered, and of costs mapped to no attempt, over all provider
cost); and media costs by tenant and kind: imported from the cloud's cost reports
(aivedio.spend.media_costs), and each task's worker time and stored bytes as the media pipeline
records them (aivedio.media.pipeline), with the media cost and the all-in cost (provider and media)
per successful video."""
from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

import psycopg

from aivedio.spend import parked

SOURCE = "API"  # the platform's own record of the provider's answer (callback or poll); invoices are INVOICE
# MEDIA_INGEST_FAILED: the provider completed the job, the platform could not deliver it.
COST_EVENT_TYPE = {"SUCCEEDED": "GENERATION", "FAILED": "FAILED_CHARGE", "CANCELLED": "CANCELLATION_FEE",
                   "MEDIA_INGEST_FAILED": "GENERATION"}
QUANTUM = Decimal("0.00000001")  # numeric(20, 8)
GENERATION_STAGES = ("PROVIDER_SUCCEEDED", "MEDIA_DELIVERY_FAILED")


def cost_event_type(state: str, stage: str | None) -> str:
    """A cost's event type from the task's terminal state and the stage it ended in: a job the provider
    completed is GENERATION whatever became of the task after it. Shared with the invoice fixes
    (aivedio.spend.invoice_matching), so a cost they book has the type the platform's own record of it
    has or will have, and the two meet on the charge key instead of both being kept. KeyError for a
    state that is not terminal."""
    return "GENERATION" if stage in GENERATION_STAGES else COST_EVENT_TYPE[state]


# For each reported cost: the provider_cost_event (unless `insert_event` is false: a zero cost), the
# attempt's actual cost unless it is set already, and what was found on the attempt, in one statement
# (the main query sees the attempts as they were before the CTE's update).
RECORD_COSTS = """
with ev as (
    select * from unnest(%(attempts)s::uuid[], %(tenants)s::uuid[], %(tasks)s::uuid[], %(providers)s::text[], %(accounts)s::text[],
                         %(charges)s::text[], %(types)s::text[], %(amounts)s::numeric[], %(currencies)s::text[],
                         %(occurred)s::timestamptz[], %(hashes)s::text[], %(inserts)s::bool[]) with ordinality
        as u(attempt_id, tenant_id, task_id, provider, account, charge_id, event_type, amount, currency, occurred_at, hash,
             insert_event, n)),
cost_event as (
    insert into provider_cost_event (attempt_id, tenant_id, task_id, provider, provider_account_id, external_charge_id,
                                     event_type, amount, currency, source, occurred_at, raw_payload_hash)
    select attempt_id, tenant_id, task_id, provider, account, charge_id, event_type, amount, currency, %(source)s, occurred_at, hash
      from ev where insert_event
    on conflict (provider, provider_account_id, external_charge_id, event_type) do nothing),
upd as (
    update task_attempt a set actual_cost_amount = ev.amount, actual_cost_currency = ev.currency, updated_at = ev.occurred_at
      from ev
     where ev.attempt_id is not null and a.attempt_id = ev.attempt_id and a.task_id = ev.task_id and a.actual_cost_amount is null
    returning a.attempt_id)
select ev.attempt_id, exists (select 1 from upd where upd.attempt_id = ev.attempt_id) as updated, a.attempt_id as found,
       a.actual_cost_amount, a.actual_cost_currency
  from ev left join task_attempt a on a.attempt_id = ev.attempt_id and a.task_id = ev.task_id
 order by ev.n
"""


@dataclass(frozen=True)
class RecordedCost:
    status: str  # RECORDED (written, or there already) | NO_COST | PARKED
    amount: Decimal | None = None
    currency: str | None = None


@dataclass(frozen=True)
class CostReport:
    """What one terminal event says the provider charged (`usage` has cost_amount and currency, or is None)."""

    payload: dict
    state: str
    stage: str
    tenant_id: UUID
    task_id: UUID
    attempt_id: UUID | None
    provider: str | None
    provider_account: str | None
    provider_job_id: str | None
    charge_id: str | None
    provider_charged: bool
    usage: Any
    occurred_at: datetime
    event_type: str | None = None
    event_id: Any = None


def record_provider_cost(conn: psycopg.Connection, **report: Any) -> RecordedCost:
    """Record the cost one terminal event reports, idempotently (record_provider_costs of one)."""
    return record_provider_costs(conn, [CostReport(**report)])[0]


def record_provider_costs(conn: psycopg.Connection, reports: list[CostReport]) -> list[RecordedCost]:
    """Record the costs terminal events report, idempotently. One statement awaits an answer (the
    attempts' cost check, for all of them at once); the parking of odd cases is pipelined."""
    out: list[RecordedCost | None] = [None] * len(reports)
    rows: list[tuple[int, dict]] = []  # (index, the row for RECORD_COSTS)
    for i, r in enumerate(reports):
        ids = _ids(r)
        amount = getattr(r.usage, "cost_amount", None) if r.usage is not None else None
        currency = getattr(r.usage, "currency", None) if r.usage is not None else None
        if amount is None or not currency:
            if r.provider_charged:
                parked.park(conn, reason="COST_UNKNOWN", detail="the provider billed this job without reporting its cost", **ids)
                out[i] = RecordedCost("PARKED")
            else:
                out[i] = RecordedCost("NO_COST")
            continue
        amount = Decimal(amount).quantize(QUANTUM)
        if amount == 0 and r.attempt_id is None:
            out[i] = RecordedCost("NO_COST", amount, currency)
            continue
        cost_type = cost_event_type(r.state, r.stage)
        external = r.charge_id
        if amount != 0 and external is None:
            # No stable charge id: a conservative composite key, and reconciliation decides (ch. 20.5.5).
            external = f"composite:{r.provider_job_id or r.attempt_id or r.task_id}"
            parked.park(conn, reason="COST_WITHOUT_CHARGE_ID", detail=f"composite key {external}", **ids)
        digest = hashlib.sha256(f"{r.charge_id}|{r.provider_job_id}|{amount}|{currency}|{r.stage}".encode()).hexdigest()
        rows.append((i, {"attempt_id": r.attempt_id, "tenant_id": r.tenant_id, "task_id": r.task_id,
                         "provider": r.provider or "unknown", "account": r.provider_account or "unknown", "charge_id": external,
                         "event_type": cost_type, "amount": amount, "currency": currency, "occurred_at": r.occurred_at,
                         "hash": digest, "insert_event": amount != 0}))
    if rows:
        cols = ("attempt_id", "tenant_id", "task_id", "provider", "account", "charge_id", "event_type", "amount", "currency",
                "occurred_at", "hash", "insert_event")
        names = ("attempts", "tenants", "tasks", "providers", "accounts", "charges", "types", "amounts", "currencies",
                 "occurred", "hashes", "inserts")
        found = conn.execute(RECORD_COSTS, {"source": SOURCE, **{n: [row[c] for _, row in rows] for n, c in zip(names, cols)}}
                             ).fetchall()
        # One answer row per input row, in input order.
        for (i, row), res in zip(rows, found):
            out[i] = _checked(conn, reports[i], row, res)
    return out  # type: ignore[return-value]


def _ids(r: CostReport) -> dict:
    return dict(payload=r.payload, event_type=r.event_type, event_id=r.event_id, task_id=r.task_id, tenant_id=r.tenant_id,
                attempt_id=r.attempt_id)


def _checked(conn: psycopg.Connection, r: CostReport, row: dict, res: dict) -> RecordedCost:
    """What the attempt said about one recorded cost: set now, the same as before, or parked."""
    amount, currency = row["amount"], row["currency"]
    status = "RECORDED" if amount != 0 else "NO_COST"
    ids = _ids(r)
    if r.attempt_id is None:
        parked.park(conn, reason="UNMAPPED_ATTEMPT", detail="a cost without an attempt", **ids)
        return RecordedCost("PARKED", amount, currency)
    if res["updated"]:
        return RecordedCost(status, amount, currency)
    if res["found"] is None:
        parked.park(conn, reason="UNMAPPED_ATTEMPT", detail=f"no attempt {r.attempt_id} of task {r.task_id}", **ids)
        return RecordedCost("PARKED", amount, currency)
    if res["actual_cost_currency"] != currency:
        parked.park(conn, reason="CURRENCY_MISMATCH", detail=f"attempt cost in {res['actual_cost_currency']}, event in {currency}",
                    **ids)
        return RecordedCost("PARKED", amount, currency)
    if Decimal(res["actual_cost_amount"]) != amount:
        # The provider_cost_event still records what this event said, under its own key.
        parked.park(conn, reason="COST_MISMATCH", detail=f"attempt cost {res['actual_cost_amount']}, event {amount}", **ids)
        return RecordedCost("PARKED", amount, currency)
    return RecordedCost(status, amount, currency)


@dataclass(frozen=True)
class MediaCost:
    """One aggregated media cost line (transcode, storage, egress...), attributed by the object's tags."""

    source_key: str  # the source line's identity: a re-import of it adds nothing
    kind: str
    amount: Decimal
    currency: str
    occurred_at: datetime
    tenant_id: UUID | None = None
    task_id: UUID | None = None
    project_id: str | None = None
    tags: dict | None = None


RECORD_MEDIA_COSTS = """
insert into media_cost_event (source_key, tenant_id, task_id, project_id, kind, amount, currency, occurred_at, tags)
select * from unnest(%(keys)s::text[], %(tenants)s::uuid[], %(tasks)s::uuid[], %(projects)s::text[], %(kinds)s::text[],
                     %(amounts)s::numeric[], %(currencies)s::text[], %(occurred)s::timestamptz[], %(tags)s::jsonb[])
on conflict (source_key) do nothing
returning source_key
"""


def record_media_costs(conn: psycopg.Connection, lines: list[MediaCost]) -> set[str]:
    """Record media cost lines in one statement, idempotently; returns the source keys that are new."""
    if not lines:
        return set()
    rows = conn.execute(RECORD_MEDIA_COSTS, {
        "keys": [m.source_key for m in lines], "tenants": [m.tenant_id for m in lines], "tasks": [m.task_id for m in lines],
        "projects": [m.project_id for m in lines], "kinds": [m.kind for m in lines],
        "amounts": [Decimal(m.amount).quantize(QUANTUM) for m in lines], "currencies": [m.currency for m in lines],
        "occurred": [m.occurred_at for m in lines], "tags": [json.dumps(m.tags or {}) for m in lines]}).fetchall()
    return {r["source_key"] for r in rows}


def record_media_cost(conn: psycopg.Connection, **line: Any) -> bool:
    """Record one media cost line (MediaCost's fields); True when it is new."""
    m = MediaCost(**line)
    return m.source_key in record_media_costs(conn, [m])


# --- the report ------------------------------------------------------------------------------------------

COST_ROWS = """
select e.amount, e.currency, e.provider, e.event_type, e.attempt_id, e.task_id as event_task_id,
       a.task_id, c.settled_attempt_id, c.settled_outcome
  from provider_cost_event e
  left join task_attempt a on a.attempt_id = e.attempt_id
  left join generation_charge c on c.task_id = coalesce(a.task_id, e.task_id)
 where e.occurred_at >= %(start)s and e.occurred_at < %(end)s
   and (%(provider)s::text is null or e.provider = %(provider)s)
"""

# Successful, delivered videos: settled as SUCCEEDED in the period (ch. 20.9.1 "成功且达到可交付标准").
SUCCESSES = """
select count(*) as videos, coalesce(sum(c.delivered_seconds), 0)::bigint as seconds
  from generation_charge c
  left join task_attempt a on a.attempt_id = c.settled_attempt_id
 where c.finalized_at >= %(start)s and c.finalized_at < %(end)s and c.settled_outcome like 'SUCCEEDED/%%'
   and (%(provider)s::text is null or a.provider = %(provider)s)
"""

MEDIA_ROWS = """
select tenant_id, kind, currency, sum(amount) as amount, count(*) as lines
  from media_cost_event where occurred_at >= %(start)s and occurred_at < %(end)s
 group by tenant_id, kind, currency
"""


def _ratio(num: Decimal, den: Decimal | int) -> str | None:
    if not den:
        return None
    return str((Decimal(num) / Decimal(den)).quantize(QUANTUM))


def cost_report(conn: psycopg.Connection, *, start: datetime, end: datetime, provider: str | None = None) -> dict:
    q = {"start": start, "end": end, "provider": provider}
    rows = conn.execute(COST_ROWS, q).fetchall()
    succ = conn.execute(SUCCESSES, q).fetchone()
    videos, seconds = int(succ["videos"]), int(succ["seconds"])
    per: dict[str, dict[str, Any]] = defaultdict(lambda: {
        "provider_cost": Decimal(0), "duplicate_cost": Decimal(0), "failed_cost": Decimal(0), "delivered_cost": Decimal(0),
        "unmapped_cost": Decimal(0), "by_provider": defaultdict(Decimal), "by_event_type": defaultdict(Decimal),
        "cost_events": 0})
    for r in rows:
        p = per[r["currency"]]
        amount = Decimal(r["amount"])
        p["provider_cost"] += amount
        p["cost_events"] += 1
        p["by_provider"][r["provider"]] += amount
        p["by_event_type"][r["event_type"]] += amount
        succeeded = (r["settled_outcome"] or "").startswith("SUCCEEDED/")
        if r["attempt_id"] is None or r["task_id"] is None:
            p["unmapped_cost"] += amount
            p["duplicate_cost"] += amount  # an orphan job: work nobody asked for twice
        elif succeeded and r["settled_attempt_id"] is not None and r["attempt_id"] != r["settled_attempt_id"]:
            p["duplicate_cost"] += amount  # another attempt of a task that was delivered
        elif succeeded:
            p["delivered_cost"] += amount
        else:
            p["failed_cost"] += amount  # failed, cancelled, or not settled yet
    media: dict[str, dict[str, Any]] = defaultdict(lambda: {"media_cost": Decimal(0), "by_tenant": defaultdict(lambda: defaultdict(Decimal))})
    for r in (conn.execute(MEDIA_ROWS, q).fetchall() if provider is None else ()):  # media costs belong to no provider
        m = media[r["currency"]]
        m["media_cost"] += Decimal(r["amount"])
        m["by_tenant"][str(r["tenant_id"]) if r["tenant_id"] else "unattributed"][r["kind"]] += Decimal(r["amount"])
    currencies: dict[str, Any] = {}
    for cur in sorted(set(per) | set(media)):
        p, m = per.get(cur), media.get(cur)
        provider_cost = p["provider_cost"] if p else Decimal(0)
        media_cost = m["media_cost"] if m else Decimal(0)
        all_in = provider_cost + media_cost
        currencies[cur] = {
            "provider_cost": str(provider_cost),
            "delivered_attempt_cost": str(p["delivered_cost"]) if p else "0",
            "failed_cost": str(p["failed_cost"]) if p else "0",
            "duplicate_cost": str(p["duplicate_cost"]) if p else "0",
            "unmapped_cost": str(p["unmapped_cost"]) if p else "0",
            "cost_events": p["cost_events"] if p else 0,
            "by_provider": {k: str(v) for k, v in sorted(p["by_provider"].items())} if p else {},
            "by_event_type": {k: str(v) for k, v in sorted(p["by_event_type"].items())} if p else {},
            "cost_per_successful_video": _ratio(provider_cost, videos),
            "cost_per_successful_second": _ratio(provider_cost, seconds),
            "cost_per_playable_minute": _ratio(provider_cost * 60, seconds),
            "duplicate_generation_cost_rate": _ratio(p["duplicate_cost"], provider_cost) if p else None,
            "media_cost": str(media_cost),
            "media_by_tenant": {t: {k: str(v) for k, v in sorted(kinds.items())} for t, kinds in sorted(m["by_tenant"].items())} if m else {},
            "media_cost_per_successful_video": _ratio(media_cost, videos),
            "all_in_cost_per_successful_video": _ratio(all_in, videos),
        }
    return {"period": {"start": start.isoformat(), "end": end.isoformat()}, "provider": provider,
            "successful_videos": videos, "successful_seconds": seconds, "currencies": currencies}
