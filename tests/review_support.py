"""Helpers shared by the MANUAL_REVIEW, stuck-submits, parked-webhooks and orphan-jobs tests: a provider
simulator the platform reaches over HTTP (and that can go down and come back on the same address,
its jobs kept), a ManualClock platform whose tenants have a spend budget in force (so the claim
reserves budget too), a task driven into MANUAL_REVIEW for real, and what a task still holds."""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest

from aivedio.attempts import steps
from aivedio.attempts.lifecycle import AttemptRef
from aivedio.spend import budgets
from aivedio.billing.settlement import SETTLED_EVENT, settle
from aivedio.bootstrap import apply_config
from aivedio.config import (Limits, MaintenanceService, ManualClock, MediaConfig, PlatformConfig, ProviderAccount,
                            ProviderConfig, SimulatorBehaviour, Timers)
from aivedio_tools.provider_sim import SimulatorServer
from aivedio.providers.webhooks import sign_webhook
from tests.admission_support import clear_cache, new_tenant
from tests.billing_support import ADMIN
from tests.scheduler_support import UNCAPPED, claim_first, submit

SECRET = "whsec_c2ltdWxhdG9yLXNlY3JldA=="
OPERATOR = "op:operator"
DROPPED_SEND = {"accept_then_timeout_rate": 1.0, "accept_then_timeout_mode": "drop"}  # the job exists; its answer is lost
SAFE_WINDOW = 600  # platform seconds a lookup may keep failing before the workflow hands the task to a person


def provider(accounts: int = 1, **behaviour) -> ProviderConfig:
    sim = SimulatorBehaviour(**{"queue_seconds_min": 0, "queue_seconds_max": 0, "latency_seconds_min": 30,
                                "latency_seconds_max": 30, "failure_rate": 0.0, **behaviour})
    return ProviderConfig(name="provider-a", submit_timeout_seconds=0.5, webhook_secret=SECRET, simulator=sim,
                          accounts=[ProviderAccount(account_id=f"account-{i:02d}", max_concurrency=20)
                                    for i in range(1, accounts + 1)])


@dataclass
class World:
    p: object
    sim: SimulatorServer
    clock: ManualClock
    port: int
    make_platform: Callable[..., object] | None = None

    def down(self) -> None:
        """The provider's API stops answering (its jobs go on)."""
        from aivedio.providers.registry import close_adapters

        self.sim.stop()
        close_adapters(self.p)  # a pooled keep-alive connection would still reach the stopped server's handler

    def up(self) -> None:
        """It answers again, on the same address, with the jobs it had."""
        self.sim.port = self.port
        self.sim.start()

    def without_provider(self):
        """The same database and clock, as a process sees it once the provider was removed from the config."""
        assert self.make_platform is not None
        return self.make_platform(self.p.config.model_copy(update={"providers": []}), clock=self.clock)


@pytest.fixture
def review_world(make_platform):
    """review_world(maintenance={...}, accounts=1, **behaviour) -> World."""
    made: list[World] = []

    def make(maintenance: dict | None = None, accounts: int = 1, **behaviour) -> World:
        pc = provider(accounts, **behaviour)
        sim = SimulatorServer(pc, pc.simulator, 1.0, port=0).start()
        port = int(sim.base_url.rsplit(":", 1)[1])
        clock = ManualClock(datetime.now(timezone.utc))
        cfg = PlatformConfig(providers=[pc.model_copy(update={"base_url": sim.base_url})],
                             timers=Timers(lease_seconds=60, unknown_safe_window_seconds=SAFE_WINDOW),
                             limits=Limits(aimd_decrease_pct=50),
                             maintenance={k: MaintenanceService(**v) for k, v in (maintenance or {}).items()},
                             media=MediaConfig(enabled=False))  # the review's own path: a success is the task's
        p = make_platform(cfg, clock=clock)
        with p.db.connection() as conn:
            apply_config(conn, p.config, p.clock)
        w = World(p, sim, clock, port, make_platform)
        made.append(w)
        return w

    yield make
    for w in made:
        w.sim.stop()


