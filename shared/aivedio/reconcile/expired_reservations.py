"""Room service `expired-reservations` (ch. 18.16.6 ExpiredReservationScanner, ch. 20.7.9): gives back
what a finished piece of work still holds, and only that.

A reservation is released in the transaction that ends its work (lifecycle.finish and requeue
release the attempt's capacity, settlement closes the credit), so what this service finds is a
leak: a crash or a bug between the two. Ch. 20.7.9 says when a scanner may release, and an
expired lease is never enough on its own (River's and Oban's rescuers re-run jobs that still run;
an attempt here may be live at the provider, and its capacity is what keeps the account within
its concurrency):

- capacity (resource_reservation, ACTIVE, lease past by `age_seconds`): released when its attempt
  is final (SUCCEEDED, FAILED, CANCELLED, REJECTED, NOT_ACCEPTED, ABSENT_CONFIRMED) and its task is
  terminal or has moved on to another attempt (or to none: requeued). An attempt that may be live
  at the provider (SUBMITTED, RUNNING, SUBMIT_UNKNOWN, DISPATCHING once its submit started,
  MANUAL_REVIEW) is left to attempt-recovery, which restarts its workflow and looks the job up
  first; a DISPATCHING attempt that never sent is left to it too (`attempt_not_final`), and a
  final attempt whose task is still finishing (a media stage, a cancel on its way) to the task;
- credit (credit_reservation with an open part): released when its task is terminal AND settled
  (the charge snapshot finalized, `age_seconds` ago), no attempt of the task may be live, and no
  refund or parked settlement input (settlement.SETTLEMENT_INPUT_PARKED; a parked provider cost
  is not one) waits for the task. A terminal task that is not settled keeps its credit: releasing
  it would lose a success's charge, so `unsettled-terminals` settles it instead. Ch. 20.7.9's other
  case, a reservation whose task was never created, cannot exist here: admission writes the
  reservation, the task and the charge snapshot in one transaction and the reservation's foreign
  key names the task.

Everything left alone is counted in the report, never released: `live_left_alone` (attempts that
may be live at the provider), `attempt_not_final`, `task_not_finished`, `locked_skipped` (an
attempt another transaction holds: the next run looks again), and for credit
`unsettled_left_to_settlement`, `pending_events_left_alone`, `credit_live_left_alone`.
Releases go through the functions the workflow uses: scheduling.resources.release_attempt (a CAS
ACTIVE -> RELEASED, so a counter is decremented once, whoever else releases) and
billing.reservations.release_remaining (under the wallet lock, idempotent on its business key
release:generation:{task_id}:RELEASED_BY_SCANNER), each logged with its task and why.

Capacity is scanned per attempt: resource_reservation has no index on its lease on purpose (0060:
a claim writes ten rows and each index is paid for on every claim), so each batch is one pass over
the ACTIVE rows, and leaks are rare, so a run is usually one batch. Attempts are taken FOR UPDATE
SKIP LOCKED (two runs never release one attempt at once, and a finishing attempt's own transaction
is not waited for); credit is read first and each reservation checked again under its wallet's
lock, the lock order of every balance change."""
from __future__ import annotations

from datetime import datetime
from uuid import UUID

import psycopg

from aivedio import tasks
from aivedio.billing.ledger import lock_wallet
from aivedio.billing.reservations import release_remaining
from aivedio.billing.settlement import SETTLEMENT_INPUT_PARKED, TERMINAL_EVENT_TYPES
from aivedio.observability import logger
from aivedio.reconcile.room import Defaults, Report, in_batches, tuning
from aivedio.scheduling.resources import release_attempt
from aivedio.tasks import ATTEMPT_FINAL

NAME = "expired-reservations"
# Every 5 minutes; a lease must be a minute past before its reservations are looked at.
DEFAULTS = Defaults(interval_seconds=300.0, batch_size=500, max_batches=20, age_seconds=60.0)

# Attempt states in which the provider may have (or be running) the job.
MAY_BE_LIVE = frozenset({"SUBMITTED", "RUNNING", "SUBMIT_UNKNOWN", "MANUAL_REVIEW"})
RELEASABLE_ATTEMPT = ATTEMPT_FINAL - {"MANUAL_REVIEW"}
RELEASE_REASON = "RELEASED_BY_SCANNER"
OPEN_CREDIT_STATES = ["ACTIVE", "PARTIALLY_SETTLED"]
PENDING_REFUND_STATES = ["PENDING_APPROVAL", "PENDING_SETTLEMENT"]

RELEASE, LIVE, NOT_FINAL, TASK_BUSY = "release", "live_left_alone", "attempt_not_final", "task_not_finished"
UNSETTLED, PENDING_EVENTS = "unsettled_left_to_settlement", "pending_events_left_alone"
CREDIT_LIVE = "credit_live_left_alone"  # a terminal task's credit, one of whose attempts may be live
LOCKED = "locked_skipped"  # an attempt another transaction holds (SKIP LOCKED)

