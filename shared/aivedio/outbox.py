"""The transactional outbox: events written in the business transaction that caused them, then
published by a relay at least once.

Writers call write_event() with the connection of their own transaction, so the event exists if
and only if the change does. The relay claims due PENDING rows with FOR UPDATE SKIP LOCKED (so
concurrent relays never deliver the same row at once), delivers each, and marks it PUBLISHED only
after delivery returned. A failed delivery is retried with exponential backoff and becomes FAILED
after Limits.outbox_max_attempts: a dead letter, which the `outbox-dead-letters` service counts
and alarms on, and `aivedio admin outbox redrive` puts back to PENDING. A crash between delivery
and commit delivers again: consumers deduplicate with mark_processed().

The relay polls (in AWS a continuous run, aivedio.wakeups), and a writer need not wait for its next
poll: a handler wrapped in waking_relay() wakes the relay once it has written events, after its
transactions committed, so a TaskQueued or a terminal event is relayed at once. The poll stays the
safety net for a wake that is lost."""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any
from uuid import UUID

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from pydantic import BaseModel

from aivedio.caching import cached
from aivedio.context import get_platform
from aivedio.events import EventEnvelope
from aivedio.events_routing import RELAY
from aivedio.faults import failpoints, safeguards
from aivedio.metrics_catalog import OUTBOX_DELIVERY_ERRORS, OUTBOX_FAILED, OUTBOX_PUBLISHED
from aivedio.observability import logger, publish

if TYPE_CHECKING:
    from aivedio.context import Platform

Deliver = Callable[[dict[str, Any]], None]

PENDING, PUBLISHED, FAILED = "PENDING", "PUBLISHED", "FAILED"
MAX_ERROR_CHARS = 2000

INSERT_EVENT = """
insert into outbox_event (event_id, event_type, aggregate_type, aggregate_id, tenant_id, payload)
values (%(event_id)s, %(event_type)s, %(aggregate_type)s, %(aggregate_id)s, %(tenant_id)s, %(payload)s)
"""

CLAIM_DUE = """
select event_id, event_type, aggregate_type, aggregate_id, tenant_id, payload, attempts, created_at
  from outbox_event
 where status = 'PENDING' and next_retry_at <= now()
 order by created_at, event_id
 limit %(batch)s
   for update skip locked
"""

MARK_PUBLISHED = """
update outbox_event
   set status = 'PUBLISHED', published_at = now(), attempts = attempts + 1, last_error = null
 where event_id = any(%(ids)s)
"""

MARK_DELIVERY_FAILED = """
update outbox_event
   set attempts = attempts + 1,
       last_error = %(error)s,
       status = case when attempts + 1 >= %(max_attempts)s then 'FAILED' else 'PENDING' end,
       next_retry_at = now() + make_interval(secs => %(delay)s)
 where event_id = %(event_id)s
"""

COUNT_BACKLOG = "select count(*) as n from outbox_event where status = 'PENDING'"
COUNT_DEAD_LETTERS = "select count(*) as n from outbox_event where status = 'FAILED'"

# Dead letters (aivedio.reconcile.outbox_dead_letters): what an operator lists and redrives.
DEAD_LETTERS_BY_TYPE = """
select event_type, count(*) as n, min(created_at) as oldest
  from outbox_event where status = 'FAILED'
 group by event_type order by event_type
"""

LIST_EVENTS = """
select event_id, event_type, aggregate_type, aggregate_id, tenant_id, status, attempts, next_retry_at, last_error,
       created_at, published_at, payload
  from outbox_event
 where status = %(status)s
   and (%(event_type)s::text is null or event_type = %(event_type)s)
   and (%(tenant_id)s::uuid is null or tenant_id = %(tenant_id)s)
 order by created_at, event_id
 limit %(limit)s
"""

