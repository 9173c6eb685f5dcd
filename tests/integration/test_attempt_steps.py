"""Each branch of the attempt workflow, step by step, against a real provider simulator and the real
PostgreSQL: submit outcomes (accepted, 429, rejected, unknown), SUBMIT_UNKNOWN resolution (found,
absent, manual review), polling, callbacks (signature, dedupe, stale attempts, unknown jobs),
cancel after dispatch, and the fencing of a replaced attempt."""
from __future__ import annotations

import json
import time
import uuid
from datetime import timedelta

import httpx
import pytest

from aivedio.attempts import callbacks, steps
from aivedio.attempts.lifecycle import AttemptRef
from aivedio.bootstrap import apply_config
from aivedio.config import Limits, MediaConfig, PlatformConfig, ProviderAccount, ProviderConfig, SimulatorBehaviour, Timers
from aivedio.errors import Unauthenticated
from aivedio_tools.provider_sim import SimulatorServer
from aivedio.providers.webhooks import sign_webhook
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import new_tenant, serve  # noqa: F401 - serve is a fixture
from tests.scheduler_support import UNCAPPED, claim_first, index_queued, submit

pytestmark = pytest.mark.xdist_group("attempts")

SECRET = "whsec_c2ltdWxhdG9yLXNlY3JldA=="


def provider(**behaviour) -> ProviderConfig:
    sim = SimulatorBehaviour(**{"queue_seconds_min": 0, "queue_seconds_max": 0, "latency_seconds_min": 30,
                                "latency_seconds_max": 30, "failure_rate": 0.0, **behaviour})
    return ProviderConfig(name="provider-a", submit_timeout_seconds=0.5, webhook_secret=SECRET, simulator=sim,
                          accounts=[ProviderAccount(account_id="account-01", max_concurrency=20)])


@pytest.fixture
def world(make_platform):
    """world(**behaviour) -> (platform, simulator): a simulator with that behaviour and a platform
    whose provider entry points at it."""
    sims: list[SimulatorServer] = []

    def make(sim_provider: ProviderConfig | None = None, **behaviour):
        pc = sim_provider or provider(**behaviour)
        sim = SimulatorServer(pc, pc.simulator, 1.0, port=0).start()
        sims.append(sim)
        # The simulator's own entry holds the account keys and webhook secret it accepts (a built-in
        # simulator's credentials are random per entry): the platform's entry carries the same ones.
        platform_pc = provider(**behaviour).model_copy(update={"base_url": sim.base_url, "accounts": pc.accounts,
                                                               "webhook_secret": pc.webhook_secret})
        # The attempt workflow's own steps: a provider's success is the task's (the media pipeline,
        # which takes it on from PROVIDER_SUCCEEDED, has its tests in test_media_pipeline*.py).
        cfg = PlatformConfig(providers=[platform_pc],
                             timers=Timers(lease_seconds=60, unknown_safe_window_seconds=600),
                             limits=Limits(aimd_decrease_pct=50), media=MediaConfig(enabled=False))
        p = make_platform(cfg)
        with p.db.connection() as conn:
            apply_config(conn, p.config, p.clock)
        return p, sim

    yield make
    for s in sims:
        s.stop()


def claim_one(p) -> AttemptRef:
    return claim_first(p, new_tenant(p, **UNCAPPED))


def task_row(p, ref: AttemptRef) -> dict:
    with p.db.connection() as conn:
        return conn.execute("select * from generation_task where task_id = %s", (ref.task_id,)).fetchone()


def attempt_row(p, attempt_id) -> dict:
    with p.db.connection() as conn:
        return conn.execute("select * from task_attempt where attempt_id = %s", (attempt_id,)).fetchone()


def active_reservations(p, ref: AttemptRef) -> int:
    with p.db.connection() as conn:
        return conn.execute("select count(*) as n from resource_reservation where attempt_id = %s and state = 'ACTIVE'",
                            (ref.attempt_id,)).fetchone()["n"]


def events(p, ref: AttemptRef, event_type: str) -> list[dict]:
    with p.db.connection() as conn:
        return conn.execute("select payload from outbox_event where aggregate_id = %s and event_type = %s",
                            (ref.task_id, event_type)).fetchall()


