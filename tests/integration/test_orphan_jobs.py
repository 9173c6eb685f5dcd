"""Room service `orphan-jobs` (aivedio.reconcile.orphan_jobs), driven alone: provider jobs of replaced or
abandoned attempts are asked about at a low rate; a running one is cancelled, a finished one's cost is
recorded as a provider_cost_event of its attempt (source API), and the orphan is marked resolved, never
deleted; a job a webhook named before any attempt knew it is never cancelled; batches cross their
boundary."""
from __future__ import annotations

from decimal import Decimal

import pytest

from aivedio.attempts import callbacks, review, steps
from aivedio.providers.registry import adapter
from aivedio.attempts.lifecycle import load, requeue
from aivedio.reconcile import orphan_jobs
from tests.review_support import (DROPPED_SEND, OPERATOR, attempt, claim, fresh_db_url, into_review, job_doc, job_of,
                                  lost_job_review, orphans_of, review_world, webhook)
from tests.waiting import wait_for

_ = fresh_db_url, review_world  # fixtures: a database of each test's own, and the provider world
pytestmark = pytest.mark.xdist_group("attempts")
RETRY = orphan_jobs.DEFAULTS.retry_seconds


def orphan(w, job_id: str) -> dict:
    with w.p.db.connection() as conn:
        return conn.execute("select * from orphan_provider_job where provider_job_id = %s", (job_id,)).fetchone()


def costs(w, attempt_id) -> list[tuple[str, Decimal, str]]:
    with w.p.db.connection() as conn:
        return [(r["event_type"], r["amount"], r["source"]) for r in conn.execute(
            "select event_type, amount, source from provider_cost_event where attempt_id = %s order by occurred_at",
            (attempt_id,)).fetchall()]


def replaced_with_a_live_job(w, monkeypatch):
    """A late submit of a replaced attempt: while the request is on its way (the provider creates the
    job, its answer is lost), another execution confirms the absence and the task is queued again. The
    late submit's step looks its key up, finds the job and records it as a STALE_SUBMIT orphan; the
    process dies before it cancels it (so the job runs on, with nobody to collect it)."""
    ref = claim(w, budget=False)
    prov = adapter(w.p, "provider-a")
    real = prov.submit

    def replaced_meanwhile(*a, **kw):
        out = real(*a, **kw)

        def replace(conn):
            cur = load(conn, ref, lock=True)
            requeue(conn, cur, attempt_state="ABSENT_CONFIRMED", reason="SUBMIT_ABSENT_CONFIRMED", now=w.clock.now(),
                    eligible_at=w.clock.now())

        w.p.db.transaction(replace)
        return out

    monkeypatch.setattr(prov, "submit", replaced_meanwhile)
    monkeypatch.setattr(steps, "_cancel_orphan", lambda *a, **kw: None)
    assert steps.submit(w.p, ref)["outcome"] == "stale"
    monkeypatch.undo()
    job = job_of(w, ref)
    o = orphan(w, job["id"])
    assert (o["reason"], o["attempt_id"]) == ("STALE_SUBMIT", ref.attempt_id)
    return ref, job


def test_a_running_orphan_of_a_replaced_attempt_is_cancelled_and_its_fee_recorded(review_world, monkeypatch):
    w = review_world(**DROPPED_SEND)  # jobs run for 30 s
    ref, job = replaced_with_a_live_job(w, monkeypatch)
    wait_for(lambda: job_of(w, ref)["status"] == "running")
    r = orphan_jobs.run_once(w.p)
    assert (r.examined, r.repaired, r.details["cost_recorded"]) == (1, 1, 1)
    assert job_of(w, ref)["status"] == "cancelled"
    o = orphan(w, job["id"])  # resolved, kept
    assert (o["resolution"], o["last_status"], o["checks"]) == ("COST_RECORDED", "cancelled", 1) and o["resolved_at"]
    assert costs(w, ref.attempt_id) == [("CANCELLATION_FEE", Decimal("0.05"), "API")]
    assert attempt(w, ref.attempt_id)["actual_cost_amount"] == Decimal("0.05")
    w.clock.advance(RETRY + 1)
    assert orphan_jobs.run_once(w.p).examined == 0  # resolved: never asked again


def test_a_finished_orphan_is_costed_not_cancelled(review_world, monkeypatch):
    w = review_world(**DROPPED_SEND, latency_seconds_min=0.2, latency_seconds_max=0.2)
    ref, job = replaced_with_a_live_job(w, monkeypatch)
    wait_for(lambda: job_of(w, ref)["status"] == "succeeded")
    r = orphan_jobs.run_once(w.p)
    assert r.details == {"cost_recorded": 1}
    assert job_of(w, ref)["cancel_requested_at"] is None
    [(kind, amount, source)] = costs(w, ref.attempt_id)
    assert (kind, source) == ("GENERATION", "API") and amount == Decimal(job_of(w, ref)["usage"]["cost_amount"])