def claim(w: World, *, budget: bool = True) -> AttemptRef:
    """A tenant (with a spend budget in force) whose one task the scheduler claims."""
    p = w.p
    t = new_tenant(p, **UNCAPPED)
    if budget:
        now = p.clock.now()
        p.db.transaction(lambda c: budgets.set_budget(c, operator=ADMIN, scope_type="TENANT", scope_id=str(t.tenant_id),
                                                      period_start=now - timedelta(hours=1), period_end=now + timedelta(days=2),
                                                      limit_amount=Decimal("1000"), currency="USD"))
        clear_cache(p)
    return claim_first(p, t)


def into_review(w: World, *, sent: bool) -> AttemptRef:
    """A task whose submit stayed unknown until the workflow gave up, for real: `sent` (the simulator
    must accept and then drop the connection) leaves a job at the provider; otherwise the first
    execution marked the send and died before the request left, so no job exists. Then every lookup
    fails (the provider is down) past the safe window: MANUAL_REVIEW. The provider is up again after."""
    p = w.p
    ref = claim(w)
    if not sent:
        with p.db.connection() as conn:
            conn.execute("update task_attempt set submit_started_at = %s where attempt_id = %s",
                         (p.clock.now() - timedelta(seconds=5), ref.attempt_id))
    out = steps.submit(p, ref)
    assert out["then"] == "resolve", out
    assert task(w, ref)["state"] == "SUBMIT_UNKNOWN"
    w.down()
    w.clock.advance(SAFE_WINDOW + 100)
    out = steps.resolve(p, ref, {"errors": 3})
    assert out == {"next": "manual_review", "outcome": "submit_unknown_unresolved"}, out
    w.up()
    assert task(w, ref)["state"] == "MANUAL_REVIEW"
    return ref


def task(w: World, ref: AttemptRef) -> dict:
    with w.p.db.connection() as conn:
        return conn.execute("select * from generation_task where tenant_id = %s and task_id = %s",
                            (ref.tenant_id, ref.task_id)).fetchone()


def attempt(w: World, attempt_id) -> dict:
    with w.p.db.connection() as conn:
        return conn.execute("select * from task_attempt where attempt_id = %s", (attempt_id,)).fetchone()


def orphans_of(w: World, attempt_id) -> list[dict]:
    """The orphan records attributed to an attempt, by id."""
    with w.p.db.connection() as conn:
        return conn.execute("select * from orphan_provider_job where attempt_id = %s order by created_at, provider_job_id",
                            (attempt_id,)).fetchall()


def lost_job_review(w: World, job_id: str = "job_the_provider_lost") -> AttemptRef:
    """A task in MANUAL_REVIEW for PROVIDER_LOST_JOB: the provider accepted job `job_id`, then
    answered 404 for it, and its key lookup answers empty (inside its window)."""
    p = w.p
    ref = claim(w)
    with p.db.connection() as conn:
        conn.execute("""update task_attempt set submit_started_at = %s, submit_finished_at = %s, provider_job_id = %s
                         where attempt_id = %s""", (p.clock.now(), p.clock.now(), job_id, ref.attempt_id))
    w.clock.advance(120)  # past twice the submit timeout: a request on its way would have arrived
    out = steps.to_manual_review(p, ref, "PROVIDER_LOST_JOB", f"the provider answers 404 for job {job_id}")
    assert out["next"] == "manual_review", out
    return ref


def held(w: World, ref: AttemptRef) -> dict[str, int]:
    """What the task still holds: ACTIVE capacity reservations, its credit reservation, budget reservations."""
    with w.p.db.connection() as conn:
        return dict(conn.execute("""
            select (select count(*) from resource_reservation where task_id = %(t)s and state = 'ACTIVE') as resources,
                   (select count(*) from credit_reservation where task_id = %(t)s and state = 'ACTIVE') as credit,
                   (select count(*) from budget_reservation where task_id = %(t)s and state = 'ACTIVE') as budget""",
                                 {"t": ref.task_id}).fetchone())


