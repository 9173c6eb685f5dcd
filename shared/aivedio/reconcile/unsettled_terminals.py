"""Room service `unsettled-terminals` (ch. 20.7.5, 20.10.2 layer 2): a terminal task whose charge is
not finalized `age_seconds` after it finished is settled from PostgreSQL's facts, whatever became of
its event.

The transaction that finishes a task writes its terminal event to the outbox (lifecycle.finish;
admission's cancel before dispatch), and the settlement consumer applies it. Between the two the
event can be lost for good: the row FAILED after outbox_max_attempts deliveries, a message that
went to the DLQ after MAX_RECEIVES receives, one published and then dropped. Either way the task
keeps its credit reserved and a success is never charged. This service finds such tasks (terminal,
snapshot not finalized, finished at least `age_seconds` ago: long past a normal settlement) and
settles each with the same idempotent code the consumer runs (billing.settlement.settle_in), in a
transaction of its own:

- the payload is the task's terminal outbox row when there is one, whatever its status (PENDING,
  PUBLISHED, FAILED): it is exactly what the consumer would have received;
- when there is none, it is rebuilt from the task and its current attempt as lifecycle.finish
  writes it (terminal_payload): the stage from attempt.final_reason, the job, its charge id and its
  usage from the provider's last answer on the attempt (raw_last_response), output seconds from the
  task's duration on a success. A CANCELLED task without an attempt was cancelled before dispatch
  (its credit was released then) and gets admission's payload. A task whose facts do not say its
  stage is reported (`unreconstructable`), never guessed at.

Settlement locks the wallet first and finds the snapshot finalized if the consumer got there
meanwhile: a REPLAY, which changes nothing; so does a second run, and an event redriven later.
Input settlement cannot apply is parked there as always; a task with an open parked settlement input
(settlement.SETTLEMENT_INPUT_PARKED: its terminal event could not be applied) waits for it
(retry_parked, or a person) and is not settled again here on every run (`parked_waiting`). A parked
provider cost of the task (COST_WITHOUT_CHARGE_ID, say, from orphan-jobs) is not settlement input
and does not hold its settlement back.

Candidates are read without locks (the wallet lock, taken by settlement, is the one that matters,
and taking the task or charge row first would invert settlement's lock order), in batches in
task_id order, the next batch after the last task of this one."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any
from uuid import UUID

import psycopg

from aivedio import tasks
from aivedio.billing.settlement import SETTLEMENT_INPUT_PARKED, TERMINAL_EVENT_TYPES, settle_in
from aivedio.observability import logger
from aivedio.providers.adapter import MalformedDocument, parse_job
from aivedio.reconcile.room import Defaults, Report, in_batches, tuning

# finish()'s own helpers, so a rebuilt payload cannot drift from a written one
from aivedio.terminal_events import TERMINAL_EVENT, event_payload, provider_charged, usage_of

NAME = "unsettled-terminals"
# Every 2 minutes; a task is looked at 10 platform minutes after it finished (a settlement takes
# seconds, and an event the relay still retries is settled from the same payload anyway).
DEFAULTS = Defaults(interval_seconds=120.0, batch_size=100, max_batches=20, age_seconds=600.0)

_FIRST = UUID(int=0)

UNSETTLED_TERMINALS = """
select t.tenant_id, t.task_id, t.state, t.finished_at, t.updated_at, t.current_attempt_id, t.duration_seconds, t.error_code,
       exists (select 1 from billing_parked_event p
                where p.tenant_id = t.tenant_id and p.task_id = t.task_id and p.status = 'OPEN'
                  and p.reason = any(%(input_reasons)s) and p.event_type = any(%(terminal_types)s)) as parked
  from generation_charge c
  join generation_task t on t.tenant_id = c.tenant_id and t.task_id = c.task_id
 where c.finalized_at is null
   and t.state = any(%(terminal)s)
   and coalesce(t.finished_at, t.updated_at) <= %(cutoff)s
   and c.task_id > %(after)s
 order by c.task_id
 limit %(limit)s
"""

# The latest terminal event each task wrote, whatever its delivery status.
TERMINAL_EVENTS_OF = """
select distinct on (aggregate_id) aggregate_id as task_id, event_id, event_type, status, attempts, payload
  from outbox_event
 where aggregate_id = any(%(task_ids)s::uuid[]) and tenant_id = any(%(tenant_ids)s::uuid[])
   and event_type = any(%(types)s)
 order by aggregate_id, created_at desc, event_id desc