def backdate_send(p, ref: AttemptRef, seconds: float) -> None:
    """As if an execution had started the submit `seconds` ago and died."""
    with p.db.connection() as conn:
        conn.execute("update task_attempt set submit_started_at = now() - make_interval(secs => %s) where attempt_id = %s",
                     (seconds, ref.attempt_id))


def test_accepted_then_polled_to_success(world):
    p, sim = world(latency_seconds_min=0.3, latency_seconds_max=0.3)
    ref = claim_one(p)
    out = steps.submit(p, ref)
    assert out["next"] == "wait" and out["then"] == "check"
    assert task_row(p, ref)["state"] in ("SUBMITTED", "RUNNING")
    assert attempt_row(p, ref.attempt_id)["provider_job_id"]
    time.sleep(0.6)
    out = steps.check(p, ref, out)
    assert out == {"next": "done", "outcome": "succeeded"}
    assert task_row(p, ref)["state"] == "SUCCEEDED"
    assert active_reservations(p, ref) == 0
    [ev] = events(p, ref, "TaskSucceeded")
    assert ev["payload"]["stage"] == "PROVIDER_SUCCEEDED" and ev["payload"]["usage"]["currency"] == "USD"
    # A repeated poll of a finished task changes nothing.
    assert steps.check(p, ref, out)["next"] == "done"
    assert len(events(p, ref, "TaskSucceeded")) == 1


def test_429_releases_requeues_with_backoff_and_lowers_the_account_limit(world):
    p, sim = world(burst_429_rate=1.0, burst_429_seconds=30)
    ref = claim_one(p)
    out = steps.submit(p, ref)
    assert out["outcome"] == "requeued" and out["retry_after_seconds"] >= 1
    t = task_row(p, ref)
    assert t["state"] == "QUEUED" and t["current_attempt_id"] is None
    assert t["next_eligible_at"] > p.clock.now()
    assert attempt_row(p, ref.attempt_id)["state"] == "NOT_ACCEPTED"
    assert active_reservations(p, ref) == 0
    with p.db.connection() as conn:
        lim = conn.execute("""select sum(coalesce(limit_units, capacity_units)) as eff from resource_pool_shard
                               where resource_key = 'provider-account:provider-a:account-01'""").fetchone()["eff"]
    assert lim == 10  # 20 x 50%
    # The same burst refuses the next submit too: the limit is cut once per cooldown, not per 429.
    other = claim_one(p)
    assert steps.submit(p, other)["outcome"] == "requeued"
    with p.db.connection() as conn:
        assert conn.execute("""select sum(coalesce(limit_units, capacity_units)) as eff from resource_pool_shard
                                where resource_key = 'provider-account:provider-a:account-01'""").fetchone()["eff"] == 10
    [ev] = events(p, ref, "TaskQueued")[1:]  # admission's, then the requeue's
    assert ev["payload"]["requeued"] is True
    # The stale execution can do nothing more with the replaced attempt.
    assert steps.submit(p, ref)["outcome"] == "stale"
    assert len(sim.truth["jobs"]) == 0


def test_a_worker_stalled_past_the_submit_timeout_since_its_marker_does_not_send(world, monkeypatch):
    """A pause between the send marker and the send as long as a submit may take: a restarted
    execution may already be proving absence from the marker, so the request is not sent now; nothing
    was sent by anyone, so the task is requeued at once (a new attempt, a new key)."""
    from types import SimpleNamespace

    p, sim = world()
    ref = claim_one(p)
    timeout = p.config.providers[0].submit_timeout_seconds
    ticks = iter([0.0, timeout + 0.001])  # the marker, then the last check before the send
    monkeypatch.setattr(steps, "time", SimpleNamespace(monotonic=lambda: next(ticks)))
    out = steps.submit(p, ref)
    assert out["outcome"] == "requeued", out
    a = attempt_row(p, ref.attempt_id)
    assert (a["state"], a["final_reason"]) == ("NOT_ACCEPTED", "SEND_STALLED"), a
    assert task_row(p, ref)["state"] == "QUEUED" and active_reservations(p, ref) == 0
    assert sim.truth["jobs"] == [] and sim.truth["submits"].get("requests", 0) == 0


