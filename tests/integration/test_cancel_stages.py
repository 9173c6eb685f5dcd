"""Cancel at every stage that is not terminal (docs/tenant-api.md "POST .../cancel"), through the
real cancel, the real attempt steps (the attempt workflow's own functions), the lease scanner, the
local workflow runner with the project's workflow definition, and a provider simulator:

- PROVIDER_SUCCEEDED and MEDIA_PROCESSING are not terminal: a cancel answers 202 CANCEL_REQUESTED,
  the provider is asked, its job has already finished and keeps its result, and the task succeeds,
  is settled as its charge policy says for a success, and holds no reservation;
- MANUAL_REVIEW: the cancel reopens the ended attempt; the lease scanner restarts its workflow,
  which cancels the job at the provider, and the task ends CANCELLED with nothing reserved; when
  the provider cannot be asked, the task goes back to review, the cancel still recorded;
- terminal states, MEDIA_INGEST_FAILED included, still answer 409 TASK_TERMINAL;
- what the tenant sees of a provider's failure is a mapped code and message, never its raw text.

No code of the platform parks a task in PROVIDER_SUCCEEDED or MEDIA_PROCESSING yet (the lifecycle
finishes a success in one transaction); the tests put a task there by the task state machine's own
CAS, as a media stage would, and everything after that is the platform's."""
from __future__ import annotations

import json
import time

import pytest

from aivedio import tasks
from aivedio.admission.cancel import TaskTerminal, cancel
from aivedio.attempts import steps
from aivedio.attempts.lifecycle import AttemptRef
from aivedio.attempts.recovery import restart_expired
from aivedio.auth import Caller
from aivedio.billing.settlement import settle
from tests.admission_support import PRICE, new_tenant, serve
from tests.integration.test_attempt_steps import world
from tests.scheduler_support import UNCAPPED, claim_first, submit
from tests.waiting import wait_for

_ = serve, world  # fixtures, imported for the tests that request them
pytestmark = pytest.mark.xdist_group("attempts")


def claim_one(p) -> tuple[AttemptRef, Caller]:
    t = new_tenant(p, **UNCAPPED)
    return claim_first(p, t), t.caller


def task_row(p, ref: AttemptRef) -> dict:
    with p.db.connection() as conn:
        return conn.execute("select * from generation_task where task_id = %s", (ref.task_id,)).fetchone()


def attempt_row(p, ref: AttemptRef) -> dict:
    with p.db.connection() as conn:
        return conn.execute("select * from task_attempt where attempt_id = %s", (ref.attempt_id,)).fetchone()


def active_reservations(p, ref: AttemptRef) -> dict[str, int]:
    with p.db.connection() as conn:
        resources = conn.execute("select count(*) as n from resource_reservation where task_id = %s and state = 'ACTIVE'",
                                 (ref.task_id,)).fetchone()["n"]
        credit = conn.execute("select count(*) as n from credit_reservation where task_id = %s and state = 'ACTIVE'",
                              (ref.task_id,)).fetchone()["n"]
    return {"resources": resources, "credit": credit}


def terminal_event(p, ref: AttemptRef) -> dict:
    with p.db.connection() as conn:
        [ev] = conn.execute("""select event_id, event_type, payload from outbox_event where aggregate_id = %s
                                and event_type in ('TaskSucceeded', 'TaskFailed', 'TaskCancelled')""", (ref.task_id,)).fetchall()
    return ev


def settle_terminal(p, ref: AttemptRef):
    """What the settlement consumer does with the task's terminal event."""
    ev = terminal_event(p, ref)
    with p.db.connection() as conn:
        return settle(conn, ev["payload"], p.clock.now(), event_type=ev["event_type"], event_id=ev["event_id"])


def job_finished(sim, ref: AttemptRef) -> None:
    """Until the provider has finished the attempt's job (the simulator's own record of it)."""
    key = attempt_key(sim, ref)
    wait_for(lambda: any(j["idempotency_key"] == key and j["status"] in ("succeeded", "failed") for j in sim.truth["jobs"]))