# Redrive: a FAILED row goes back to PENDING with its attempts reset and due now, so the relay
# delivers it at its next poll with a full set of retries. last_error stays until it is delivered
# (MARK_PUBLISHED clears it). Either the given ids or every FAILED row (of one type); a row that is
# not FAILED (redriven by someone else meanwhile, or never failed) is left as it is.
REDRIVE_DEAD_LETTERS = """
with due as (
    select event_id, attempts from outbox_event
     where status = 'FAILED'
       and (%(ids)s::uuid[] is null or event_id = any(%(ids)s::uuid[]))
       and (%(event_type)s::text is null or event_type = %(event_type)s)
     order by created_at, event_id
       for update skip locked)
update outbox_event o
   set status = 'PENDING', attempts = 0, next_retry_at = now()
  from due
 where o.event_id = due.event_id
returning o.event_id, o.event_type, o.aggregate_type, o.aggregate_id, o.tenant_id, due.attempts as attempts_before, o.last_error
"""

INSERT_PROCESSED = """
insert into processed_event (consumer, event_id) values (%(consumer)s, %(event_id)s)
on conflict do nothing
"""


INSERT_EVENTS = """
insert into outbox_event (event_id, event_type, aggregate_type, aggregate_id, tenant_id, payload)
select * from unnest(%(ids)s::uuid[], %(types)s::text[], %(aggregate_types)s::text[], %(aggregate_ids)s::uuid[],
                     %(tenants)s::uuid[], %(payloads)s::jsonb[])
"""


_written = threading.local()  # events written by this thread: waking_relay() compares the count


def _count_written(n: int) -> None:
    _written.n = getattr(_written, "n", 0) + n


def written() -> int:
    """How many events this thread has written so far (rolled-back ones included)."""
    return getattr(_written, "n", 0)


# After a pass that published, the relay polls every RELAY_HOT_POLL_SECONDS for RELAY_HOT_SECONDS
# before it goes back to its idle interval (functions/outbox_relay): what a batch causes is usually
# written within milliseconds, by processes that may not wake it.
RELAY_HOT_SECONDS = 0.5
RELAY_HOT_POLL_SECONDS = 0.02


@contextmanager
def waking_relay() -> Iterator[None]:
    """Around a handler's whole invocation: when it wrote events, wake the outbox relay once it is
    done, so they are relayed now rather than at the relay's next poll. Its transactions have
    committed by then (a rolled-back event only costs the relay one empty poll).

    A process wakes the relay at most once per RELAY_HOT_POLL_SECONDS: a relay woken that recently
    has just published (what woke it, or what a hot poll found before) and polls that often, so the
    events of this invocation go out as soon without a wake of their own. Under load that spares a
    Redis round trip (in AWS) or a message to the main process (`serve --api-workers`) per request.
    (When the write that woke it rolled back, the relay found nothing and is not polling hot: events
    committed in the next RELAY_HOT_POLL_SECONDS wait for its idle poll, the bound either way.)"""
    before = written()
    try:
        yield
    finally:
        if written() != before:
            platform = get_platform()
            if _relay_wake_due(platform):
                platform.wake(RELAY)


def _relay_wake_due(platform) -> bool:
    now = time.monotonic()
    with _relay_wake_lock:
        last = platform.extras.get("relay_woken_at")
        if last is not None and now - last < RELAY_HOT_POLL_SECONDS:
            return False
        platform.extras["relay_woken_at"] = now
        return True


_relay_wake_lock = threading.Lock()


