"""Helpers shared by the tests of the settlement repairs (expired reservations, unsettled terminals,
dead letters): a platform on a ManualClock with one roomy provider account, tasks admitted and
claimed by the real admission and scheduler (so attempts, reservations and counters are the real
ones), and an attempt finished by the real lifecycle.finish with a provider job document."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from uuid import UUID

from aivedio.attempts import lifecycle
from aivedio.attempts.lifecycle import AttemptRef
from aivedio.bootstrap import apply_config
from aivedio.config import Limits, MaintenanceService, ManualClock, PlatformConfig, ProviderAccount, ProviderConfig
from aivedio.providers.adapter import parse_job
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import new_tenant
from tests.scheduler_support import OPEN, UNCAPPED, submit


def start(make_platform, *, service: str | None = None, batch_size: int | None = None, max_batches: int | None = None,
          limits: Limits | None = None):
    """A platform on a ManualClock (now), pools and price book in place; [maintenance.<service>]
    with the batch size and bound given."""
    maintenance = {}
    if service is not None and (batch_size or max_batches):
        maintenance[service] = MaintenanceService(batch_size=batch_size, max_batches=max_batches)
    cfg = PlatformConfig(providers=[ProviderConfig(name="provider-a",
                                                   accounts=[ProviderAccount(account_id="account-01", max_concurrency=200)])],
                         maintenance=maintenance, limits=limits or Limits())
    p = make_platform(cfg, clock=ManualClock(datetime.now(timezone.utc)))
    with p.db.connection() as conn:
        apply_config(conn, p.config, p.clock)
    return p


@dataclass(frozen=True)
class Claimed:
    ref: AttemptRef
    wallet_id: UUID

    @property
    def task_id(self) -> UUID:
        return self.ref.task_id

    @property
    def attempt_id(self) -> UUID:
        return self.ref.attempt_id


def claim(p, n: int) -> list[Claimed]:
    """n tasks of one new tenant, admitted and claimed (attempts DISPATCHING, capacity reserved)."""
    t = new_tenant(p, credits=1_000_000, **{**OPEN, **UNCAPPED})
    task_ids = submit(p, t.tenant_id, t.user_id, n=n)
    Scheduler(p).tick(10.0)
    with p.db.connection() as conn:
        rows = conn.execute("""select tenant_id, task_id, attempt_id, fencing_token from task_attempt
                                where task_id = any(%s) order by task_id""", (task_ids,)).fetchall()
    assert len(rows) == n, f"claimed {len(rows)} of {n}"
    return [Claimed(AttemptRef(r["tenant_id"], r["task_id"], r["attempt_id"], r["fencing_token"]), t.wallet_id) for r in rows]


def job_doc(c: Claimed, status: str = "succeeded", *, cost: str = "0.25", charged: bool = True) -> dict:
    """A provider's job document of the contract (what adapter.parse_job reads)."""
    doc = {"id": f"job-{c.task_id}", "status": status, "created_at": "2026-06-24T08:00:00Z",
           "finished_at": "2026-06-24T08:01:00Z", "usage": {"seconds": 5, "cost_amount": cost, "currency": "USD"},
           "charge_id": f"ch-{c.task_id}" if charged else None}
    if status == "succeeded":
        doc["output_url"] = f"https://cdn.example/{c.task_id}.mp4"
    if status == "failed":
        doc["error"] = {"code": "content_policy", "message": "refused"}
    return doc


def run_and_finish(p, c: Claimed, status: str = "succeeded", **doc_kw) -> dict:
    """The provider accepted the job (attempt and task RUNNING), then reported it `status`: applied
    by lifecycle.apply_job, which finishes the task and writes its terminal event. Returns the job
    document."""
    doc = job_doc(c, status, **doc_kw)
    now = p.clock.now()

    def tx(conn):
        conn.execute("""update task_attempt set state = 'RUNNING', submit_started_at = %s, submit_finished_at = %s,
                               provider_job_id = %s where attempt_id = %s""", (now, now, doc["id"], c.attempt_id))
        loaded = lifecycle.load(conn, c.ref, lock=True)
        lifecycle.move(conn, loaded, "RUNNING", now, started_at=now)
        applied = lifecycle.apply_job(conn, c.ref, parse_job(doc), source="test", now=now)
        assert applied.outcome == "TERMINAL", applied

    p.db.transaction(tx)
    return doc