"""

ATTEMPT_OF_TASK = """
select * from task_attempt where tenant_id = %(tenant_id)s and attempt_id = %(attempt_id)s
"""


def _job_of(attempt: dict):
    """The provider's job as lifecycle.finish had it: the last answer on the attempt, when it is a
    terminal job document (finish stores the job it finishes with there; a poll's earlier answer
    is not terminal, and then finish had no job)."""
    raw = attempt.get("raw_last_response")
    if not isinstance(raw, dict):
        return None
    try:
        job = parse_job(raw)
    except MalformedDocument:
        return None
    return job if job.terminal else None


def _iso(t: datetime | None) -> str | None:
    return t.astimezone(timezone.utc).isoformat() if t is not None else None


def terminal_payload(task: dict, attempt: dict | None) -> tuple[str, dict[str, Any]] | None:
    """(event type, payload) of the task's terminal event, as its writer wrote it, from the task and
    its current attempt; None when the facts do not say the stage."""
    state = task["state"]
    event_type = TERMINAL_EVENT[state]
    if attempt is None:
        if state == "CANCELLED":  # admission's cancel of a QUEUED task (aivedio.admission.cancel)
            return event_type, {"task_id": str(task["task_id"]), "tenant_id": str(task["tenant_id"]), "state": state,
                                "stage": "BEFORE_DISPATCH"}
        return None
    if not attempt.get("final_reason"):
        return None
    # The media pipeline's failure (aivedio.media.pipeline) ends a task whose attempt finished as
    # the provider's success: its event's stage is the undelivered result's.
    stage = "MEDIA_DELIVERY_FAILED" if state == "MEDIA_INGEST_FAILED" else attempt["final_reason"]
    job = _job_of(attempt)
    usage = usage_of(job)
    if usage is None and attempt.get("actual_cost_amount") is not None:  # the job document is gone, its cost is not
        usage = {"seconds": None, "cost_amount": str(attempt["actual_cost_amount"]), "currency": attempt["actual_cost_currency"]}
    report = {"provider": attempt["provider"], "provider_account": attempt["provider_account"],
              "provider_job_id": job.id if job is not None else attempt["provider_job_id"],
              "charge_id": job.charge_id if job is not None else None,
              "provider_charged": provider_charged(job) or attempt.get("billable_state") == "BILLABLE", "usage": usage}
    return event_type, event_payload(task, attempt["attempt_id"], state, stage=stage, report=report,
                                     error_code=None if state == "SUCCEEDED" else task.get("error_code"),
                                     finished_at=_iso(task["finished_at"]))


def find_unsettled(conn: psycopg.Connection, *, cutoff: datetime, after: UUID = _FIRST, limit: int) -> list[dict]:
    return conn.execute(UNSETTLED_TERMINALS, {"terminal": sorted(tasks.TERMINAL), "cutoff": cutoff, "after": after,
                                              "limit": limit, "input_reasons": list(SETTLEMENT_INPUT_PARKED),
                                              "terminal_types": list(TERMINAL_EVENT_TYPES)}).fetchall()


def events_of(conn: psycopg.Connection, candidates: list[dict]) -> dict[UUID, dict]:
    if not candidates:
        return {}
    rows = conn.execute(TERMINAL_EVENTS_OF, {"task_ids": [c["task_id"] for c in candidates],
                                             "tenant_ids": sorted({c["tenant_id"] for c in candidates}),
                                             "types": list(TERMINAL_EVENT_TYPES)}).fetchall()
    return {r["task_id"]: r for r in rows}


def settle_one(platform, task: dict, event: dict | None, now: datetime) -> tuple[str, str]:
    """Settle one unsettled terminal task in its own transaction: (outcome, source). Outcome is the
    settlement's (SETTLED, REPLAY, PARKED) or UNRECONSTRUCTABLE."""
    def tx(conn: psycopg.Connection) -> tuple[str, str]:
        if event is not None:
            s = settle_in(conn, event["payload"], now, event_type=event["event_type"], event_id=event["event_id"])
            return s.outcome, f"outbox:{event['status']}"
        attempt = None
        if task["current_attempt_id"] is not None:
            attempt = conn.execute(ATTEMPT_OF_TASK, {"tenant_id": task["tenant_id"],
                                                     "attempt_id": task["current_attempt_id"]}).fetchone()
        built = terminal_payload(task, attempt)
        if built is None:
            return "UNRECONSTRUCTABLE", "facts"
        event_type, payload = built
        return settle_in(conn, payload, now, event_type=event_type).outcome, "facts"

    return platform.db.transaction(tx)


