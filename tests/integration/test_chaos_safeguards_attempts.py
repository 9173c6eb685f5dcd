"""The attempt lifecycle's safeguard switches and failpoints (issue 18, "Each checker is proven able
to fail"), one at a time, against the real PostgreSQL and the provider simulator: each safeguard
holds with its switch off and gives way with it on, and each failpoint sits in its crash window,
with the lost work resumed as after a real crash.

A switch is turned on here by setting safeguards._BROKEN (the module's parsed environment): the
env and allow-variable rules are safeguards' own tests."""
from __future__ import annotations

import threading
import time

import psycopg
import pytest

from aivedio.attempts import callbacks, executions, steps
from aivedio.attempts.lifecycle import AttemptRef
from aivedio.attempts.recovery import restart_expired
from aivedio.faults import failpoints, safeguards
from aivedio.errors import Unauthenticated
from aivedio.providers.registry import adapter
from aivedio.scheduling.scheduler import Scheduler
from tests.integration.test_attempt_steps import (_job_doc, _webhook, attempt_row, claim_one, task_row,  # noqa: F401
                                                  world)
from tests.reliability.test_attempt_invariants import Recorder, drive
from tests.scheduler_support import index_queued

pytestmark = pytest.mark.xdist_group("attempts")

BROKEN = pytest.mark.parametrize("broken", [False, True], ids=["safeguard-on", "switch-broken"])


def switch(monkeypatch, name: str, broken: bool) -> None:
    assert name in safeguards.SAFEGUARDS
    monkeypatch.setattr(safeguards, "_BROKEN", frozenset({name}) if broken else frozenset())


class Crash(BaseException):
    """What failpoints.hit does to the process (os._exit), as an exception a test can catch."""


def arm(monkeypatch, name: str) -> list[str]:
    """Make failpoint `name` crash every time; returns the names of the failpoints reached."""
    assert name in failpoints.FAILPOINTS
    reached: list[str] = []

    def hit(n: str) -> None:
        reached.append(n)
        if n == name:
            raise Crash(n)

    monkeypatch.setattr(failpoints, "hit", hit)
    return reached


def jobs_of(sim, task_id) -> list[dict]:
    return [j for j in sim.truth["jobs"] if j["client_request_id"] == str(task_id)]


def recorder(p) -> Recorder:
    rec = Recorder()  # the lease scanner's restarts are recorded, not run
    p.extras["workflow_runner"] = rec
    return rec


def restarts_of(rec: Recorder, ref: AttemptRef) -> list[str]:
    """The executions the lease scanner started for this attempt (the module's database holds the
    other tests' attempts too)."""
    return [name for name, doc in rec.started if doc["attempt"]["attempt_id"] == str(ref.attempt_id)]


def current_ref(p, ref: AttemptRef) -> AttemptRef:
    t = task_row(p, ref)
    return AttemptRef(ref.tenant_id, ref.task_id, t["current_attempt_id"], t["current_fencing_token"])


# --- switches -----------------------------------------------------------------------------------------

@BROKEN
def test_lookup_before_retry(world, monkeypatch, broken):
    """The provider accepts and the answer is lost: SUBMIT_UNKNOWN. The lookup by key adopts the job;
    without it the task is resubmitted under a new attempt's key and the provider runs two jobs."""
    switch(monkeypatch, "lookup-before-retry", broken)
    p, sim = world(accept_then_timeout_rate=1.0, accept_then_timeout_mode="drop")
    ref = claim_one(p)
    out = steps.submit(p, ref)
    assert out["then"] == "resolve" and len(jobs_of(sim, ref.task_id)) == 1
    out = steps.resolve(p, ref, out)
    if not broken:
        assert out["next"] == "wait" and out["then"] == "check"
        assert attempt_row(p, ref.attempt_id)["provider_job_id"] == jobs_of(sim, ref.task_id)[0]["id"]
        assert len(jobs_of(sim, ref.task_id)) == 1
        return
    assert out["outcome"] == "requeued"
    assert attempt_row(p, ref.attempt_id)["state"] == "NOT_ACCEPTED"  # not ABSENT_CONFIRMED: nobody asked
    index_queued(p, ref.task_id)
    Scheduler(p).tick(5.0)
    new = current_ref(p, ref)
    assert new.attempt_id not in (None, ref.attempt_id)
    steps.submit(p, new)
    jobs = jobs_of(sim, ref.task_id)
    assert len(jobs) == 2 and len({j["idempotency_key"] for j in jobs}) == 2, jobs


def replace_attempt(p, ref: AttemptRef) -> None:
    """The attempt is replaced (as by a requeue and a new claim): the task's token moves on."""
    with p.db.connection() as conn:
        conn.execute("update generation_task set current_fencing_token = nextval('fencing_token_seq') where task_id = %s",
                     (ref.task_id,))


