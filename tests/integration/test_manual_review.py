"""MANUAL_REVIEW has exits (issue 12): a task driven into review for real (its submit stayed unknown
and every lookup failed past the safe window, the provider simulator down meanwhile) is resolved by
each action of `aivedio admin review resolve` (aivedio.attempts.review): adopt, requeue with proof,
requeue with the operator's confirmation, fail. Afterwards the task holds nothing (capacity, credit,
budget) and its terminal event was settled exactly once. Every action is audited with its reason,
and refused without review.resolve, writing nothing."""
from __future__ import annotations

import json

import pytest

from aivedio.attempts import review
from aivedio.admin.operators import create_operator
from aivedio.context import set_platform
from aivedio_tools.local.apigw import to_event
from aivedio_tools.local.lambda_context import FakeLambdaContext
from functions.admin_api import handler as admin_api
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import PRICE
from tests.billing_support import NOBODY, Cli
from tests.review_support import (DROPPED_SEND, NOTHING, OPERATOR, SECRET, AttemptRef, attempt, finish_by_polling, held,
                                  into_review, job_of, lost_job_review, orphans_of, restart, review_world, settle_once, task)
from tests.scheduler_support import index_queued
from tests.waiting import wait_for

_ = review_world  # a fixture
pytestmark = pytest.mark.xdist_group("attempts")



def audits(w, ref) -> list[dict]:
    with w.p.db.connection() as conn:
        return conn.execute("""select operator, action, old_value, new_value, reason from audit_log
                                where tenant_id = %s and target = %s order by audit_id""",
                            (ref.tenant_id, f"task:{ref.task_id}")).fetchall()


def held_in_review(w, ref) -> dict:
    h = held(w, ref)
    assert h["resources"] > 0 and h["credit"] == 1 and h["budget"] > 0, h  # review keeps them: the job may be live
    return h


def resolve(w, ref, action, **kw):
    return review.resolve(w.p, operator=kw.pop("operator", OPERATOR), task_id=ref.task_id, action=action,
                          reason=kw.pop("reason", f"ticket OPS-1: {action}"), **kw)


def new_attempt(w, ref) -> AttemptRef:
    index_queued(w.p, ref.task_id)  # the requeue's TaskQueued, as the queue indexer takes it
    Scheduler(w.p).tick(5.0)
    t = task(w, ref)
    assert t["state"] == "DISPATCHING" and t["current_attempt_id"] != ref.attempt_id, t["state"]
    assert t["current_fencing_token"] > ref.fencing_token
    return AttemptRef(ref.tenant_id, ref.task_id, t["current_attempt_id"], t["current_fencing_token"])


def test_adopt_maps_the_job_and_the_workflow_goes_on_from_it(review_world):
    w = review_world(**DROPPED_SEND, latency_seconds_min=3, latency_seconds_max=3)
    ref = into_review(w, sent=True)
    held_in_review(w, ref)
    job = job_of(w, ref)
    # The job exists, so no requeue: the operator is told to adopt it (or fail the task).
    with pytest.raises(review.ReviewRefused) as e:
        resolve(w, ref, "requeue", confirm_absent=True)
    assert e.value.code == "JOB_EXISTS" and e.value.details["provider_job_id"] == job["id"]
    with pytest.raises(review.ReviewRefused) as e:
        resolve(w, ref, "adopt", provider_job_id="job_of_somebody_else")
    assert e.value.code == "JOB_NOT_FOUND"
    assert task(w, ref)["state"] == "MANUAL_REVIEW" and audits(w, ref) == []

    out = resolve(w, ref, "adopt", provider_job_id=job["id"], reason="seen running in the provider console")
    assert out["provider_job_id"] == job["id"] and out["task_state"] in ("SUBMITTED", "RUNNING")
    a = attempt(w, ref.attempt_id)
    assert a["state"] in ("SUBMITTED", "RUNNING") and a["provider_job_id"] == job["id"]
    assert a["lease_until"] <= w.clock.now()  # live, its lease expired: the lease scanner takes it
    [entry] = audits(w, ref)
    assert (entry["operator"], entry["action"]) == (OPERATOR, "review.adopt")
    assert entry["reason"] == "seen running in the provider console"
    assert entry["old_value"]["task_state"] == "MANUAL_REVIEW" and entry["new_value"]["task_state"] == out["task_state"]
    # No execution was started by the command; attempt-recovery starts one, which polls the job.
    [(name, doc)] = restart(w)
    assert doc["attempt"]["attempt_id"] == str(ref.attempt_id) and name.startswith(str(ref.attempt_id))
    assert restart(w) == []
    assert finish_by_polling(w, ref) == {"next": "done", "outcome": "succeeded"}
    assert task(w, ref)["state"] == "SUCCEEDED" and len(w.sim.truth["jobs"]) == 1  # never resubmitted
    charge = settle_once(w, ref)
    assert (charge["event_type"], charge["final_charge_amount"]) == ("TaskSucceeded", PRICE)
    assert held(w, ref) == NOTHING