# Attempts holding ACTIVE capacity whose lease is past the cutoff, after the cursor, with what the
# verdict needs. The attempt row is the lock (SKIP LOCKED): release_attempt then CASes its rows. Every
# scanned attempt comes back, a locked one with its attempt columns null (`locked` true), so that a
# batch with locked rows still counts as full and the cursor moves past what was scanned.
EXPIRED_CAPACITY = """
with expired as (
    select r.attempt_id, r.tenant_id, min(r.lease_until) as lease_until, count(*) as reservations
      from resource_reservation r
     where r.state = 'ACTIVE' and r.lease_until <= %(cutoff)s and r.attempt_id > %(after)s
     group by r.attempt_id, r.tenant_id
     order by r.attempt_id
     limit %(limit)s)
select e.attempt_id, e.tenant_id, e.lease_until, e.reservations, l.task_id is null as locked, l.task_id, l.attempt_state,
       l.submit_started_at, l.provider, l.provider_job_id, l.task_state, l.current_attempt_id
  from expired e
  left join lateral (
      select a.task_id, a.state as attempt_state, a.submit_started_at, a.provider, a.provider_job_id,
             t.state as task_state, t.current_attempt_id
        from task_attempt a
        join generation_task t on t.tenant_id = a.tenant_id and t.task_id = a.task_id
       where a.tenant_id = e.tenant_id and a.attempt_id = e.attempt_id
         for update of a skip locked) l on true
 order by e.attempt_id
"""

# Open credit of terminal tasks, with what the verdict needs; read without locks (a candidate is
# checked again under its wallet's lock with `ids`). Only reservations still ACTIVE: every close
# (settlement, release_remaining) leaves nothing open, and the state index keeps this to the tasks
# in flight; an open part on a closed reservation is the wallet check's finding (reserved snapshot
# against the reservations' open parts), not this service's.
OPEN_CREDIT_OF_TERMINAL_TASKS = """
select r.reservation_id, r.wallet_id, r.tenant_id, r.task_id,
       r.reserved_amount - r.settled_amount - r.released_amount as open_amount,
       t.state as task_state, c.finalized_at, c.settled_outcome,
       exists (select 1 from task_attempt a
                where a.tenant_id = r.tenant_id and a.task_id = r.task_id
                  and (a.state = any(%(may_be_live)s) or (a.state = 'DISPATCHING' and a.submit_started_at is not null)))
           as attempt_may_be_live,
       exists (select 1 from refund_request f
                where f.tenant_id = r.tenant_id and f.task_id = r.task_id and f.state = any(%(pending_refunds)s))
           or exists (select 1 from billing_parked_event p
                       where p.tenant_id = r.tenant_id and p.task_id = r.task_id and p.status = 'OPEN'
                         and p.reason = any(%(input_reasons)s) and p.event_type = any(%(terminal_types)s))
           as events_pending
  from credit_reservation r
  join generation_task t on t.tenant_id = r.tenant_id and t.task_id = r.task_id
  left join generation_charge c on c.tenant_id = r.tenant_id and c.task_id = r.task_id
 where r.state = any(%(open_states)s) and r.reserved_amount > r.settled_amount + r.released_amount
   and t.state = any(%(terminal)s)
   and coalesce(c.finalized_at, t.finished_at, t.updated_at) <= %(cutoff)s
   and (%(ids)s::uuid[] is null or r.reservation_id = any(%(ids)s::uuid[]))
   and r.reservation_id > %(after)s
 order by r.reservation_id
 limit %(limit)s
"""

_FIRST = UUID(int=0)


def capacity_verdict(row: dict) -> str:
    """What may be done with an attempt's expired capacity (the rules above): RELEASE, or why not."""
    state = row["attempt_state"]
    if state in MAY_BE_LIVE or (state == "DISPATCHING" and row["submit_started_at"] is not None):
        return LIVE
    if state not in RELEASABLE_ATTEMPT:
        return NOT_FINAL  # never sent (attempt-recovery restarts it), or a state this code does not know
    if tasks.is_terminal(row["task_state"]) or row["current_attempt_id"] != row["attempt_id"]:
        return RELEASE
    return TASK_BUSY


def credit_verdict(row: dict) -> str:
    """What may be done with a terminal task's open credit: RELEASE, or why not."""
    if row["attempt_may_be_live"]:
        return CREDIT_LIVE
    if row["finalized_at"] is None:
        return UNSETTLED
    if row["events_pending"]:
        return PENDING_EVENTS
    return RELEASE