def test_the_job_of_a_task_failed_out_of_review_is_costed(review_world):
    w = review_world(**DROPPED_SEND)
    ref = into_review(w, sent=True)
    wait_for(lambda: job_of(w, ref)["status"] == "running")
    out = review.resolve(w.p, operator=OPERATOR, task_id=ref.task_id, action="fail", reason="give up")
    assert list(out["jobs"].values()) == ["cancel:cancelled"]
    r = orphan_jobs.run_once(w.p)
    assert r.details == {"cost_recorded": 1}
    assert costs(w, ref.attempt_id) == [("CANCELLATION_FEE", Decimal("0.05"), "API")]


def test_an_unmapped_job_is_left_to_the_parked_webhooks_then_read_never_cancelled(review_world):
    w = review_world(**DROPPED_SEND)
    ref = into_review(w, sent=True)  # in review: its job may still be adopted
    job = job_of(w, ref)
    headers, body = webhook(w, {**job_doc(job), "status": "running"}, "running")
    assert callbacks.receive(w.p, "provider-a", headers, body).status == "parked"
    assert orphan_jobs.run_once(w.p).examined == 0  # young: the parked-webhooks service's
    w.clock.advance(orphan_jobs.DEFAULTS.age_seconds + 1)
    r = orphan_jobs.run_once(w.p)
    assert (r.examined, r.repaired, r.details["running"]) == (1, 0, 1)
    assert job_of(w, ref)["cancel_requested_at"] is None  # never cancelled
    o = orphan(w, job["id"])
    assert o["resolved_at"] is None and o["last_status"] in ("queued", "running")
    w.down()
    w.clock.advance(RETRY + 1)
    assert orphan_jobs.run_once(w.p).details == {"provider_error": 1}
    assert orphan(w, job["id"])["resolved_at"] is None


def test_batches_cross_their_boundary(review_world, monkeypatch):
    w = review_world(maintenance={"orphan-jobs": {"batch_size": 2}}, **DROPPED_SEND, latency_seconds_min=0.2,
                     latency_seconds_max=0.2)
    replaced = [replaced_with_a_live_job(w, monkeypatch) for _ in range(3)]
    wait_for(lambda: all(job_of(w, ref)["status"] == "succeeded" for ref, _ in replaced))
    w.down()  # the provider cannot be asked: each orphan is tried once per run, in two batches
    r = orphan_jobs.run_once(w.p)
    assert (r.examined, r.batches, r.complete, r.repaired) == (3, 2, True, 0)
    w.up()
    assert orphan_jobs.run_once(w.p).examined == 0  # the lower rate, per orphan
    w.clock.advance(RETRY + 1)
    r = orphan_jobs.run_once(w.p)
    assert (r.examined, r.batches, r.repaired) == (3, 2, 3)
    assert all(orphan(w, job["id"])["resolution"] == "COST_RECORDED" for _, job in replaced)


def test_the_job_of_a_task_failed_while_the_provider_was_down_is_found_by_its_key_and_costed(review_world):
    w = review_world(**DROPPED_SEND)  # jobs run for 30 s
    ref = into_review(w, sent=True)
    w.down()
    out = review.resolve(w.p, operator=OPERATOR, task_id=ref.task_id, action="fail", reason="give up")
    [key_row] = out["orphans"]
    r = orphan_jobs.run_once(w.p)  # still down: asked again later
    assert r.details == {"provider_error": 1} and orphan(w, key_row)["resolved_at"] is None
    w.up()
    w.clock.advance(RETRY + 1)
    r = orphan_jobs.run_once(w.p)  # the key finds the job: it is the attempt's, kept under its own id
    job = job_of(w, ref)
    assert (r.details["job_found"], r.repaired) == (1, 1)
    k = orphan(w, key_row)
    assert (k["resolution"], k["payload"]["job_ids"]) == ("JOB_FOUND", [job["id"]])
    assert attempt(w, ref.attempt_id)["provider_job_id"] == job["id"]
    o = orphan(w, job["id"])
    assert (o["reason"], o["attempt_id"], o["resolved_at"]) == ("ABANDONED", ref.attempt_id, None)
    wait_for(lambda: job_of(w, ref)["status"] == "running")
    r = orphan_jobs.run_once(w.p)  # new, so due at once: cancelled and costed like any abandoned job
    assert r.details == {"cost_recorded": 1}
    assert job_of(w, ref)["status"] == "cancelled"
    assert costs(w, ref.attempt_id) == [("CANCELLATION_FEE", Decimal("0.05"), "API")]