def test_adopt_of_a_finished_job_finishes_the_task(review_world):
    w = review_world(**DROPPED_SEND, latency_seconds_min=0.2, latency_seconds_max=0.2)
    ref = into_review(w, sent=True)
    wait_for(lambda: job_of(w, ref)["status"] == "succeeded")
    out = resolve(w, ref, "adopt", provider_job_id=job_of(w, ref)["id"])
    assert out["task_state"] == "SUCCEEDED" and out["outcome"] == "TERMINAL"
    assert attempt(w, ref.attempt_id)["lease_until"] is None and restart(w) == []  # nothing left to run
    assert held(w, ref)["resources"] == 0
    assert settle_once(w, ref)["final_charge_amount"] == PRICE
    assert held(w, ref) == NOTHING
    with pytest.raises(review.ReviewRefused) as e:  # resolved once: it is no longer in review
        resolve(w, ref, "fail")
    assert e.value.code == "TASK_NOT_IN_REVIEW"


def test_requeue_with_absence_proven_by_the_lookup(review_world):
    w = review_world(latency_seconds_min=0.2, latency_seconds_max=0.2)
    ref = into_review(w, sent=False)  # the request never left: the provider has no job for the key
    held_in_review(w, ref)
    out = resolve(w, ref, "requeue")  # the provider answers again: empty, inside its window (a day)
    assert out["proof"] == "LOOKUP_EMPTY_IN_WINDOW" and out["task_state"] == "QUEUED"
    assert attempt(w, ref.attempt_id)["state"] == "ABSENT_CONFIRMED"
    h = held(w, ref)
    assert h["resources"] == 0 and h["budget"] == 0 and h["credit"] == 1  # the credit waits for the next attempt
    [entry] = audits(w, ref)
    assert entry["action"] == "review.requeue" and entry["new_value"]["proof"] == "LOOKUP_EMPTY_IN_WINDOW"
    assert task(w, ref)["error_code"] is None
    new = new_attempt(w, ref)
    assert finish_requeued(w, new) == "SUCCEEDED"
    assert settle_once(w, ref)["final_charge_amount"] == PRICE
    assert held(w, ref) == NOTHING
    assert [j["idempotency_key"] for j in w.sim.truth["jobs"]] == [attempt(w, new.attempt_id)["provider_request_key"]]


def finish_requeued(w, new: AttemptRef) -> str:
    from aivedio.attempts import steps

    assert steps.submit(w.p, new)["then"] == "check"
    wait_for(lambda: job_of(w, new)["status"] == "succeeded")
    assert steps.check(w.p, new)["outcome"] == "succeeded"
    return task(w, new)["state"]


def test_requeue_unprovable_needs_the_operators_confirmation(review_world):
    # The provider forgets keys after 300 s: 700 s after the send, its empty answer proves nothing.
    w = review_world(latency_seconds_min=0.2, latency_seconds_max=0.2, idempotency_window_seconds=300)
    ref = into_review(w, sent=False)
    before = task(w, ref)
    with pytest.raises(review.ReviewRefused) as e:
        resolve(w, ref, "requeue")
    assert e.value.code == "ABSENCE_NOT_PROVEN" and e.value.details["idempotency_window_seconds"] == 300
    w.down()  # nor can a provider that does not answer prove anything
    with pytest.raises(review.ReviewRefused) as e:
        resolve(w, ref, "requeue")
    assert e.value.code == "ABSENCE_NOT_PROVEN" and "error" in e.value.details
    after = task(w, ref)
    assert (after["state"], after["version"]) == (before["state"], before["version"]) and audits(w, ref) == []
    out = resolve(w, ref, "requeue", confirm_absent=True, reason="provider support confirms no job for the key")
    w.up()
    assert out["proof"] == "OPERATOR_CONFIRMED" and out["task_state"] == "QUEUED"
    [entry] = audits(w, ref)
    assert entry["reason"] == "provider support confirms no job for the key"
    assert entry["new_value"]["proof"] == "OPERATOR_CONFIRMED" and "error" in entry["new_value"]["evidence"]
    new = new_attempt(w, ref)
    assert finish_requeued(w, new) == "SUCCEEDED"
    settle_once(w, ref)
    assert held(w, ref) == NOTHING