def attempt_key(sim, ref: AttemptRef) -> str:
    return next(j["idempotency_key"] for j in sim.truth["jobs"] if j["client_request_id"] == str(ref.task_id))


def park(p, ref: AttemptRef, *path: str) -> None:
    """Move the task along `path` by the state machine's CAS, as a media stage would."""
    for to_state in path:
        t = task_row(p, ref)
        with p.db.connection() as conn:
            assert tasks.cas_transition(conn, tenant_id=ref.tenant_id, task_id=ref.task_id, from_state=t["state"],
                                        version=t["version"], to_state=to_state, now=p.clock.now()) is not None


def run_workflow(p, ref: AttemptRef) -> list[dict]:
    """The lease scanner restarts the (reopened) attempt, and the local workflow runner runs the
    project's workflow definition with the real attempt_step core until it ends."""
    from aivedio_tools.local.workflow_runner import WorkflowRunner

    calls: list[dict] = []

    def attempt_step(payload: dict) -> dict:
        calls.append(payload)
        return steps.run_action(p, payload["action"], payload["attempt"], payload.get("step"))

    runner = WorkflowRunner(p.clock, {"local:attempt_step": attempt_step}).start()
    p.extras["workflow_runner"] = runner
    try:
        assert restart_expired(p) == 1  # the reopened attempt's lease has expired: its workflow starts again
        assert runner.run_until_idle(30)
    finally:
        runner.stop()
        p.extras.pop("workflow_runner", None)
    return calls


@pytest.mark.parametrize("stage", [("PROVIDER_SUCCEEDED",), ("PROVIDER_SUCCEEDED", "MEDIA_PROCESSING")],
                         ids=["provider-succeeded", "media-processing"])
def test_cancel_after_the_provider_succeeded_keeps_the_result(world, serve, stage):
    from aivedio.context import set_platform

    p, sim = world(latency_seconds_min=0.2, latency_seconds_max=0.2)
    ref, caller = claim_one(p)
    assert steps.submit(p, ref)["then"] == "check"
    job_finished(sim, ref)  # the job has finished at the provider
    park(p, ref, *stage)
    set_platform(p)
    try:
        api = serve(p)
        key = new_key(p, caller)
        r = api.http.post(f"/v1/generations/{ref.task_id}/cancel", headers={"Authorization": f"Bearer {key}"})
    finally:
        set_platform(None)
    assert r.status_code == 202 and r.json() == {"task_id": str(ref.task_id), "state": "CANCEL_REQUESTED"}, r.text
    t = task_row(p, ref)
    assert t["state"] == "CANCEL_REQUESTED" and t["cancel_requested_at"] is not None
    # The attempt's workflow is still running: its next poll routes to the cancel, which asks the
    # provider; the job already succeeded and keeps its result.
    assert steps.check(p, ref)["next"] == "cancel"
    assert steps.cancel(p, ref) == {"next": "done", "outcome": "succeeded"}
    t = task_row(p, ref)
    assert t["state"] == "SUCCEEDED" and t["finished_at"] is not None
    with p.db.connection() as conn:
        assert conn.execute("select count(*) as n from task_output where task_id = %s", (ref.task_id,)).fetchone()["n"] == 1
    ev = terminal_event(p, ref)
    assert ev["event_type"] == "TaskSucceeded" and ev["payload"]["stage"] == "PROVIDER_SUCCEEDED"
    assert active_reservations(p, ref)["resources"] == 0
    # Charged as the charge policy (SUCCESS_ONLY) says for a delivered video: the quote.
    settle_terminal(p, ref)
    assert active_reservations(p, ref) == {"resources": 0, "credit": 0}
    with p.db.connection() as conn:
        assert conn.execute("select final_charge_amount from generation_charge where task_id = %s",
                            (ref.task_id,)).fetchone()["final_charge_amount"] == PRICE
    assert sim.truth["jobs"][0]["status"] == "succeeded"
    # Once terminal, a cancel is refused.
    with pytest.raises(TaskTerminal):
        cancel(p, caller, ref.task_id)


