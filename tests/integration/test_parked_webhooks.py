"""Room service `parked-webhooks` (aivedio.reconcile.parked_webhooks), driven alone: a webhook that came
before its job was mapped is answered 202 parked, kept whole, and applied exactly once when the job is
mapped (by the workflow's lookup, or by this service's own lookups of the attempts in review); repeated
webhook-ids are one; an unmapped one is never dropped; batches cross their boundary."""
from __future__ import annotations

import pytest

from aivedio.attempts import callbacks, steps
from aivedio.reconcile import parked_webhooks, stuck_submits
from tests.review_support import (DROPPED_SEND, attempt, claim, fresh_db_url, into_review, job_doc, job_of, review_world,
                                  task, webhook)

_ = fresh_db_url, review_world  # fixtures: a database of each test's own, and the provider world
pytestmark = pytest.mark.xdist_group("attempts")
DONE = {"finished_at": "2026-01-01T00:00:30Z", "output_url": "http://example.invalid/out.mp4",
        "usage": {"seconds": 5, "cost_amount": "0.2500", "currency": "USD"}, "charge_id": "ch_parked"}


def parked(w, job_id: str) -> list[dict]:
    with w.p.db.connection() as conn:
        return conn.execute("select webhook_id, state, task_state, tries from parked_webhook where provider_job_id = %s "
                            "order by received_at, webhook_id", (job_id,)).fetchall()


def orphan(w, job_id: str) -> dict | None:
    with w.p.db.connection() as conn:
        return conn.execute("select reason, payload from orphan_provider_job where provider_job_id = %s", (job_id,)).fetchone()


def unknown_submit(w):
    """A claimed task whose submit created a job at the provider but whose answer was lost."""
    ref = claim(w, budget=False)
    out = steps.submit(w.p, ref)
    assert out["then"] == "resolve" and task(w, ref)["state"] == "SUBMIT_UNKNOWN"
    return ref, out


def test_a_webhook_before_the_mapping_is_parked_then_applied_once(review_world):
    w = review_world(**DROPPED_SEND)
    ref, out = unknown_submit(w)
    job = job_of(w, ref)
    headers, body = webhook(w, {**job_doc(job), **DONE}, "succeeded", webhook_id="msg_done")
    for _ in range(2):  # the provider's retry of the same webhook-id parks nothing more
        assert callbacks.receive(w.p, "provider-a", headers, body).status == "parked"
    assert [(r["webhook_id"], r["state"]) for r in parked(w, job["id"])] == [("msg_done", "PARKED")]
    assert orphan(w, job["id"])["reason"] == "UNMAPPED"
    r = parked_webhooks.run_once(w.p)  # not mapped yet, and no attempt in review to look up
    assert (r.repaired, r.details["parked"]) == (0, 1) and task(w, ref)["state"] == "SUBMIT_UNKNOWN"
    # The workflow's own lookup finds the job and maps it (the orphan record goes: the job has its attempt).
    assert steps.resolve(w.p, ref, out)["then"] == "check"
    assert orphan(w, job["id"]) is None and task(w, ref)["state"] in ("SUBMITTED", "RUNNING")
    r = parked_webhooks.run_once(w.p)
    assert (r.examined, r.repaired, r.details["applied"]) == (1, 1, 1)
    assert [(p["state"], p["task_state"]) for p in parked(w, job["id"])] == [("APPLIED", "SUCCEEDED")]
    assert task(w, ref)["state"] == "SUCCEEDED"
    with w.p.db.connection() as conn:
        [ev] = conn.execute("select payload from outbox_event where aggregate_id = %s and event_type = 'TaskSucceeded'",
                            (ref.task_id,)).fetchall()
    assert ev["payload"]["charge_id"] == "ch_parked"  # the parked document, whole
    assert parked_webhooks.run_once(w.p).examined == 0  # applied once
    assert callbacks.receive(w.p, "provider-a", headers, body).status == "duplicate"  # and received once


def test_a_copy_applied_after_the_mapping_makes_the_parked_one_a_duplicate(review_world):
    w = review_world(**DROPPED_SEND)
    ref, out = unknown_submit(w)
    job = job_of(w, ref)
    headers, body = webhook(w, {**job_doc(job), "status": "running"}, "running", webhook_id="msg_run")
    assert callbacks.receive(w.p, "provider-a", headers, body).status == "parked"
    steps.resolve(w.p, ref, out)
    assert callbacks.receive(w.p, "provider-a", headers, body).status == "applied"  # the provider's copy, now mapped
    version = task(w, ref)["version"]
    r = parked_webhooks.run_once(w.p)
    assert (r.examined, r.repaired, r.details["duplicate"]) == (1, 0, 1)
    assert [p["state"] for p in parked(w, job["id"])] == ["DUPLICATE"] and task(w, ref)["version"] == version