def test_fail_ends_the_task_releases_everything_and_stops_the_job(review_world):
    w = review_world(**DROPPED_SEND)  # the job runs for 30 s
    ref = into_review(w, sent=True)
    held_in_review(w, ref)
    job_id = job_of(w, ref)["id"]
    out = resolve(w, ref, "fail", reason="tenant asked us to give up")
    assert out["task_state"] == "FAILED" and out["jobs"] == {job_id: "cancel:cancelled"}
    t, a = task(w, ref), attempt(w, ref.attempt_id)
    assert t["error_code"] == review.FAILED_CODE and a["state"] == "FAILED" and a["provider_job_id"] == job_id
    assert job_of(w, ref)["status"] == "cancelled"
    assert held(w, ref)["resources"] == 0
    charge = settle_once(w, ref)  # released under the charge policy: ABANDONED charges nothing
    assert (charge["event_type"], charge["stage"], charge["final_charge_amount"]) == ("TaskFailed", "ABANDONED", 0)
    assert held(w, ref) == NOTHING
    with w.p.db.connection() as conn:
        orphan = conn.execute("select reason, attempt_id, resolved_at from orphan_provider_job where provider_job_id = %s",
                              (job_id,)).fetchone()
    assert orphan["reason"] == "ABANDONED" and orphan["attempt_id"] == ref.attempt_id and orphan["resolved_at"] is None
    [entry] = audits(w, ref)
    assert (entry["action"], entry["reason"], entry["new_value"]["task_state"]) == ("review.fail", "tenant asked us to give up",
                                                                                    "FAILED")


