"""The demo report's shares "while contended" (aivedio_tools.demo.report.contended_shares): each claim made
while two or more tenants had work waiting is divided by weight among the tenants waiting at that
moment (what they were entitled to), beside what each was given. Cumulative shares follow what was
submitted, so they cannot show the weights."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from aivedio_tools.demo.report import contended_shares, media_queue_items, task_queue_items

T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)


def at(s: float | None) -> datetime | None:
    return None if s is None else T0 + timedelta(seconds=s)


def _task(tid: str, tenant: str, created: float, claimed: float | None, *, units: int = 1, state: str = "SUCCEEDED",
          updated: float | None = None) -> dict:
    return {"task_id": tid, "tenant": tenant, "created_at": at(created), "claimed_at": at(claimed), "fairness_units": units,
            "state": state, "updated_at": at(updated if updated is not None else (claimed or created))}


def _tasks(tasks: list[dict]) -> list[dict]:
    return task_queue_items(tasks, lambda t: t["tenant"])


def test_claims_are_divided_by_weight_among_the_tenants_waiting_at_that_moment():
    tasks = [
        # a (weight 2): queued from 0, claimed at 1, 2, 3 and 10
        _task("a1", "a", 0, 1), _task("a2", "a", 0, 2), _task("a3", "a", 0, 3), _task("a4", "a", 0, 10),
        # b (weight 1): one 2-unit task waiting from 0 to 2.5, then one from 9 to 12
        _task("b1", "b", 0, 2.5, units=2), _task("b2", "b", 9, 12),
    ]
    doc = contended_shares(_tasks(tasks), {"a": 2, "b": 1})
    # Contended claims: a1 at 1 and a2 at 2 (b1 waiting), b1 at 2.5 (a3, a4 waiting), a4 at 10 (b2
    # waiting). Not a3 at 3 (b had nothing waiting) nor b2 at 12 (a had nothing left).
    assert doc["claims_units"] == 5
    assert doc["delivered"] == {"a": 0.6, "b": 0.4}
    assert doc["entitled"] == {"a": pytest.approx(2 / 3, abs=1e-4), "b": pytest.approx(1 / 3, abs=1e-4)}
    assert doc["error"] == pytest.approx(0.0667, abs=1e-4)


def test_a_task_cancelled_while_queued_stops_counting_as_waiting():
    tasks = [_task("a1", "a", 0, 1), _task("a2", "a", 0, 5),
             _task("b1", "b", 0, None, state="CANCELLED", updated=3), _task("b2", "b", 4, 6)]
    doc = contended_shares(_tasks(tasks), {"a": 1, "b": 1})
    # At 1: b1 waits (cancelled at 3). At 5: b2 waits (from 4). At 6: a has nothing waiting.
    assert doc["claims_units"] == 2 and doc["delivered"] == {"a": 1.0, "b": 0.0}
    assert doc["entitled"] == {"a": 0.5, "b": 0.5}


def test_no_contended_claim_is_no_figure():
    tasks = [_task("a1", "a", 0, 1), _task("b1", "b", 2, 3)]
    assert contended_shares(_tasks(tasks), {"a": 1, "b": 1}) == {"claims_units": 0, "delivered": None, "entitled": None,
                                                                   "error": None}


def test_media_jobs_wait_from_the_provider_s_success_to_their_worker_slot():
    jobs = [{"task_id": "a1", "tenant": "a", "slot_units": 1, "created_at": at(0), "started_at": at(1), "finished_at": at(4)},
            {"task_id": "a2", "tenant": "a", "slot_units": 1, "created_at": at(0), "started_at": at(3), "finished_at": at(6)},
            {"task_id": "b1", "tenant": "b", "slot_units": 2, "created_at": at(0), "started_at": at(2), "finished_at": at(5)},
            {"task_id": "b2", "tenant": "b", "slot_units": 2, "created_at": at(0), "started_at": None, "finished_at": at(2.5)}]
    doc = contended_shares(media_queue_items(jobs, lambda j: j["tenant"]), {"a": 1, "b": 1})
    # At 1: a2, b1, b2 wait. At 2: a2 and b2 (until it ended at 2.5). At 3: b has nothing waiting.
    assert doc["claims_units"] == 3 and doc["delivered"] == {"a": 0.3333, "b": 0.6667}
    assert doc["entitled"] == {"a": 0.5, "b": 0.5}