def write_event(
    conn: psycopg.Connection,
    event_type: str,
    *,
    aggregate_type: str,
    aggregate_id: UUID | None,
    tenant_id: UUID | None,
    payload: dict[str, Any] | BaseModel,
) -> UUID:
    """Add an event to the caller's transaction. Returns its event_id."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(mode="json")
    event_id = uuid.uuid4()
    params = {
        "event_id": event_id,
        "event_type": event_type,
        "aggregate_type": aggregate_type,
        "aggregate_id": aggregate_id,
        "tenant_id": tenant_id,
        "payload": Jsonb(payload),
    }
    if safeguards.broken("publish-in-transaction"):
        _write_after_commit(conn, INSERT_EVENT, params)
    else:
        conn.execute(INSERT_EVENT, params)
    _count_written(1)
    return event_id


def write_events(conn: psycopg.Connection, event_type: str, *, aggregate_type: str,
                 events: list[tuple[UUID | None, UUID | None, dict[str, Any]]]) -> list[UUID]:
    """write_event() for many events of one type in one statement: (aggregate_id, tenant_id,
    payload) each. Returns their event_ids."""
    if not events:
        return []
    ids = [uuid.uuid4() for _ in events]
    params = {"ids": ids, "types": [event_type] * len(events), "aggregate_types": [aggregate_type] * len(events),
              "aggregate_ids": [e[0] for e in events], "tenants": [e[1] for e in events],
              "payloads": [json.dumps(e[2]) for e in events]}
    if safeguards.broken("publish-in-transaction"):
        _write_after_commit(conn, INSERT_EVENTS, params)
    else:
        conn.execute(INSERT_EVENTS, params)
    _count_written(len(ids))
    return ids


# The publish-in-transaction safeguard switched off (a chaos run only): the caller's transaction id,
# and whether it has committed yet, so its events are written by a transaction of their own after it.
CURRENT_XACT = "select pg_current_xact_id()::text as xid"
XACT_STATUS = "select pg_xact_status(%(xid)s::xid8) as status"
AFTER_COMMIT_POLL_SECONDS = 0.005  # real seconds between looks at the caller's transaction


def _write_after_commit(conn: psycopg.Connection, statement: str, params: dict[str, Any]) -> None:
    """Write the event outside the caller's transaction, once that has committed, as a platform
    that publishes after its commit would: a crash in between (the after-commit-before-publish
    failpoint) loses the event while the state it announces stays. A rolled-back caller writes none."""
    with conn.cursor(row_factory=dict_row) as cur:
        xid = cur.execute(CURRENT_XACT).fetchone()["xid"]
    db = get_platform().db

    def later() -> None:
        while True:
            with db.connection() as c:
                status = c.execute(XACT_STATUS, {"xid": xid}).fetchone()["status"]
                if status == "committed":
                    failpoints.hit("after-commit-before-publish")
                    c.execute(statement, params)
                    return
                if status != "in progress":  # aborted: the state is gone, and its event with it
                    return
            time.sleep(AFTER_COMMIT_POLL_SECONDS)

    threading.Thread(target=later, name="outbox-after-commit", daemon=True).start()


def envelope_of(row: dict[str, Any]) -> EventEnvelope:
    return EventEnvelope(
        event_id=row["event_id"],
        event_type=row["event_type"],
        tenant_id=row["tenant_id"],
        aggregate_type=row["aggregate_type"],
        aggregate_id=row["aggregate_id"],
        payload=row["payload"],
        created_at=row["created_at"],
    )


def retry_delay_seconds(platform: Platform, attempts_before: int) -> float:
    """Real seconds until the next delivery after the (attempts_before + 1)th failure."""
    t = platform.config.timers
    platform_seconds = min(t.outbox_retry_max_seconds, t.outbox_retry_base_seconds * (2 ** min(attempts_before, 30)))
    return platform.clock.real_seconds(platform_seconds)


def relay_once(platform: Platform, deliver: Deliver, batch: int = 100, *, published_types: set[str] | None = None) -> int:
    """Deliver up to `batch` due events; returns how many were published, and adds their types to
    `published_types` when given. Rows another relay holds are skipped, not waited for."""
    max_attempts = platform.config.limits.outbox_max_attempts
    published: list[UUID] = []
    failed = 0
    with platform.db.connection() as conn, conn.transaction():
        with conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute(CLAIM_DUE, {"batch": batch}).fetchall()
            for row in rows:
                failpoints.hit("after-commit-before-publish")  # its state committed; this event not yet delivered or marked
                try:
                    deliver(envelope_of(row).to_message())
                except Exception as e:  # any failure means: not delivered, try again later
                    failed += 1
                    give_up = row["attempts"] + 1 >= max_attempts
                    logger.warning(
                        "outbox delivery failed",
                        extra={"event_id": str(row["event_id"]), "event_type": row["event_type"],
                               "attempts": row["attempts"] + 1, "gave_up": give_up, "error": repr(e)},
                    )
                    cur.execute(
                        MARK_DELIVERY_FAILED,
                        {"event_id": row["event_id"], "error": repr(e)[:MAX_ERROR_CHARS], "max_attempts": max_attempts,
                         "delay": retry_delay_seconds(platform, row["attempts"])},
                    )
                    if give_up:
                        publish(OUTBOX_FAILED, event_type=row["event_type"])
                else:
                    published.append(row["event_id"])
                    if published_types is not None:
                        published_types.add(row["event_type"])
            if published:
                cur.execute(MARK_PUBLISHED, {"ids": published})
    if published:
        publish(OUTBOX_PUBLISHED, len(published))
    if failed:
        publish(OUTBOX_DELIVERY_ERRORS, failed)
    return len(published)


def backlog(conn: psycopg.Connection) -> int:
    """Events not yet published (due or waiting for a retry)."""
    with conn.cursor(row_factory=dict_row) as cur:
        return int(cur.execute(COUNT_BACKLOG).fetchone()["n"])


def dead_letter_count(conn: psycopg.Connection) -> int:
    """Events that failed Limits.outbox_max_attempts deliveries and wait for `aivedio admin outbox redrive`."""
    with conn.cursor(row_factory=dict_row) as cur:
        return int(cur.execute(COUNT_DEAD_LETTERS).fetchone()["n"])


def dead_letters_by_type(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """FAILED events per event type, with the oldest one's creation time."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(DEAD_LETTERS_BY_TYPE).fetchall()