def test_rejection_fails_the_task_and_releases(world):
    p, sim = world(sim_provider=provider().model_copy(update={"models": ["some-other-model"]}))
    ref = claim_one(p)
    out = steps.submit(p, ref)
    assert out["outcome"] == "rejected"
    t = task_row(p, ref)
    assert t["state"] == "FAILED" and t["error_code"] == "PROVIDER_REJECTED_UNSUPPORTED_MODEL"
    assert active_reservations(p, ref) == 0
    [ev] = events(p, ref, "TaskFailed")
    assert ev["payload"]["stage"] == "SUBMIT_REJECTED" and ev["payload"]["provider_charged"] is False


def test_accept_then_timeout_is_unknown_then_found_by_key(world):
    p, sim = world(accept_then_timeout_rate=1.0, accept_then_timeout_mode="drop")
    ref = claim_one(p)
    out = steps.submit(p, ref)
    assert out == {"next": "wait", "then": "resolve", "wait_seconds": 5}
    assert task_row(p, ref)["state"] == "SUBMIT_UNKNOWN"
    assert active_reservations(p, ref) > 0  # kept while unknown
    # Its webhook overtakes the lookup: no attempt knows the job yet, so it is parked (202), kept
    # whole, until the job is mapped; the job is an UNMAPPED orphan meanwhile.
    job = sim.truth["jobs"][0]
    headers, body = _webhook(p, sim, {"id": job["id"], "status": "running", "created_at": job["created_at"]}, "running")
    assert callbacks.receive(p, "provider-a", headers, body).status == "parked"
    with p.db.connection() as conn:
        assert conn.execute("select reason from orphan_provider_job where provider_job_id = %s",
                            (job["id"],)).fetchone()["reason"] == "UNMAPPED"
    out = steps.resolve(p, ref, out)
    assert out["next"] == "wait" and out["then"] == "check"
    a = attempt_row(p, ref.attempt_id)
    assert a["state"] in ("SUBMITTED", "RUNNING") and a["provider_job_id"] == sim.truth["jobs"][0]["id"]
    assert task_row(p, ref)["state"] in ("SUBMITTED", "RUNNING")
    assert len(sim.truth["jobs"]) == 1 and sim.truth["jobs"][0]["submit_requests"] == 1  # never resubmitted
    with p.db.connection() as conn:
        assert conn.execute("select count(*) as n from orphan_provider_job where provider_job_id = %s",
                            (job["id"],)).fetchone()["n"] == 0
    # A repeated delivery of the parked webhook-id is applied now that the job is mapped.
    assert callbacks.receive(p, "provider-a", headers, body).status == "applied"


def test_absence_confirmed_requeues_and_a_new_attempt_fences_the_old_one(world):
    p, sim = world()
    ref = claim_one(p)
    # The first execution marked the send and died before the request left: nothing exists.
    backdate_send(p, ref, 5)
    out = steps.submit(p, ref)  # a restarted execution never resends: it asks
    assert out["then"] == "resolve" and task_row(p, ref)["state"] == "SUBMIT_UNKNOWN"
    out = steps.resolve(p, ref, out)
    assert out["outcome"] == "absent_confirmed"
    assert task_row(p, ref)["state"] == "QUEUED"
    assert attempt_row(p, ref.attempt_id)["state"] == "ABSENT_CONFIRMED"
    assert active_reservations(p, ref) == 0
    # A new attempt is claimed with a new fencing token; the old one's writes are refused.
    index_queued(p, ref.task_id)
    Scheduler(p).tick(5.0)
    t = task_row(p, ref)
    assert t["state"] == "DISPATCHING" and t["current_attempt_id"] != ref.attempt_id
    assert t["current_fencing_token"] > ref.fencing_token
    before = (t["state"], t["version"])
    for fn in (steps.submit, steps.check, steps.resolve, steps.cancel):
        assert fn(p, ref)["outcome"] == "stale"
    t = task_row(p, ref)
    assert (t["state"], t["version"]) == before
    new = AttemptRef(ref.tenant_id, ref.task_id, t["current_attempt_id"], t["current_fencing_token"])
    assert steps.submit(p, new)["then"] == "check"
    assert len(sim.truth["jobs"]) == 1


