"""Helpers shared by the scheduler tests: tenants whose admission limits never bind, submitting
through the real `admit()` (and telling the ring, as the queue indexer does), and the two halves
of an attempt a test plays itself: taking claimed attempts to RUNNING, and completing them with
the release of their reservations in the same transaction."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import psycopg

from aivedio.admission.models import GenerationRequest
from aivedio.admission.service import admit
from aivedio.auth import Caller
from aivedio.scheduling.resources import release_attempt
from aivedio.scheduling.ring import Ring
from aivedio.tasks import cas_transition

# Admission limits out of the way (rates, queue depth, cost budgets, expected wait): only the
# scheduler's limits are under test.
OPEN = dict(user_submit_rate_per_minute=100_000, tenant_submit_rate_per_minute=100_000, max_user_queued_tasks=10_000,
            max_user_queued_units=100_000, max_queued_tasks=10_000, max_queued_units=100_000,
            max_cost_per_minute=100_000_000, max_cost_per_day=1_000_000_000, max_wait_seconds=100_000_000,
            allow_best_effort_downgrade=False)
# Running caps high enough never to bind, for tests about something else.
UNCAPPED = dict(max_running_tasks=10_000, max_running_units=10_000, max_user_running_tasks=10_000,
                max_user_running_units=10_000)
BODY_1U = {"model": "video-model-x", "mode": "text_to_video", "prompt": "a fox", "duration_seconds": 5, "resolution": "720p"}
BODY_2U = {**BODY_1U, "duration_seconds": 10}  # 2 fairness units
BODY_EXPENSIVE = {**BODY_1U, "resolution": "4k"}  # EXPENSIVE lane
LIVE_STATES = ("DISPATCHING", "SUBMITTED", "RUNNING", "SUBMIT_UNKNOWN", "CANCEL_REQUESTED", "PROVIDER_SUCCEEDED",
               "MEDIA_PROCESSING", "MANUAL_REVIEW", "MEDIA_INGEST_FAILED")


def submit(platform, tenant_id, user_id, body: dict = BODY_1U, n: int = 1, ring: bool = True,
           project: str | None = None) -> list[uuid.UUID]:
    """Admit n tasks through the core (as a key of `project`, when given) and put the tenant on its
    lane's ring (the queue indexer's job)."""
    caller = Caller(tenant_id, user_id, "OWNER", project)
    req = GenerationRequest(**body)
    out = []
    for _ in range(n):
        res = json.loads(admit(platform, caller, req, body, uuid.uuid4().hex).body)
        if ring:
            Ring(platform).add(res["queue_class"], tenant_id)
        out.append(uuid.UUID(res["task_id"]))
    return out


@dataclass(frozen=True)
class Running:
    attempt_id: uuid.UUID
    task_id: uuid.UUID
    tenant_id: uuid.UUID
    provider: str
    account: str
    version: int  # the task's version once RUNNING: what a completion CASes on
    capacity_mode: str = "NORMAL"


def pick_attempts(platform, n: int, *, only_tasks: set | None = None) -> list[Running]:
    """The attempt workflow's first step: take claimed attempts (attempt and task DISPATCHING) and
    move both to RUNNING by CAS. SKIP LOCKED, so several dispatchers never take one attempt twice."""
    now = platform.clock.now()

    def tx(conn: psycopg.Connection) -> list[Running]:
        rows = conn.execute(
            """select a.attempt_id, a.task_id, a.tenant_id, a.provider, a.provider_account, a.capacity_mode, t.version
                 from task_attempt a join generation_task t on t.task_id = a.task_id and t.tenant_id = a.tenant_id
                where a.state = 'DISPATCHING' and t.state = 'DISPATCHING' and t.current_attempt_id = a.attempt_id
                order by a.created_at limit %s
                  for update of a, t skip locked""",
            (n,),
        ).fetchall()
        out = []
        for r in rows:
            if only_tasks is not None and r["task_id"] not in only_tasks:
                continue
            row = cas_transition(conn, tenant_id=r["tenant_id"], task_id=r["task_id"], from_state="DISPATCHING",
                                 version=r["version"], to_state="RUNNING", now=now, started_at=now)
            if row is None:
                continue
            conn.execute("""update task_attempt set state = 'RUNNING', submit_started_at = %s, updated_at = %s
                             where attempt_id = %s and state = 'DISPATCHING'""", (now, now, r["attempt_id"]))
            out.append(Running(r["attempt_id"], r["task_id"], r["tenant_id"], r["provider"], r["provider_account"],
                               row["version"], r["capacity_mode"]))
        return out

    return platform.db.transaction(tx)


def complete(platform, a: Running) -> tuple[bool, int]:
    """The completion handler: CAS the task RUNNING -> PROVIDER_SUCCEEDED -> SUCCEEDED from the
    version it ran at, finish the attempt, and release its reservations, in one transaction. The
    release is called whatever the CAS said, as a careless handler would: it must be a CAS itself,
    so a duplicate changes nothing. Returns (won the CAS, reservations released)."""

    def tx(conn: psycopg.Connection) -> tuple[bool, int]:
        now = platform.clock.now()
        row = cas_transition(conn, tenant_id=a.tenant_id, task_id=a.task_id, from_state="RUNNING", version=a.version,
                             to_state="PROVIDER_SUCCEEDED", now=now)
        if row is not None:
            row = cas_transition(conn, tenant_id=a.tenant_id, task_id=a.task_id, from_state="PROVIDER_SUCCEEDED",
                                 version=row["version"], to_state="SUCCEEDED", now=now, finished_at=now)
            conn.execute("update task_attempt set state = 'SUCCEEDED', updated_at = %s where attempt_id = %s and state = 'RUNNING'",
                         (now, a.attempt_id))
        released = release_attempt(conn, a.attempt_id, now)
        return row is not None, len(released)

    return platform.db.transaction(tx)


def finish_all(platform, only_tasks: set | None = None) -> list[Running]:
    """Run and complete every claimed attempt (of `only_tasks`, when given)."""
    done = []
    while True:
        batch = pick_attempts(platform, 500, only_tasks=only_tasks)
        if not batch:
            return done
        for a in batch:
            won, released = complete(platform, a)
            assert won and released > 0, (a, won, released)
        done += batch


def counters(conn: psycopg.Connection) -> dict[tuple[str, int], int]:
    return {(r["resource_key"], r["shard_no"]): r["used_units"]
            for r in conn.execute("select resource_key, shard_no, used_units from resource_pool_shard").fetchall()}


def used(conn: psycopg.Connection, key: str) -> int:
    return int(conn.execute("select coalesce(sum(used_units), 0)::bigint as u from resource_pool_shard where resource_key = %s",
                            (key,)).fetchone()["u"])


def claim_first(platform, tenant) -> "AttemptRef":
    """Submit one task for `tenant`, tick the scheduler, and return the attempt it claimed."""
    from aivedio.attempts.lifecycle import AttemptRef
    from aivedio.scheduling.scheduler import Scheduler

    [task_id] = submit(platform, tenant.tenant_id, tenant.user_id)
    Scheduler(platform).tick(5.0)
    with platform.db.connection() as conn:
        row = conn.execute("select tenant_id, task_id, attempt_id, fencing_token from task_attempt where task_id = %s",
                           (task_id,)).fetchone()
    assert row is not None, "the scheduler claimed nothing"
    return AttemptRef(row["tenant_id"], row["task_id"], row["attempt_id"], row["fencing_token"])


def index_queued(platform, task_id) -> None:
    """What the queue indexer does with a requeue's TaskQueued (tests that run no outbox relay): the
    task's tenant back on its lane's ring, which a visit that drained it took it off."""
    from aivedio.scheduling.ring import Ring

    with platform.db.connection() as conn:
        t = conn.execute("select tenant_id, queue_class from generation_task where task_id = %s", (task_id,)).fetchone()
    Ring(platform).add(t["queue_class"], t["tenant_id"])