def list_events(conn: psycopg.Connection, *, status: str = FAILED, event_type: str | None = None,
                tenant_id: UUID | None = None, limit: int = 100) -> list[dict[str, Any]]:
    """Events of one status (the dead letters by default), oldest first."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(LIST_EVENTS, {"status": status, "event_type": event_type, "tenant_id": tenant_id,
                                         "limit": limit}).fetchall()


def redrive(conn: psycopg.Connection, *, event_ids: list[UUID] | None = None,
            event_type: str | None = None) -> list[dict[str, Any]]:
    """Put dead letters back in the relay's way (REDRIVE_DEAD_LETTERS), in the caller's transaction:
    the given ones, or, with event_ids None, every FAILED event (of `event_type`). Returns the rows
    redriven, each with its attempts before the reset."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(REDRIVE_DEAD_LETTERS, {"ids": event_ids, "event_type": event_type}).fetchall()


def mark_processed(conn: psycopg.Connection, consumer: str, event_id: UUID | str) -> bool:
    """Record that `consumer` handled `event_id`; False when it already had. Call it in the same
    transaction as the consumer's effects, so a redelivered event changes nothing."""
    return conn.execute(INSERT_PROCESSED, {"consumer": consumer, "event_id": event_id}).rowcount == 1


# --- the backlog, as admission and the health probe see it -----------------------------------------

# The backlog and the age of its oldest event in one statement (both from the partial index of
# migration 0140). Ages are measured on the database's clock, which wrote created_at.
OUTBOX_STATE = """select count(*) as n, min(created_at) as oldest,
                         coalesce(extract(epoch from now() - min(created_at)), 0)::float8 as age
                    from outbox_event where status = 'PENDING'"""


@dataclass(frozen=True)
class OutboxState:
    pending: int
    oldest_age_seconds: float  # platform seconds (0 without a backlog)
    oldest_created_at: datetime | None


def outbox_state(platform) -> OutboxState:
    def load() -> OutboxState:
        row = platform.db.fetchone(OUTBOX_STATE)
        return OutboxState(int(row["n"]), max(0.0, float(row["age"])) * platform.clock.time_scale, row["oldest"])

    return cached(platform, "outbox_state", load)


def outbox_backlog(platform) -> int:
    return outbox_state(platform).pending


def outbox_overload(platform, state: OutboxState | None = None) -> str | None:
    """Why new work must wait for the outbox (the bus is down or the relay stalled: ch. 18.18,
    20.12.3), or None. Events keep being written meanwhile; only admission stops."""
    st = state or outbox_state(platform)
    limits = platform.config.limits
    if st.pending > limits.outbox_backlog_reject_threshold:
        return f"{st.pending} outbox events wait to be published (threshold {limits.outbox_backlog_reject_threshold})"
    if st.oldest_age_seconds > limits.outbox_backlog_max_age_seconds:
        return (f"the oldest unpublished outbox event is {st.oldest_age_seconds:.0f}s old "
                f"(threshold {limits.outbox_backlog_max_age_seconds:.0f}s)")
    return None