def test_the_job_of_a_task_in_review_is_matched_by_a_lookup_and_adopted(review_world):
    w = review_world(**DROPPED_SEND)
    ref = into_review(w, sent=True)  # its job exists; no attempt knows it
    job = job_of(w, ref)
    headers, body = webhook(w, {**job_doc(job), "status": "running"}, "running")
    assert callbacks.receive(w.p, "provider-a", headers, body).status == "parked"
    r = parked_webhooks.run_once(w.p)
    assert (r.details["lookup_adopted"], r.details["applied"], r.details["parked"]) == (1, 1, 0)
    a = attempt(w, ref.attempt_id)
    assert a["provider_job_id"] == job["id"] and a["state"] == "RUNNING" and task(w, ref)["state"] == "RUNNING"
    with w.p.db.connection() as conn:
        [entry] = conn.execute("select operator, action from audit_log where target = %s", (f"task:{ref.task_id}",)).fetchall()
    assert (entry["operator"], entry["action"]) == ("maintenance:parked-webhooks", "review.adopt")
    assert orphan(w, job["id"]) is None


def test_an_unmapped_webhook_is_never_dropped(review_world):
    w = review_world()
    job = {"id": "job_nobody_knows", "status": "succeeded", "created_at": "2026-01-01T00:00:00Z", **DONE}
    headers, body = webhook(w, job, "succeeded", webhook_id="msg_nobody")
    assert callbacks.receive(w.p, "provider-a", headers, body).status == "parked"
    r = parked_webhooks.run_once(w.p)
    assert (r.examined, r.repaired) == (1, 0)  # looked for, found nowhere
    assert parked_webhooks.run_once(w.p).examined == 0  # not again before retry_seconds
    w.clock.advance(parked_webhooks.DEFAULTS.age_seconds + 1)
    r = parked_webhooks.run_once(w.p)
    assert (r.examined, r.details["parked"], r.details["parked_past_age"]) == (0, 1, 1)  # no more lookups; still kept
    assert [p["state"] for p in parked(w, job["id"])] == ["PARKED"]
    o = orphan(w, job["id"])
    assert o["reason"] == "UNMAPPED" and o["payload"]["webhook_id"] == "msg_nobody"
    assert o["payload"]["job"]["charge_id"] == "ch_parked"  # what invoice reconciliation needs of it


def test_batches_cross_their_boundary(review_world):
    w = review_world(maintenance={"parked-webhooks": {"batch_size": 2}}, **DROPPED_SEND)
    refs = []
    for i in range(3):
        ref, out = unknown_submit(w)
        job = job_of(w, ref)
        headers, body = webhook(w, {**job_doc(job), "status": "running"}, "running", webhook_id=f"msg_{i}")
        assert callbacks.receive(w.p, "provider-a", headers, body).status == "parked"
        steps.resolve(w.p, ref, out)
        refs.append(ref)
    r = parked_webhooks.run_once(w.p)
    # One (empty) batch of lookups, then the mapped ones: 2 + 1.
    assert (r.examined, r.batches, r.complete, r.details["applied"]) == (3, 3, True, 3)
    assert {task(w, ref)["state"] for ref in refs} == {"RUNNING"}


def test_one_bad_lookup_does_not_stop_the_run(review_world, monkeypatch):
    w = review_world(**DROPPED_SEND)
    bad, good = into_review(w, sent=True), into_review(w, sent=True)  # two jobs no attempt knows, two attempts in review
    for ref in (bad, good):
        job = job_of(w, ref)
        headers, body = webhook(w, {**job_doc(job), "status": "running"}, "running")
        assert callbacks.receive(w.p, "provider-a", headers, body).status == "parked"
    real = stuck_submits.check

    def check(platform, a, **kw):
        if a["attempt_id"] == bad.attempt_id:
            raise RuntimeError("a row nobody expected")
        return real(platform, a, **kw)

    monkeypatch.setattr(stuck_submits, "check", check)
    r = parked_webhooks.run_once(w.p)
    assert (r.details["errors"], r.details["lookup_adopted"], r.details["applied"], r.details["parked"]) == (1, 1, 1, 1)
    assert task(w, good)["state"] == "RUNNING" and task(w, bad)["state"] == "MANUAL_REVIEW"
    monkeypatch.undo()
    w.clock.advance(parked_webhooks.DEFAULTS.retry_seconds + 1)
    r = parked_webhooks.run_once(w.p)  # tried again at its next due time
    assert (r.details["lookup_adopted"], r.details["applied"], r.details["parked"]) == (1, 1, 0)
    assert task(w, bad)["state"] == "RUNNING"
