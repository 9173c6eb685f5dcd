"""Room service `stuck-submits` (aivedio.reconcile.stuck_submits), driven alone: attempts in
MANUAL_REVIEW whose submit stayed unknown keep being looked up by key, at the lower rate, and are
adopted when their job appears, requeued only when absence is proven, and left alone otherwise;
each run publishes the number of open reviews; batches cross their boundary."""
from __future__ import annotations

import pytest

from aivedio.attempts import review
from aivedio.observability import metrics
from aivedio.reconcile import room, stuck_submits
from tests.review_support import (DROPPED_SEND, attempt, fresh_db_url, held, into_review, job_of, restart, review_world,
                                  task)

_ = fresh_db_url, review_world  # fixtures: a database of each test's own, and the provider world
pytestmark = pytest.mark.xdist_group("attempts")
RETRY = stuck_submits.DEFAULTS.retry_seconds


def audit_actions(w, ref) -> list[tuple[str, str]]:
    with w.p.db.connection() as conn:
        return [(r["operator"], r["action"]) for r in conn.execute(
            "select operator, action from audit_log where tenant_id = %s and target = %s order by audit_id",
            (ref.tenant_id, f"task:{ref.task_id}")).fetchall()]


def test_lookups_keep_going_at_the_lower_rate_until_the_job_is_adopted(review_world):
    w = review_world(**DROPPED_SEND)  # the job exists at the provider; the platform never heard of it
    ref = into_review(w, sent=True)
    w.down()
    r = stuck_submits.run_once(w.p)
    assert (r.examined, r.repaired, r.details["lookup_failed"], r.details["open_reviews"]) == (1, 0, 1, 1)
    assert task(w, ref)["state"] == "MANUAL_REVIEW"
    checked = attempt(w, ref.attempt_id)["review_checked_at"]
    assert checked == w.clock.now() and attempt(w, ref.attempt_id)["review_checks"] == 1
    # Not asked again before retry_seconds (15 min), whatever the provider does meanwhile.
    w.up()
    for step in (0, RETRY - 1):
        w.clock.advance(step)
        assert stuck_submits.run_once(w.p).examined == 0
    assert task(w, ref)["state"] == "MANUAL_REVIEW"
    w.clock.advance(2)
    r = stuck_submits.run_once(w.p)
    assert (r.examined, r.repaired, r.details["adopted"], r.details["open_reviews"]) == (1, 1, 1, 0)
    a = attempt(w, ref.attempt_id)
    assert a["provider_job_id"] == job_of(w, ref)["id"] and a["state"] in ("SUBMITTED", "RUNNING")
    assert task(w, ref)["state"] in ("SUBMITTED", "RUNNING")
    assert audit_actions(w, ref) == [("maintenance:stuck-submits", "review.adopt")]  # the repair is on record
    assert len(restart(w)) == 1  # the lease scanner takes the adopted attempt's workflow over
    assert held(w, ref)["resources"] > 0  # live again: still holding what it runs on
    assert metrics.snapshot().get("ManualReviewOpen", 0) >= 1  # published on each run (a gauge)
    assert len(w.sim.truth["jobs"]) == 1 and w.sim.truth["jobs"][0]["submit_requests"] == 1  # never resubmitted


def test_requeued_only_on_proven_absence(review_world):
    # The provider keeps keys for 300 s only: past that, its empty answer proves nothing.
    w = review_world(idempotency_window_seconds=300)
    ref = into_review(w, sent=False)
    r = stuck_submits.run_once(w.p)
    assert (r.examined, r.repaired, r.details["still_unknown"]) == (1, 0, 1)
    w.clock.advance(RETRY + 1)
    assert stuck_submits.run_once(w.p).repaired == 0
    assert task(w, ref)["state"] == "MANUAL_REVIEW" and held(w, ref)["resources"] > 0


def test_proven_absence_requeues(review_world):
    w = review_world()  # a day's window: an empty answer 700 s after the send proves absence
    ref = into_review(w, sent=False)
    r = stuck_submits.run_once(w.p)
    assert (r.examined, r.repaired, r.details["requeued"]) == (1, 1, 1)
    assert task(w, ref)["state"] == "QUEUED" and attempt(w, ref.attempt_id)["state"] == "ABSENT_CONFIRMED"
    assert held(w, ref) == {"resources": 0, "credit": 1, "budget": 0}
    assert audit_actions(w, ref) == [("maintenance:stuck-submits", "review.requeue")]


def test_batches_cross_their_boundary(review_world):
    w = review_world(maintenance={"stuck-submits": {"batch_size": 2, "max_batches": 1}})
    refs = [into_review(w, sent=False) for _ in range(3)]
    r = room.run(w.p, "stuck-submits")
    assert (r.examined, r.batches, r.complete) == (2, 1, False)  # max_batches ran: the next run carries on
    r = stuck_submits.run_once(w.p)
    assert (r.examined, r.batches, r.complete) == (1, 1, True)
    assert {task(w, ref)["state"] for ref in refs} == {"QUEUED"}


def test_an_attempt_whose_provider_left_the_config_is_left_for_a_person(review_world):
    w = review_world()
    ref = into_review(w, sent=False)
    r = stuck_submits.run_once(w.without_provider())
    assert (r.examined, r.repaired, r.details["provider_unknown"]) == (1, 0, 1)
    assert task(w, ref)["state"] == "MANUAL_REVIEW" and attempt(w, ref.attempt_id)["review_checks"] == 1


def test_one_bad_attempt_does_not_stop_the_run(review_world, monkeypatch):
    w = review_world()
    bad, good = into_review(w, sent=False), into_review(w, sent=False)
    real = review.look

    def look(platform, a):
        if a["attempt_id"] == bad.attempt_id:
            raise RuntimeError("a row nobody expected")
        return real(platform, a)

    monkeypatch.setattr(review, "look", look)
    r = stuck_submits.run_once(w.p)
    assert (r.examined, r.repaired, r.details["errors"], r.details["requeued"]) == (2, 1, 1, 1)
    assert task(w, bad)["state"] == "MANUAL_REVIEW" and task(w, good)["state"] == "QUEUED"
    monkeypatch.undo()
    assert stuck_submits.run_once(w.p).examined == 0  # asked again at its next due time, not in a loop
    w.clock.advance(RETRY + 1)
    assert stuck_submits.run_once(w.p).details["requeued"] == 1
    assert task(w, bad)["state"] == "QUEUED"