@BROKEN
def test_fencing_a_stale_submit_answer(world, monkeypatch, broken):
    """The worker's attempt is replaced while its submit is on the wire (a pause past its lease):
    the provider's acceptance reaches a stale writer. Its write is refused and the job kept as an
    orphan of the replaced attempt, unless fencing is off: then the task moves on a stale token."""
    switch(monkeypatch, "fencing", broken)
    p, sim = world()
    ref = claim_one(p)
    prov = adapter(p, "provider-a")
    real_submit = prov.submit

    def submit_while_replaced(account, key, request):
        outcome = real_submit(account, key, request)
        replace_attempt(p, ref)
        return outcome

    monkeypatch.setattr(prov, "submit", submit_while_replaced)
    before = task_row(p, ref)
    out = steps.submit(p, ref)
    after, a = task_row(p, ref), attempt_row(p, ref.attempt_id)
    [job] = jobs_of(sim, ref.task_id)
    with p.db.connection() as conn:
        orphan = conn.execute("select reason from orphan_provider_job where provider_job_id = %s", (job["id"],)).fetchone()
    if not broken:
        assert out["outcome"] == "stale"
        assert (after["state"], after["version"]) == (before["state"], before["version"]) and a["provider_job_id"] is None
        assert orphan["reason"] == "STALE_SUBMIT"
    else:
        assert out["then"] == "check" and after["state"] in ("SUBMITTED", "RUNNING")
        assert after["current_fencing_token"] != ref.fencing_token and a["provider_job_id"] == job["id"]
        assert orphan is None


@BROKEN
def test_fencing_a_webhook_for_a_replaced_attempt(world, monkeypatch, broken):
    """A webhook for the job of a replaced attempt is refused (409), unless fencing is off."""
    switch(monkeypatch, "fencing", broken)
    p, sim = world()
    ref = claim_one(p)
    steps.submit(p, ref)
    job = _job_doc(p, sim, ref)
    replace_attempt(p, ref)
    headers, body = _webhook(p, sim, job, "succeeded")
    if not broken:
        with pytest.raises(callbacks.CallbackRefused):
            callbacks.receive(p, "provider-a", headers, body)
        assert task_row(p, ref)["state"] != "SUCCEEDED"
    else:
        assert callbacks.receive(p, "provider-a", headers, body).task_state == "SUCCEEDED"
        assert task_row(p, ref)["state"] == "SUCCEEDED"


@BROKEN
def test_rescuer_state_guard(world, monkeypatch, broken):
    """The lease scanner leaves a live attempt whose workflow holds its lease alone; without the
    guard it starts a second execution of it beside the live one."""
    switch(monkeypatch, "rescuer-state-guard", broken)
    p, sim = world()
    rec = recorder(p)
    ref = claim_one(p)
    assert steps.submit(p, ref)["then"] == "check"  # a live workflow, its lease just renewed
    a = attempt_row(p, ref.attempt_id)
    assert a["state"] in ("SUBMITTED", "RUNNING") and a["lease_until"] > p.clock.now()
    restart_expired(p)
    if not broken:
        assert restarts_of(rec, ref) == [] and attempt_row(p, ref.attempt_id)["recoveries"] == 0
    else:
        assert restarts_of(rec, ref) == [f"{ref.attempt_id}-r1"]
        assert attempt_row(p, ref.attempt_id)["recoveries"] == 1


@BROKEN
def test_webhook_dedupe(world, monkeypatch, broken):
    """A webhook delivered twice (one webhook-id) is applied once; the second copy is acknowledged
    as a duplicate. Without the dedupe each copy is applied."""
    switch(monkeypatch, "webhook-dedupe", broken)
    p, sim = world()
    ref = claim_one(p)
    steps.submit(p, ref)
    applied = []
    real_apply = callbacks.apply_job
    monkeypatch.setattr(callbacks, "apply_job", lambda *a, **kw: applied.append(kw["source"]) or real_apply(*a, **kw))
    headers, body = _webhook(p, sim, _job_doc(p, sim, ref), "running", webhook_id="msg_twice")
    assert callbacks.receive(p, "provider-a", headers, body).status == "applied"
    second = callbacks.receive(p, "provider-a", headers, body).status
    assert (second, len(applied)) == (("applied", 2) if broken else ("duplicate", 1))


def test_two_copies_of_a_webhook_arriving_together_are_applied_once(world):
    """Found by the chaos suite (its `webhooks` checker): both copies passed the receipt check
    before either committed, so both were applied and both answered "applied". A side transaction
    holds the task's row so that both copies are in flight at once; then it lets go."""
    p, sim = world()
    ref = claim_one(p)
    steps.submit(p, ref)
    headers, body = _webhook(p, sim, _job_doc(p, sim, ref), "running", webhook_id="msg_together")
    answers: list[str] = []
    with psycopg.connect(p.db.url, autocommit=False) as holder:
        holder.execute("select 1 from generation_task where task_id = %s for update", (ref.task_id,))
        copies = [threading.Thread(target=lambda: answers.append(callbacks.receive(p, "provider-a", headers, body).status))
                  for _ in range(2)]
        for t in copies:
            t.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # both copies wait (on the row, or on their twin)
            n = holder.execute("select count(*) from pg_stat_activity where wait_event_type = 'Lock' and datname = current_database()"
                               ).fetchone()[0]
            if n >= 2:
                break
        holder.rollback()
    for t in copies:
        t.join(10)
    assert sorted(answers) == ["applied", "duplicate"]