def release_capacity_batch(conn: psycopg.Connection, *, now: datetime, cutoff: datetime, after: UUID,
                           limit: int) -> tuple[list[dict], dict[str, int]]:
    """One batch of attempts, in the caller's transaction: (the rows scanned, locked ones included,
    counts by verdict, with `reservations_released` and `locked_skipped`)."""
    rows = conn.execute(EXPIRED_CAPACITY, {"cutoff": cutoff, "after": after, "limit": limit}).fetchall()
    counts: dict[str, int] = {}
    for row in rows:
        if row["locked"]:  # its own transaction (a finish, another run) holds it; the next run looks again
            counts[LOCKED] = counts.get(LOCKED, 0) + 1
            continue
        verdict = capacity_verdict(row)
        if verdict != RELEASE:
            counts[verdict] = counts.get(verdict, 0) + 1
            continue
        released = release_attempt(conn, row["attempt_id"], now)
        if not released:
            continue  # released by its own transaction meanwhile: the CAS found nothing ACTIVE
        counts["attempts_released"] = counts.get("attempts_released", 0) + 1
        counts["reservations_released"] = counts.get("reservations_released", 0) + len(released)
        logger.warning("leaked capacity released", extra={
            "tenant_id": str(row["tenant_id"]), "task_id": str(row["task_id"]), "attempt_id": str(row["attempt_id"]),
            "attempt_state": row["attempt_state"], "task_state": row["task_state"],
            "why": "task terminal" if tasks.is_terminal(row["task_state"]) else "attempt replaced",
            "lease_until": row["lease_until"].isoformat(), "keys": sorted(r["resource_key"] for r in released),
            "units": sum(r["reserved_units"] for r in released)})
    return rows, counts


def _credit_args(*, cutoff: datetime, after: UUID, limit: int, ids: list[UUID] | None = None) -> dict:
    return {"cutoff": cutoff, "after": after, "limit": limit, "ids": ids, "may_be_live": list(MAY_BE_LIVE),
            "pending_refunds": PENDING_REFUND_STATES, "open_states": OPEN_CREDIT_STATES, "terminal": sorted(tasks.TERMINAL),
            "input_reasons": list(SETTLEMENT_INPUT_PARKED), "terminal_types": list(TERMINAL_EVENT_TYPES)}


def release_credit_batch(conn: psycopg.Connection, *, now: datetime, cutoff: datetime, after: UUID,
                         limit: int) -> tuple[list[dict], dict[str, int]]:
    """One batch of open credit reservations of terminal tasks, in the caller's transaction: the
    candidates are read, their wallets locked (in wallet order), each checked again under the lock
    and released when it still may be."""
    rows = conn.execute(OPEN_CREDIT_OF_TERMINAL_TASKS, _credit_args(cutoff=cutoff, after=after, limit=limit)).fetchall()
    counts: dict[str, int] = {}
    todo = []
    for row in rows:
        verdict = credit_verdict(row)
        if verdict == RELEASE:
            todo.append(row)
        else:
            counts[verdict] = counts.get(verdict, 0) + 1
    if not todo:
        return rows, counts
    wallets = {}
    for wallet_id, tenant_id in sorted({(r["wallet_id"], r["tenant_id"]) for r in todo}):
        wallets[wallet_id] = lock_wallet(conn, tenant_id, wallet_id)
    again = conn.execute(OPEN_CREDIT_OF_TERMINAL_TASKS, _credit_args(
        cutoff=cutoff, after=_FIRST, limit=len(todo), ids=[r["reservation_id"] for r in todo])).fetchall()
    for row in again:
        if credit_verdict(row) != RELEASE:
            continue  # changed before the lock was granted; the next run sees it as it is now
        posted = release_remaining(conn, wallet=wallets[row["wallet_id"]], task_id=row["task_id"], reason_code=RELEASE_REASON)
        if posted is None or not posted.created:
            continue
        counts["credit_released"] = counts.get("credit_released", 0) + 1
        counts["credit_released_amount"] = counts.get("credit_released_amount", 0) + row["open_amount"]
        logger.warning("leaked credit reservation released", extra={
            "tenant_id": str(row["tenant_id"]), "task_id": str(row["task_id"]), "reservation_id": str(row["reservation_id"]),
            "task_state": row["task_state"], "settled_outcome": row["settled_outcome"], "amount": row["open_amount"],
            "ledger_txn_id": str(posted.ledger_txn_id)})
    return rows, counts


def run_once(platform) -> Report:
    t = tuning(platform, NAME)
    now = platform.clock.now()
    cutoff = now - t.age
    report = Report(NAME)

    def scan(batch_fn, key: str, repaired_key: str):
        cursor = {"after": _FIRST}

        def batch(limit: int) -> tuple[int, int]:
            rows, counts = platform.db.transaction(
                lambda conn: batch_fn(conn, now=now, cutoff=cutoff, after=cursor["after"], limit=limit))
            if rows:
                cursor["after"] = rows[-1][key]
            for k, n in counts.items():
                report.count(k, n)
            return len(rows), counts.get(repaired_key, 0)

        return batch

    in_batches(report, t, scan(release_capacity_batch, "attempt_id", "attempts_released"))
    capacity_complete = report.complete
    in_batches(report, t, scan(release_credit_batch, "reservation_id", "credit_released"))
    report.complete = report.complete and capacity_complete
    for k in (LIVE, "attempts_released", "credit_released"):
        report.details.setdefault(k, 0)
    return report