def test_unresolvable_unknown_goes_to_manual_review_and_keeps_reservations(world):
    p, sim = world()
    ref = claim_one(p)
    backdate_send(p, ref, 5)
    steps.submit(p, ref)
    sim.stop()  # lookups fail from now on
    backdate_send(p, ref, 700)  # past the safe window (600 s)
    out = steps.resolve(p, ref, {"errors": 3})
    assert out == {"next": "manual_review", "outcome": "submit_unknown_unresolved"}
    t = task_row(p, ref)
    assert t["state"] == "MANUAL_REVIEW" and t["error_code"] == "SUBMIT_UNKNOWN_UNRESOLVED"
    assert active_reservations(p, ref) > 0
    assert len(events(p, ref, "TaskNeedsReview")) == 1


def test_lookup_errors_back_off_inside_the_window(world):
    p, sim = world()
    ref = claim_one(p)
    backdate_send(p, ref, 5)
    steps.submit(p, ref)
    sim.stop()
    out = steps.resolve(p, ref, {"errors": 2})
    assert out["next"] == "wait" and out["then"] == "resolve" and out["errors"] == 3
    assert task_row(p, ref)["state"] == "SUBMIT_UNKNOWN"


def _webhook(p, sim, job: dict, status: str, *, webhook_id: str | None = None, secret: str = SECRET):
    body = json.dumps({"type": f"job.{status}", "data": {**job, "status": status}})
    headers = sign_webhook(secret, webhook_id or f"msg_{uuid.uuid4().hex}", int(time.time()), body)
    return headers, body


def _job_doc(p, sim, ref: AttemptRef) -> dict:
    job_id = attempt_row(p, ref.attempt_id)["provider_job_id"]
    return httpx.get(f"{sim.base_url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {p.config.providers[0].accounts[0].api_key}"}).json()


def test_callbacks_verify_dedupe_and_apply_like_polling(world):
    p, sim = world()
    ref = claim_one(p)
    steps.submit(p, ref)
    job = _job_doc(p, sim, ref)
    done = {**job, "finished_at": job["created_at"], "output_url": "http://example.invalid/out.mp4",
            "usage": {"seconds": 5, "cost_amount": "0.2500", "currency": "USD"}, "charge_id": "ch_1"}
    headers, body = _webhook(p, sim, done, "succeeded", webhook_id="msg_fixed")
    with pytest.raises(Unauthenticated):
        callbacks.receive(p, "provider-a", {**headers, "webhook-signature": "v1,AAAA"}, body)
    assert task_row(p, ref)["state"] != "SUCCEEDED"
    assert callbacks.receive(p, "provider-a", headers, body).status == "applied"
    assert task_row(p, ref)["state"] == "SUCCEEDED"
    assert callbacks.receive(p, "provider-a", headers, body).status == "duplicate"
    # Reordered: a late "running" for a finished task changes nothing.
    h2, b2 = _webhook(p, sim, job, "running")
    assert callbacks.receive(p, "provider-a", h2, b2).task_state == "SUCCEEDED"
    assert task_row(p, ref)["state"] == "SUCCEEDED"
    [ev] = events(p, ref, "TaskSucceeded")
    assert ev["payload"]["charge_id"] == "ch_1" and ev["payload"]["usage"]["cost_amount"] == "0.2500"


def test_callback_for_unknown_job_is_parked_and_kept_as_orphan(world):
    p, sim = world()
    headers, body = _webhook(p, sim, {"id": "job_nobody", "status": "succeeded", "created_at": "2026-01-01T00:00:00Z"},
                             "succeeded", webhook_id="msg_nobody")
    assert callbacks.receive(p, "provider-a", headers, body).status == "parked"
    assert callbacks.receive(p, "provider-a", headers, body).status == "parked"  # the provider's retry: one row
    with p.db.connection() as conn:
        row = conn.execute("select reason, payload from orphan_provider_job where provider_job_id = 'job_nobody'").fetchone()
        parked = conn.execute("select webhook_id, state, body from parked_webhook where provider_job_id = 'job_nobody'").fetchall()
    assert row["reason"] == "UNMAPPED" and row["payload"]["webhook_id"] == "msg_nobody"
    assert row["payload"]["job"]["status"] == "succeeded"
    assert [(r["webhook_id"], r["state"]) for r in parked] == [("msg_nobody", "PARKED")]
    assert parked[0]["body"] == json.loads(body)  # the verified body, whole