NOTHING = {"resources": 0, "credit": 0, "budget": 0}


def job_of(w: World, ref: AttemptRef) -> dict:
    """The simulator's own record of the task's job."""
    [job] = [j for j in w.sim.truth["jobs"] if j["client_request_id"] == str(ref.task_id)]
    return job


def settle_once(w: World, ref: AttemptRef) -> dict:
    """What the settlement consumer does with the task's terminal event, delivered twice; returns
    the task's charge. Exactly one settlement must come of it."""
    p = w.p
    with p.db.connection() as conn:
        [ev] = conn.execute("""select event_id, event_type, payload from outbox_event where aggregate_id = %s
                                and event_type in ('TaskSucceeded', 'TaskFailed', 'TaskCancelled')""", (ref.task_id,)).fetchall()
    outcomes = []
    for _ in range(2):
        with p.db.connection() as conn:
            done = settle(conn, ev["payload"], p.clock.now(), event_type=ev["event_type"], event_id=ev["event_id"])
            outcomes.append(done.outcome)
    assert outcomes == ["SETTLED", "REPLAY"], outcomes
    with p.db.connection() as conn:
        n = conn.execute("select count(*) as n from outbox_event where aggregate_id = %s and event_type = %s",
                         (ref.task_id, SETTLED_EVENT)).fetchone()["n"]
        charge = conn.execute("select * from generation_charge where task_id = %s", (ref.task_id,)).fetchone()
    assert n == 1
    return {**charge, "event_type": ev["event_type"], "stage": ev["payload"]["stage"]}


def webhook(w: World, job: dict, status: str, *, webhook_id: str | None = None) -> tuple[dict, str]:
    """A webhook of the provider for `job`, signed at the platform's (manual) time."""
    body = json.dumps({"type": f"job.{status}", "data": {**job, "status": status}})
    return sign_webhook(SECRET, webhook_id or f"msg_{uuid.uuid4().hex}", int(w.clock.now().timestamp()), body), body


def job_doc(job: dict) -> dict:
    """The contract's job document from the simulator's record."""
    return {"id": job["id"], "status": job["status"], "created_at": job["created_at"]}


class Recorder:
    """Stands in for the workflow runner: the executions the lease scanner starts are recorded, not
    run (the test drives the steps itself)."""

    def __init__(self):
        self.started: list[tuple[str, dict]] = []

    def start_execution(self, name, definition, doc):
        self.started.append((name, doc))


def restart(w: World) -> list[tuple[str, dict]]:
    """Run the lease scanner (room service attempt-recovery) a second after now; the executions it started."""
    from aivedio.reconcile import attempt_recovery

    rec = Recorder()
    w.p.extras["workflow_runner"] = rec
    try:
        w.clock.advance(1)
        attempt_recovery.run_once(w.p)
    finally:
        w.p.extras.pop("workflow_runner", None)
    return rec.started


def finish_by_polling(w: World, ref: AttemptRef) -> dict:
    """The restarted workflow's steps: begin routes to check, which polls until the provider's job ends."""
    from tests.waiting import wait_for

    assert steps.begin(w.p, ref)["next"] == "check"
    wait_for(lambda: job_of(w, ref)["status"] in ("succeeded", "failed", "cancelled"), timeout=15)
    return steps.check(w.p, ref)


@pytest.fixture(name="db_url")
def fresh_db_url(request):
    """A database of the test's own (the modules that import this override the per-module one): the
    maintenance services scan every tenant, so one test's leftovers must not be the next one's input."""
    from tests.conftest import create_test_database, drop_test_database

    url = create_test_database(request.node.name.replace("test_", "")[:20])
    yield url
    drop_test_database(url)