def _admin_api(p, method: str, path: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    set_platform(p)
    headers = [("Authorization", f"Bearer {token}")] + ([("Content-Type", "application/json")] if body is not None else [])
    raw = json.dumps(body).encode() if body is not None else b""
    resp = admin_api.lambda_handler(to_event(method, path, "", headers, raw), FakeLambdaContext("aivedio-admin-api"))
    return resp["statusCode"], json.loads(resp["body"]) if resp.get("body") else {}


def test_without_review_resolve_nothing_is_written(review_world):
    """Roles are the admin API's: a viewer's token reads the reviews and may not resolve one (403,
    the denial audited, the task untouched)."""
    w = review_world()
    ref = into_review(w, sent=False)
    before = task(w, ref)
    viewer = w.p.db.transaction(lambda c: create_operator(c, actor="test", name=f"viewer-{ref.task_id.hex[:6]}",
                                                          role="viewer"))
    status, doc = _admin_api(w.p, "POST", f"/admin/v1/reviews/{ref.task_id}/resolve", viewer.token,
                             {"action": "fail", "reason": "a reader tries"})
    assert (status, doc["error"]) == (403, "FORBIDDEN") and doc["details"]["permission"] == "review.resolve"
    after = task(w, ref)
    assert (after["state"], after["version"]) == (before["state"], before["version"]) and audits(w, ref) == []
    with w.p.db.connection() as conn:
        [denied] = conn.execute("select action from audit_log where operator = %s", (f"op:{viewer.name}",)).fetchall()
    assert denied["action"] == "review.resolve.denied"
    status, listed = _admin_api(w.p, "GET", "/admin/v1/reviews", viewer.token)
    assert status == 200 and str(ref.task_id) in [i["task_id"] for i in listed["items"]]
    with w.p.db.connection() as conn:
        listed = review.list_reviews(conn, operator=NOBODY, tenant_id=ref.tenant_id)  # the core checks no role
    assert [i["task_id"] for i in listed["items"]] == [str(ref.task_id)]
    assert listed["items"][0]["reason"] == "SUBMIT_UNKNOWN_UNRESOLVED"


def test_the_cli(review_world, db_url, monkeypatch, capsys, tmp_path):
    w = review_world()
    ref = into_review(w, sent=False)
    pc = w.p.config.providers[0]
    cfg = tmp_path / "aivedio.toml"
    cfg.write_text(f'[[providers]]\nname = "provider-a"\nbase_url = "{pc.base_url}"\nwebhook_secret = "{SECRET}"\n'
                   f'submit_timeout_seconds = 0.5\n[[providers.accounts]]\naccount_id = "account-01"\n'
                   f'api_key = "{pc.accounts[0].api_key}"\nmax_concurrency = 20\n')
    monkeypatch.setenv("AIVEDIO_DATABASE_URL", db_url)
    monkeypatch.setenv("AIVEDIO_REDIS_URL", "none")
    cli = Cli(monkeypatch)

    def run(*argv, operator=OPERATOR) -> tuple[int, dict]:
        code = cli.main(["admin", "review", *argv, "--operator", operator, "--config", str(cfg), "--json"])
        return code, json.loads(capsys.readouterr().out)

    code, doc = run("list", "--tenant-id", str(ref.tenant_id))
    assert code == 0 and [i["task_id"] for i in doc["items"]] == [str(ref.task_id)] and doc["open"] >= 1
    code, doc = run("show", "--task-id", str(ref.task_id), operator=NOBODY)  # the CLI is trusted: any name reads
    assert code == 0 and doc["task"]["state"] == "MANUAL_REVIEW" and doc["held"]["credit"] == 1
    assert len(doc["review_events"]) == 1 and doc["attempts"][0]["final_reason"] == "SUBMIT_UNKNOWN_UNRESOLVED"
    code, doc = run("resolve", "--task-id", str(ref.task_id), "--action", "adopt", "--reason", "x")
    assert (code, doc["error"]) == (1, "VALIDATION_ERROR")  # adopt names its job
    code, doc = run("resolve", "--task-id", str(ref.task_id), "--action", "fail", "--reason", "no provider record")
    assert code == 0 and doc["task_state"] == "FAILED" and doc["jobs"] == {}
    code, doc = run("show", "--task-id", str(ref.task_id))
    assert [a["action"] for a in doc["audit"]] == ["review.fail"] and doc["held"]["resources"] == 0
    settle_once(w, ref)
    assert held(w, ref) == NOTHING


def test_a_cancel_recorded_during_review_is_honoured_by_the_adoption(review_world):
    from aivedio.admission.cancel import cancel
    from aivedio.attempts import steps
    from aivedio.auth import Caller

    w = review_world(**DROPPED_SEND)  # the job runs for 30 s
    ref = into_review(w, sent=True)
    caller = Caller(ref.tenant_id, task(w, ref)["user_id"], "OWNER")
    assert cancel(w.p, caller, ref.task_id)["state"] == "CANCEL_REQUESTED"  # reopens the attempt: a lookup decides
    w.down()
    assert steps.resolve(w.p, ref, {"errors": 3})["next"] == "manual_review"  # it cannot: back to review
    w.up()
    t = task(w, ref)
    assert t["state"] == "MANUAL_REVIEW" and t["cancel_requested_at"] is not None
    out = resolve(w, ref, "adopt", provider_job_id=job_of(w, ref)["id"])
    assert out["task_state"] == "CANCEL_REQUESTED"
    assert len(restart(w)) == 1
    assert steps.begin(w.p, ref)["next"] == "cancel"  # the restarted workflow cancels the job at the provider
    assert steps.cancel(w.p, ref)["outcome"] == "cancelled"
    assert job_of(w, ref)["status"] == "cancelled"
    charge = settle_once(w, ref)
    assert charge["event_type"] == "TaskCancelled" and charge["stage"] in ("PROVIDER_QUEUED", "PROVIDER_RUNNING")
    assert held(w, ref) == NOTHING


def test_adopt_of_a_job_still_queued_at_the_provider(review_world):
    w = review_world(**DROPPED_SEND, queue_seconds_min=60, queue_seconds_max=60)
    ref = into_review(w, sent=True)
    assert job_of(w, ref)["status"] == "queued"
    out = resolve(w, ref, "adopt", provider_job_id=job_of(w, ref)["id"])
    assert (out["task_state"], out["attempt_state"]) == ("SUBMITTED", "SUBMITTED")
    assert [doc["attempt"]["attempt_id"] for _, doc in restart(w)] == [str(ref.attempt_id)]


def test_a_task_whose_provider_left_the_config_can_still_be_failed(review_world):
    w = review_world(**DROPPED_SEND)
    ref = into_review(w, sent=True)  # a job exists at the provider; nobody learnt its id
    gone = w.without_provider()  # provider-a was removed from the config meanwhile
    with pytest.raises(review.ReviewRefused) as e:  # nobody can ask it: no proof of absence
        review.resolve(gone, operator=OPERATOR, task_id=ref.task_id, action="requeue", reason="x")
    assert e.value.code == "ABSENCE_NOT_PROVEN" and e.value.details["provider_unknown"] is True
    with pytest.raises(review.ReviewRefused) as e:
        review.resolve(gone, operator=OPERATOR, task_id=ref.task_id, action="adopt", provider_job_id=job_of(w, ref)["id"],
                       reason="x")
    assert e.value.code == "PROVIDER_UNKNOWN"
    assert audits(w, ref) == []
    out = review.resolve(gone, operator=OPERATOR, task_id=ref.task_id, action="fail", reason="provider-a was retired")
    key = attempt(w, ref.attempt_id)["provider_request_key"]
    assert (out["task_state"], out["jobs"], out["orphans"]) == ("FAILED", {}, [f"key:{key}"])
    assert held(w, ref)["resources"] == 0
    # Nothing is forgotten: the job that may exist is kept by the attempt's key, attributed to it.
    [o] = orphans_of(w, ref.attempt_id)
    assert (o["reason"], o["provider_request_key"], o["resolved_at"]) == ("ABANDONED", key, None)
    assert o["payload"]["provider_unknown"] is True
    [entry] = audits(w, ref)
    assert entry["action"] == "review.fail" and entry["new_value"]["evidence"]["provider_unknown"] is True
    charge = settle_once(w, ref)
    assert (charge["stage"], charge["final_charge_amount"]) == ("ABANDONED", 0)
    assert held(w, ref) == NOTHING


def test_fail_while_the_provider_cannot_be_asked_keeps_the_key(review_world):
    w = review_world(**DROPPED_SEND)
    ref = into_review(w, sent=True)
    w.down()
    out = resolve(w, ref, "fail", reason="give up")
    w.up()
    key = attempt(w, ref.attempt_id)["provider_request_key"]
    assert (out["task_state"], out["jobs"], out["orphans"]) == ("FAILED", {}, [f"key:{key}"])
    [o] = orphans_of(w, ref.attempt_id)
    assert (o["reason"], o["provider_request_key"], o["provider_account"]) == ("ABANDONED", key, "account-01")
    assert held(w, ref)["resources"] == 0


def test_requeue_of_a_job_the_provider_lost_needs_confirmation_and_keeps_the_job(review_world):
    w = review_world()
    ref = lost_job_review(w, "job_the_provider_lost")  # 404 for the id; the key lookup answers empty, in its window
    before = task(w, ref)
    with pytest.raises(review.ReviewRefused) as e:
        resolve(w, ref, "requeue")
    assert e.value.code == "JOB_ID_KNOWN" and e.value.details["provider_job_id"] == "job_the_provider_lost"
    after = task(w, ref)
    assert (after["state"], after["version"]) == (before["state"], before["version"]) and audits(w, ref) == []
    out = resolve(w, ref, "requeue", confirm_absent=True, reason="provider support: the job was purged")
    assert (out["proof"], out["task_state"], out["orphans"]) == ("OPERATOR_CONFIRMED", "QUEUED", ["job_the_provider_lost"])
    [o] = orphans_of(w, ref.attempt_id)
    assert (o["provider_job_id"], o["reason"], o["resolved_at"]) == ("job_the_provider_lost", "ABANDONED", None)
    assert held(w, ref) == {"resources": 0, "credit": 1, "budget": 0}
    [entry] = audits(w, ref)
    assert entry["new_value"]["orphans"] == ["job_the_provider_lost"]