def test_cancel_after_the_provider_succeeded_with_the_workflow_gone(world):
    """The attempt ended (its workflow is gone) while the task waited on media: the cancel reopens it,
    and the lease scanner's new execution finishes the task through the same cancel path."""
    p, sim = world(latency_seconds_min=0.2, latency_seconds_max=0.2)
    ref, caller = claim_one(p)
    steps.submit(p, ref)
    job_finished(sim, ref)
    park(p, ref, "PROVIDER_SUCCEEDED", "MEDIA_PROCESSING")
    with p.db.connection() as conn:
        conn.execute("update task_attempt set state = 'SUCCEEDED', lease_until = null where attempt_id = %s", (ref.attempt_id,))
    assert restart_expired(p) == 0  # nothing would ever look at it again
    assert cancel(p, caller, ref.task_id) == {"task_id": str(ref.task_id), "state": "CANCEL_REQUESTED"}
    a = attempt_row(p, ref)
    assert a["state"] in ("SUBMITTED", "RUNNING") and a["lease_until"] <= p.clock.now()
    calls = run_workflow(p, ref)
    assert [c["action"] for c in calls] == ["begin", "cancel", "finalize"]
    assert task_row(p, ref)["state"] == "SUCCEEDED"
    assert terminal_event(p, ref)["payload"]["stage"] == "PROVIDER_SUCCEEDED"
    settle_terminal(p, ref)
    assert active_reservations(p, ref) == {"resources": 0, "credit": 0}


def test_a_poll_finishes_a_task_a_media_stage_parked_after_the_providers_success(world):
    """Without a cancel, the lifecycle finishes such a task too: a succeeded poll moves it on from
    where it stands (PROVIDER_SUCCEEDED -> PROVIDER_SUCCEEDED is no transition)."""
    p, sim = world(latency_seconds_min=0.2, latency_seconds_max=0.2)
    ref, caller = claim_one(p)
    steps.submit(p, ref)
    job_finished(sim, ref)
    park(p, ref, "PROVIDER_SUCCEEDED")
    assert steps.check(p, ref) == {"next": "done", "outcome": "succeeded"}
    assert task_row(p, ref)["state"] == "SUCCEEDED"
    with p.db.connection() as conn:
        assert conn.execute("select count(*) as n from task_output where task_id = %s", (ref.task_id,)).fetchone()["n"] == 1
    assert active_reservations(p, ref)["resources"] == 0


def new_key(p, caller: Caller) -> str:
    from aivedio.auth import issue_key

    return p.db.transaction(lambda conn: issue_key(conn, caller.tenant_id, caller.user_id).secret)