def test_callback_for_a_replaced_attempt_is_refused(world):
    p, sim = world()
    ref = claim_one(p)
    steps.submit(p, ref)
    job = _job_doc(p, sim, ref)
    # The attempt is replaced (an operator requeue, say): the token moves on.
    with p.db.connection() as conn:
        conn.execute("""update generation_task set current_fencing_token = nextval('fencing_token_seq')
                         where task_id = %s""", (ref.task_id,))
    before = task_row(p, ref)
    headers, body = _webhook(p, sim, job, "succeeded")
    with pytest.raises(callbacks.CallbackRefused) as e:
        callbacks.receive(p, "provider-a", headers, body)
    assert e.value.code == "STALE_ATTEMPT"
    after = task_row(p, ref)
    assert (after["state"], after["version"]) == (before["state"], before["version"])
    with p.db.connection() as conn:
        row = conn.execute("select reason, attempt_id from orphan_provider_job where provider_job_id = %s", (job["id"],)).fetchone()
    assert row["reason"] == "STALE_ATTEMPT" and row["attempt_id"] == ref.attempt_id


def test_callback_through_the_api_route(world, serve):
    p, sim = world()
    from aivedio.context import set_platform

    set_platform(p)
    try:
        api = serve(p)
        ref = claim_one(p)
        steps.submit(p, ref)
        job = _job_doc(p, sim, ref)
        headers, body = _webhook(p, sim, job, "running")
        r = api.http.post("/v1/providers/provider-a/callbacks", content=body, headers={**headers, "Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "applied" and task_row(p, ref)["state"] == "RUNNING"
        bad = api.http.post("/v1/providers/provider-a/callbacks", content=body,
                            headers={**headers, "webhook-signature": "v1,Zm9v", "Content-Type": "application/json"})
        assert bad.status_code == 401 and bad.json()["error"] == "UNAUTHENTICATED"
        nope = api.http.post("/v1/providers/nobody/callbacks", content=body, headers={**headers, "Content-Type": "application/json"})
        assert nope.status_code == 404
        unmapped = json.dumps({"type": "job.running", "data": {**job, "id": "job_not_yet_mapped"}})
        r = api.http.post("/v1/providers/provider-a/callbacks", content=unmapped,
                          headers={**sign_webhook(SECRET, "msg_unmapped", int(time.time()), unmapped),
                                   "Content-Type": "application/json"})
        assert r.status_code == 202 and r.json()["status"] == "parked", r.text
        garbled = '{"type": "job.exploded", "data": {}}'  # signed, but not a job event of the contract
        r = api.http.post("/v1/providers/provider-a/callbacks", content=garbled,
                          headers={**sign_webhook(SECRET, "msg_garbled", int(time.time()), garbled), "Content-Type": "application/json"})
        assert r.status_code == 422 and r.json()["error"] == "VALIDATION_ERROR"
        with p.db.connection() as conn:  # refused before anything was written
            assert conn.execute("select count(*) as n from webhook_receipt where webhook_id = 'msg_garbled'").fetchone()["n"] == 0
    finally:
        set_platform(None)


def test_cancel_after_dispatch_follows_the_provider_stage(world):
    from aivedio.admission.cancel import cancel
    from aivedio.auth import Caller

    p, sim = world(queue_seconds_min=0, queue_seconds_max=0)
    ref = claim_one(p)
    steps.submit(p, ref)
    time.sleep(0.05)
    with p.db.connection() as conn:
        user = conn.execute("select user_id from generation_task where task_id = %s", (ref.task_id,)).fetchone()["user_id"]
    assert cancel(p, Caller(ref.tenant_id, user, "OWNER"), ref.task_id)["state"] == "CANCEL_REQUESTED"
    assert steps.check(p, ref)["next"] == "cancel"  # a poll routes to the cancel
    out = steps.cancel(p, ref)
    assert out["next"] == "done"
    t = task_row(p, ref)
    assert t["state"] == "CANCELLED"
    [ev] = events(p, ref, "TaskCancelled")
    assert ev["payload"]["stage"] in ("PROVIDER_RUNNING", "PROVIDER_QUEUED")
    assert active_reservations(p, ref) == 0
    assert sim.truth["jobs"][0]["status"] == "cancelled"


def test_cancel_before_submit_sends_nothing(world):
    from aivedio.admission.cancel import cancel
    from aivedio.auth import Caller

    p, sim = world()
    ref = claim_one(p)
    with p.db.connection() as conn:
        user = conn.execute("select user_id from generation_task where task_id = %s", (ref.task_id,)).fetchone()["user_id"]
    assert cancel(p, Caller(ref.tenant_id, user, "OWNER"), ref.task_id)["state"] == "CANCEL_REQUESTED"
    assert steps.submit(p, ref)["outcome"] == "cancelled_before_submit"
    assert task_row(p, ref)["state"] == "CANCELLED"
    [ev] = events(p, ref, "TaskCancelled")
    assert ev["payload"]["stage"] == "BEFORE_SUBMIT"
    assert sim.truth["jobs"] == [] and active_reservations(p, ref) == 0


def test_lease_scanner_restarts_lost_executions_once(world):
    from aivedio.attempts.recovery import restart_expired
    from aivedio_tools.local.workflow_runner import WorkflowRunner

    p, sim = world()
    ref = claim_one(p)
    started = []
    runner = WorkflowRunner(p.clock, {"local:attempt_step": lambda payload: started.append(payload) or {"next": "done"}})
    p.extras["workflow_runner"] = runner.start()
    try:
        with p.db.connection() as conn:
            conn.execute("update task_attempt set lease_until = now() - interval '1 second' where attempt_id = %s",
                         (ref.attempt_id,))
        assert restart_expired(p) == 1
        assert restart_expired(p) == 0  # the lease was taken over
        assert runner.run_until_idle(5)
        assert started[0]["action"] == "begin" and started[0]["attempt"]["attempt_id"] == str(ref.attempt_id)
        assert attempt_row(p, ref.attempt_id)["recoveries"] == 1
    finally:
        runner.stop()
        p.extras.pop("workflow_runner", None)


def test_a_worker_that_stalls_before_sending_does_not_send_once_taken_over(world, monkeypatch):
    p, sim = world()
    ref = claim_one(p)
    real_request = steps._request
    nested = []

    def stall_then_request(platform, task, attempt):
        # While this worker stalls between marking the send and sending, the lease scanner's
        # execution takes the attempt over: it never resends, it marks the attempt unknown.
        if not nested:
            nested.append(steps.submit(p, ref))
        return real_request(platform, task, attempt)

    monkeypatch.setattr(steps, "_request", stall_then_request)
    assert steps.submit(p, ref) == {"next": "done", "outcome": "superseded"}
    assert nested[0]["then"] == "resolve" and task_row(p, ref)["state"] == "SUBMIT_UNKNOWN"
    assert sim.truth["jobs"] == []  # nothing was sent by either execution


def test_an_attempt_restarted_too_often_goes_to_manual_review(world):
    from aivedio.attempts.recovery import restart_expired

    p, sim = world()
    ref = claim_one(p)
    with p.db.connection() as conn:
        conn.execute("""update task_attempt set lease_until = now() - interval '1 second', recoveries = %s
                         where attempt_id = %s""", (p.config.limits.max_attempt_recoveries, ref.attempt_id))
    assert restart_expired(p) == 1
    t = task_row(p, ref)
    assert t["state"] == "MANUAL_REVIEW" and t["error_code"] == "RECOVERY_EXHAUSTED"
    assert attempt_row(p, ref.attempt_id)["state"] == "MANUAL_REVIEW"
    assert active_reservations(p, ref) > 0 and len(events(p, ref, "TaskNeedsReview")) == 1
    assert restart_expired(p) == 0