def test_the_key_of_a_task_that_never_made_a_job_is_resolved_not_found(review_world):
    w = review_world()
    ref = into_review(w, sent=False)  # nothing reached the provider
    w.down()
    review.resolve(w.p, operator=OPERATOR, task_id=ref.task_id, action="fail", reason="give up")
    w.up()
    r = orphan_jobs.run_once(w.p)  # an empty answer inside the provider's window proves absence
    assert r.details == {"not_found": 1}
    [o] = orphans_of(w, ref.attempt_id)
    assert (o["resolution"], o["payload"]["lookup"]["absence_proven"]) == ("NOT_FOUND", True)


def test_a_lost_job_kept_by_a_confirmed_requeue_is_asked_about_then_resolved(review_world):
    w = review_world()
    ref = lost_job_review(w, "job_gone")
    review.resolve(w.p, operator=OPERATOR, task_id=ref.task_id, action="requeue", confirm_absent=True, reason="purged")
    assert orphan_jobs.run_once(w.p).details == {"not_found": 1}
    assert orphan(w, "job_gone")["resolution"] == "NOT_FOUND"


def test_an_outage_of_every_account_proves_nothing(review_world):
    w = review_world(accounts=2)
    job = {"id": "job_nobody_knows", "status": "succeeded", "created_at": "2026-01-01T00:00:00Z"}
    headers, body = webhook(w, job, "succeeded")
    assert callbacks.receive(w.p, "provider-a", headers, body).status == "parked"  # UNMAPPED: no account recorded
    w.clock.advance(orphan_jobs.DEFAULTS.age_seconds + 1)
    w.down()  # both accounts answer with errors
    assert orphan_jobs.run_once(w.p).details == {"provider_error": 1}
    o = orphan(w, job["id"])
    assert o["resolved_at"] is None and (o["checks"], o["checked_at"]) == (1, w.clock.now())
    w.up()
    w.clock.advance(RETRY + 1)
    assert orphan_jobs.run_once(w.p).details == {"not_found": 1}  # every account answered 404
    o = orphan(w, job["id"])
    assert (o["resolution"], o["checks"]) == ("NOT_FOUND", 2)


def test_an_orphan_whose_provider_left_the_config_is_left_for_a_person(review_world, monkeypatch):
    w = review_world(**DROPPED_SEND, latency_seconds_min=0.2, latency_seconds_max=0.2)
    ref, job = replaced_with_a_live_job(w, monkeypatch)
    headers, body = webhook(w, {"id": "job_unmapped", "status": "succeeded", "created_at": "2026-01-01T00:00:00Z"},
                            "succeeded")
    assert callbacks.receive(w.p, "provider-a", headers, body).status == "parked"
    w.clock.advance(orphan_jobs.DEFAULTS.age_seconds + 1)
    r = orphan_jobs.run_once(w.without_provider())  # the run does not stop at either
    assert (r.examined, r.repaired, r.details) == (2, 0, {"provider_unknown": 2})
    assert orphan(w, job["id"])["resolved_at"] is None and orphan(w, "job_unmapped")["resolved_at"] is None
    wait_for(lambda: job_of(w, ref)["status"] == "succeeded")
    w.clock.advance(RETRY + 1)
    assert orphan_jobs.run_once(w.p).details == {"cost_recorded": 1, "not_found": 1}  # back in the config


def test_one_bad_orphan_does_not_stop_the_run(review_world, monkeypatch):
    w = review_world(**DROPPED_SEND, latency_seconds_min=0.2, latency_seconds_max=0.2)
    (bad, bad_job), (good, good_job) = [replaced_with_a_live_job(w, monkeypatch) for _ in range(2)]
    wait_for(lambda: all(job_of(w, ref)["status"] == "succeeded" for ref in (bad, good)))
    real = orphan_jobs.handle

    def handle(platform, row, now):
        if row["provider_job_id"] == bad_job["id"]:
            raise RuntimeError("a row nobody expected")
        return real(platform, row, now)

    monkeypatch.setattr(orphan_jobs, "handle", handle)
    r = orphan_jobs.run_once(w.p)
    assert (r.examined, r.repaired, r.details) == (2, 1, {"errors": 1, "cost_recorded": 1})
    assert orphan(w, bad_job["id"])["resolved_at"] is None and orphan(w, bad_job["id"])["checks"] == 1
    monkeypatch.undo()
    assert orphan_jobs.run_once(w.p).examined == 0  # retried at its next due time, not in a loop
    w.clock.advance(RETRY + 1)
    assert orphan_jobs.run_once(w.p).details == {"cost_recorded": 1}