def test_cancel_in_manual_review_goes_through_the_cancel_path_to_cancelled(world, serve):
    from aivedio.context import set_platform

    p, sim = world()  # the job runs for 30 s at the provider
    ref, caller = claim_one(p)
    steps.submit(p, ref)
    time.sleep(0.05)
    assert steps.to_manual_review(p, ref, "PROVIDER_LOST_JOB", "the provider answers 404 for the job")["next"] == "manual_review"
    assert task_row(p, ref)["state"] == "MANUAL_REVIEW"
    held = active_reservations(p, ref)
    assert held["resources"] > 0 and held["credit"] == 1  # review keeps them: the job may be live
    assert restart_expired(p) == 0  # and no workflow runs for it
    set_platform(p)
    try:
        api = serve(p)
        key = new_key(p, caller)
        r = api.http.post(f"/v1/generations/{ref.task_id}/cancel", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 202 and r.json()["state"] == "CANCEL_REQUESTED", r.text
        again = api.http.post(f"/v1/generations/{ref.task_id}/cancel", headers={"Authorization": f"Bearer {key}"})
        assert again.status_code == 202 and again.json()["state"] == "CANCEL_REQUESTED", again.text
    finally:
        set_platform(None)
    t, a = task_row(p, ref), attempt_row(p, ref)
    assert t["state"] == "CANCEL_REQUESTED" and t["cancel_requested_at"] is not None
    assert a["state"] in ("SUBMITTED", "RUNNING") and a["lease_until"] <= p.clock.now()  # reopened, lease expired
    calls = run_workflow(p, ref)
    assert [c["action"] for c in calls] == ["begin", "cancel", "finalize"]
    t = task_row(p, ref)
    assert t["state"] == "CANCELLED" and t["finished_at"] is not None
    ev = terminal_event(p, ref)
    assert ev["event_type"] == "TaskCancelled" and ev["payload"]["stage"] in ("PROVIDER_QUEUED", "PROVIDER_RUNNING")
    assert sim.truth["jobs"][0]["status"] == "cancelled"
    assert active_reservations(p, ref)["resources"] == 0
    settle_terminal(p, ref)
    assert active_reservations(p, ref) == {"resources": 0, "credit": 0}
    assert attempt_row(p, ref)["state"] == "CANCELLED" and attempt_row(p, ref)["lease_until"] is None


def test_cancel_in_manual_review_that_cannot_be_decided_goes_back_to_review(world):
    p, sim = world()
    ref, caller = claim_one(p)
    with p.db.connection() as conn:  # a send that may have left and died: nobody knows whether a job exists
        conn.execute("update task_attempt set submit_started_at = now() - interval '5 seconds' where attempt_id = %s",
                     (ref.attempt_id,))
    assert steps.submit(p, ref)["then"] == "resolve"
    sim.stop()  # the provider cannot be asked from now on
    with p.db.connection() as conn:
        conn.execute("update task_attempt set submit_started_at = now() - interval '700 seconds' where attempt_id = %s",
                     (ref.attempt_id,))
    assert steps.resolve(p, ref, {"errors": 3})["next"] == "manual_review"
    held = active_reservations(p, ref)
    assert held["resources"] > 0 and held["credit"] == 1
    assert cancel(p, caller, ref.task_id)["state"] == "CANCEL_REQUESTED"
    assert attempt_row(p, ref)["state"] == "SUBMIT_UNKNOWN"  # only a lookup by its key can decide
    calls = run_workflow(p, ref)
    assert [c["action"] for c in calls] == ["begin", "resolve", "finalize"]
    t = task_row(p, ref)
    # Still undecidable: a person decides, the cancel on record; the reservations stay for that review.
    assert t["state"] == "MANUAL_REVIEW" and t["cancel_requested_at"] is not None
    assert t["error_code"] == "SUBMIT_UNKNOWN_UNRESOLVED"
    assert attempt_row(p, ref)["state"] == "MANUAL_REVIEW"
    assert active_reservations(p, ref) == held


def test_terminal_states_still_answer_task_terminal(world):
    p, sim = world(latency_seconds_min=0.2, latency_seconds_max=0.2)

    def refused(ref: AttemptRef, caller: Caller) -> None:
        before = task_row(p, ref)
        with pytest.raises(TaskTerminal):
            cancel(p, caller, ref.task_id)
        after = task_row(p, ref)
        assert (after["state"], after["version"], after["cancel_requested_at"]) == (
            before["state"], before["version"], before["cancel_requested_at"])

    # MEDIA_INGEST_FAILED (the platform keeps no count of media retries: an ingest failure is final).
    ingest, caller = claim_one(p)
    steps.submit(p, ingest)
    park(p, ingest, "PROVIDER_SUCCEEDED", "MEDIA_INGEST_FAILED")
    refused(ingest, caller)
    # SUCCEEDED, through the real poll.
    ok, caller = claim_one(p)
    steps.submit(p, ok)
    job_finished(sim, ok)
    assert steps.check(p, ok)["outcome"] == "succeeded"
    refused(ok, caller)
    # CANCELLED, before the submit.
    gone, caller = claim_one(p)
    assert cancel(p, caller, gone.task_id)["state"] == "CANCEL_REQUESTED"
    assert steps.submit(p, gone)["outcome"] == "cancelled_before_submit"
    refused(gone, caller)


def test_the_tenant_sees_a_mapped_error_never_the_providers_text(world, serve):
    from aivedio.context import set_platform

    # Every job fails at the provider, with the provider's own code and words.
    p, sim = world(latency_seconds_min=0.2, latency_seconds_max=0.2, failure_rate=1.0)
    ref, caller = claim_one(p)
    steps.submit(p, ref)
    job_finished(sim, ref)
    assert steps.check(p, ref)["outcome"] == "failed"
    t, a = task_row(p, ref), attempt_row(p, ref)
    provider_error = a["raw_last_response"]["error"]
    assert t["state"] == "FAILED" and t["error_code"] == f"PROVIDER_{provider_error['code']}"
    assert a["error_code"] == t["error_code"]  # the attempt keeps the provider's code, and its answer
    set_platform(p)
    try:
        api = serve(p)
        key = new_key(p, caller)
        got = api.http.get(f"/v1/generations/{ref.task_id}", headers={"Authorization": f"Bearer {key}"})
        listed = api.http.get("/v1/generations", headers={"Authorization": f"Bearer {key}"})
    finally:
        set_platform(None)
    assert got.status_code == 200, got.text
    from aivedio.tenant_errors import TENANT_ERRORS

    mapped = {(code, message) for _, code, message in TENANT_ERRORS}
    error = got.json()["error"]
    assert (error["code"], error["message"]) in mapped and error["code"] in ("PROVIDER_FAILED", "CONTENT_FILTERED")
    [item] = [i for i in listed.json()["items"] if i["task_id"] == str(ref.task_id)]
    assert item["error"] == error
    assert provider_error["message"] not in got.text and provider_error["message"] not in listed.text
    if provider_error["code"] != error["code"]:  # CONTENT_FILTERED is also a tenant code of the table
        assert provider_error["code"] not in got.text and provider_error["code"] not in listed.text


def test_a_provider_rejection_is_shown_as_provider_rejected(world, serve):
    from aivedio.context import set_platform

    p, sim = world()
    ref, caller = claim_one(p)
    with p.db.connection() as conn:  # the provider does not offer the model: it rejects the submit with a 4xx
        conn.execute("update task_attempt set model_code = 'no-such-model' where attempt_id = %s", (ref.attempt_id,))
    assert steps.submit(p, ref)["outcome"] == "rejected"
    t, a = task_row(p, ref), attempt_row(p, ref)
    assert t["state"] == "FAILED" and t["error_code"].startswith("PROVIDER_REJECTED_")
    raw = a["raw_last_response"]["body"]  # the provider's own answer, kept on the attempt
    assert raw and t["error_message"] == raw[:500]
    set_platform(p)
    try:
        api = serve(p)
        got = api.http.get(f"/v1/generations/{ref.task_id}", headers={"Authorization": f"Bearer {new_key(p, caller)}"})
    finally:
        set_platform(None)
    assert got.status_code == 200, got.text
    assert got.json()["error"] == {"code": "PROVIDER_REJECTED", "message": "the video provider refused this request"}
    provider_error = json.loads(raw)["error"]
    for text in (raw, provider_error["code"], provider_error["message"]):
        assert text not in got.text


def test_the_mapping_table():
    from aivedio.tenant_errors import tenant_error

    assert tenant_error("FAILED", "PROVIDER_REJECTED_CONTENT_POLICY")["code"] == "PROVIDER_REJECTED"
    assert tenant_error("FAILED", "PROVIDER_CANCELLED")["code"] == "PROVIDER_FAILED"
    assert tenant_error("FAILED", "PROVIDER_TIMEOUT")["code"] == "TIMED_OUT"
    assert tenant_error("FAILED", None)["code"] == "GENERATION_FAILED"
    assert tenant_error("FAILED", "SOMETHING_INTERNAL")["code"] == "GENERATION_FAILED"
    assert tenant_error("CANCELLED", None)["code"] == tenant_error("CANCELLED", "CANCELLED_BY_USER")["code"] == "CANCELLED_BY_USER"
    assert tenant_error("MANUAL_REVIEW", "SUBMIT_UNKNOWN_UNRESOLVED")["code"] == "UNDER_REVIEW"
    assert tenant_error("MANUAL_REVIEW", "PROVIDER_LOST_JOB")["code"] == "UNDER_REVIEW"
    assert tenant_error("RUNNING", "PROVIDER_X") is None and tenant_error("SUCCEEDED", None) is None