@BROKEN
def test_lease_scanner(world, monkeypatch, broken):
    """An attempt whose execution was lost (its lease expired) is restarted by the lease scanner;
    with the scanner off it is never resumed."""
    switch(monkeypatch, "lease-scanner", broken)
    p, sim = world()
    rec = recorder(p)
    ref = claim_one(p)
    with p.db.connection() as conn:
        conn.execute("update task_attempt set lease_until = now() - interval '1 second' where attempt_id = %s",
                     (ref.attempt_id,))
    n = restart_expired(p)
    if not broken:
        assert n >= 1 and restarts_of(rec, ref) == [f"{ref.attempt_id}-r1"]
    else:
        assert n == 0 and rec.started == []
        assert attempt_row(p, ref.attempt_id)["lease_until"] < p.clock.now()  # still lost


# --- failpoints ---------------------------------------------------------------------------------------

def test_after_claim_before_dispatch(world, monkeypatch):
    """The dispatch consumer dies between the claim's TaskDispatchRequested and the execution's
    start: nothing runs, the attempt keeps the claim's lease, and once it expires the lease scanner
    starts the execution (its restarts do not pass this failpoint)."""
    reached = arm(monkeypatch, "after-claim-before-dispatch")
    p, sim = world()
    rec = recorder(p)
    ref = claim_one(p)
    with pytest.raises(Crash):
        executions.start(p, ref)
    assert rec.started == [] and attempt_row(p, ref.attempt_id)["state"] == "DISPATCHING"
    with p.db.connection() as conn:
        conn.execute("update task_attempt set lease_until = now() - interval '1 second' where attempt_id = %s",
                     (ref.attempt_id,))
    restart_expired(p)
    assert restarts_of(rec, ref) == [f"{ref.attempt_id}-r1"]
    assert reached.count("after-claim-before-dispatch") == 1


def test_after_accept_before_record(world, monkeypatch):
    """The provider accepted the submit and the worker died before recording it: the job exists and
    the attempt says only that a send began. The restarted execution never resends: it looks the
    job up by its key and adopts it."""
    arm(monkeypatch, "after-accept-before-record")
    p, sim = world()
    ref = claim_one(p)
    with pytest.raises(Crash):
        steps.submit(p, ref)
    a = attempt_row(p, ref.attempt_id)
    assert a["state"] == "DISPATCHING" and a["submit_started_at"] is not None and a["provider_job_id"] is None
    [job] = jobs_of(sim, ref.task_id)
    out = drive(p, ref, until=("wait", "done", "manual_review"))  # begin -> submit: SUBMIT_UNKNOWN
    assert out["then"] == "resolve"
    out = steps.resolve(p, ref, out)
    assert out["then"] == "check" and attempt_row(p, ref.attempt_id)["provider_job_id"] == job["id"]
    [job] = jobs_of(sim, ref.task_id)
    assert job["submit_requests"] == 1  # never resent


def test_after_verify_before_apply(world, monkeypatch):
    """A webhook verified and not yet applied when the receiver dies: nothing of it is written (no
    receipt), so the provider's retry of the same webhook-id applies it. A bad signature never
    reaches the failpoint."""
    reached = arm(monkeypatch, "after-verify-before-apply")
    p, sim = world()
    ref = claim_one(p)
    steps.submit(p, ref)
    headers, body = _webhook(p, sim, _job_doc(p, sim, ref), "running", webhook_id="msg_crash")
    with pytest.raises(Unauthenticated):
        callbacks.receive(p, "provider-a", {**headers, "webhook-signature": "v1,AAAA"}, body)
    assert "after-verify-before-apply" not in reached
    before = task_row(p, ref)
    with pytest.raises(Crash):
        callbacks.receive(p, "provider-a", headers, body)
    assert reached.count("after-verify-before-apply") == 1
    with p.db.connection() as conn:
        assert conn.execute("select count(*) as n from webhook_receipt where webhook_id = 'msg_crash'").fetchone()["n"] == 0
    assert task_row(p, ref)["version"] == before["version"]
    monkeypatch.setattr(failpoints, "hit", lambda name: None)  # the restarted receiver
    assert callbacks.receive(p, "provider-a", headers, body).status == "applied"
    assert task_row(p, ref)["state"] == "RUNNING"