def run_once(platform) -> Report:
    t = tuning(platform, NAME)
    now = platform.clock.now()
    cutoff = now - t.age
    report = Report(NAME)
    cursor = {"after": _FIRST}

    def batch(limit: int) -> tuple[int, int]:
        with platform.db.connection() as conn:
            candidates = find_unsettled(conn, cutoff=cutoff, after=cursor["after"], limit=limit)
            events = events_of(conn, [c for c in candidates if not c["parked"]])
        if candidates:
            cursor["after"] = candidates[-1]["task_id"]
        settled = 0
        for task in candidates:
            if task["parked"]:
                report.count("parked_waiting")
                continue
            outcome, source = settle_one(platform, task, events.get(task["task_id"]), now)
            report.count(outcome.lower())
            report.count(f"from_{source.split(':')[0]}")
            if source.startswith("outbox:"):
                report.count(f"event_{source.split(':')[1].lower()}")
            if outcome == "SETTLED":
                settled += 1
            log = logger.warning if outcome in ("SETTLED", "PARKED", "UNRECONSTRUCTABLE") else logger.info
            log("unsettled terminal task", extra={"tenant_id": str(task["tenant_id"]), "task_id": str(task["task_id"]),
                                                  "state": task["state"], "outcome": outcome, "source": source,
                                                  "finished_at": _iso(task["finished_at"])})
            if outcome == "UNRECONSTRUCTABLE":
                report.details.setdefault("unreconstructable_tasks", []).append(str(task["task_id"]))
        return len(candidates), settled

    in_batches(report, t, batch)
    report.details.setdefault("settled", 0)
    return report


# --- task-level reconciliation (ch. 20.10.2 layer 2), for `aivedio reconcile tasks` ---------------

# Settled tasks whose charge snapshot disagrees with the reservation or the ledger: the amount the
# reservation settled, the CONSUMED side of the settle transaction, and credit still reserved.
# Read over charges finalized since a time (idx_generation_charge_finalized), so it stays cheap.
SETTLED_DISAGREEMENTS = """
select c.tenant_id, c.task_id, c.settled_outcome, c.final_charge_amount, c.finalized_at, c.settle_ledger_txn_id,
       r.settled_amount as reservation_settled, r.reserved_amount - r.settled_amount - r.released_amount as still_reserved,
       coalesce(s.consumed, 0)::bigint as ledger_consumed
  from generation_charge c
  join credit_reservation r on r.tenant_id = c.tenant_id and r.task_id = c.task_id
  left join lateral (select sum(e.amount_delta) as consumed from ledger_entry e
                      where e.ledger_txn_id = c.settle_ledger_txn_id and e.tenant_id = c.tenant_id
                        and e.bucket = 'CONSUMED') s on true
 where c.finalized_at >= %(since)s
   and (c.final_charge_amount <> r.settled_amount or coalesce(s.consumed, 0) <> c.final_charge_amount
        or r.reserved_amount > r.settled_amount + r.released_amount)
 order by c.finalized_at, c.task_id
 limit %(limit)s
"""


def check(platform, *, since: datetime, limit: int = 100) -> dict[str, Any]:
    """After a run: the terminal tasks still unsettled past the age (with why, when the service
    could not settle them), and the settled tasks since `since` whose charge disagrees."""
    t = tuning(platform, NAME)
    cutoff = platform.clock.now() - t.age
    with platform.db.connection() as conn:
        unsettled = find_unsettled(conn, cutoff=cutoff, limit=limit)
        events = events_of(conn, unsettled)
        disagreements = conn.execute(SETTLED_DISAGREEMENTS, {"since": since, "limit": limit}).fetchall()

    def why(row: dict) -> str:
        if row["parked"]:
            return "parked"
        return "event " + events[row["task_id"]]["status"] if row["task_id"] in events else "no event"

    return {
        "unsettled": [{"tenant_id": str(r["tenant_id"]), "task_id": str(r["task_id"]), "state": r["state"],
                       "finished_at": _iso(r["finished_at"]), "why": why(r)} for r in unsettled],
        "disagreements": [{"tenant_id": str(r["tenant_id"]), "task_id": str(r["task_id"]), "outcome": r["settled_outcome"],
                           "final_charge_amount": r["final_charge_amount"], "reservation_settled": r["reservation_settled"],
                           "ledger_consumed": r["ledger_consumed"], "still_reserved": r["still_reserved"],
                           "finalized_at": _iso(r["finalized_at"])} for r in disagreements],
    }


def since_hours(platform, hours: float) -> datetime:
    return platform.clock.now() - timedelta(hours=hours)
