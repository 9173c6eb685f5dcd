"""Room service `expired-reservations` alone (ch. 20.7.9), on the real PostgreSQL:

- capacity a final attempt still holds past its lease is released when its task is terminal or has
  moved on (requeued), once: the counters drop by exactly its units, a second run changes nothing;
- an attempt that may be live at the provider (SUBMITTED, RUNNING, SUBMIT_UNKNOWN, DISPATCHING once
  sent, MANUAL_REVIEW, even under a terminal task) keeps everything, and is counted as
  live_left_alone; so do a never-sent DISPATCHING attempt, a final attempt whose task is still
  finishing, and a lease not yet past;
- credit a terminal and settled task still holds is released back to its lots; an unsettled
  terminal task, one with parked settlement input, and one with an attempt that may be live keep it;
  a parked provider cost of the task (COST_WITHOUT_CHARGE_ID, COST_MISMATCH) does not hold it back;
- batches: a small batch size crosses batch boundaries, and a bounded run carries on in the next;
  an attempt another transaction holds (SKIP LOCKED) still counts towards a full batch, so the
  attempts after it are scanned in the same run.
Each test gets a database of its own: the service scans every reservation."""
from __future__ import annotations

import uuid

import psycopg
import pytest

from aivedio.spend import parked
from aivedio.reconcile import expired_reservations as svc
from aivedio.reconcile import room
from aivedio.scheduling.resources import rebuild_counters, release_attempt
from tests.billing_support import assert_invariants, make_attempt, make_task, new_wallet
from tests.conftest import create_test_database, drop_test_database
from tests.settle_support import claim, start

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def db_url():
    url = create_test_database("expired_res")
    yield url
    drop_test_database(url)


def set_states(conn, c, *, attempt: str, task: str | None = None, sent: bool = False, current: bool = True,
               final_reason: str | None = None) -> None:
    """Put an attempt and its task where a crash (or a bug) between two writes would leave them:
    nothing is released here."""
    conn.execute("""update task_attempt set state = %s, submit_started_at = case when %s then now() end, final_reason = %s
                     where attempt_id = %s""", (attempt, sent, final_reason, c.attempt_id))
    if task is not None:
        conn.execute("""update generation_task set state = %s, finished_at = case when %s in ('SUCCEEDED', 'FAILED', 'CANCELLED')
                                                                          then now() end,
                               current_attempt_id = case when %s then current_attempt_id end,
                               current_fencing_token = case when %s then current_fencing_token end
                         where task_id = %s""", (task, task, current, current, c.task_id))


def active(conn, attempt_id) -> int:
    return conn.execute("select count(*) as n from resource_reservation where attempt_id = %s and state = 'ACTIVE'",
                        (attempt_id,)).fetchone()["n"]


def units(conn, attempt_id) -> int:
    return conn.execute("select coalesce(sum(reserved_units), 0)::bigint as u from resource_reservation where attempt_id = %s "
                        "and state = 'ACTIVE'", (attempt_id,)).fetchone()["u"]


def used_total(conn) -> int:
    return conn.execute("select coalesce(sum(used_units), 0)::bigint as u from resource_pool_shard").fetchone()["u"]


def past_every_lease(p) -> None:
    p.clock.advance(p.config.timers.lease_seconds + svc.DEFAULTS.age_seconds + 1)


def test_leaked_capacity_is_released_once_and_live_attempts_keep_theirs(make_platform, conn):
    p = start(make_platform)
    c = claim(p, 11)
    terminal, requeued = c[0], c[1]
    set_states(conn, terminal, attempt="FAILED", task="FAILED", final_reason="PROVIDER_FAILED")  # finish lost its release
    set_states(conn, requeued, attempt="NOT_ACCEPTED", task="QUEUED", current=False, final_reason="RATE_LIMITED")
    live = {"SUBMITTED": c[2], "RUNNING": c[3], "SUBMIT_UNKNOWN": c[4], "MANUAL_REVIEW": c[5]}
    for state, x in live.items():
        set_states(conn, x, attempt=state, task=state, sent=True)
    set_states(conn, c[6], attempt="DISPATCHING", sent=True)  # the submit may have reached the provider
    set_states(conn, c[7], attempt="SUBMIT_UNKNOWN", task="CANCELLED", sent=True)  # a terminal task is not enough
    set_states(conn, c[8], attempt="DISPATCHING")  # never sent: attempt-recovery restarts it
    set_states(conn, c[9], attempt="SUCCEEDED", task="PROVIDER_SUCCEEDED", final_reason="PROVIDER_SUCCEEDED")  # media stage
    not_yet = c[10]
    set_states(conn, not_yet, attempt="FAILED", task="FAILED", final_reason="PROVIDER_FAILED")
    conn.execute("update resource_reservation set lease_until = lease_until + interval '1 day' where attempt_id = %s",
                 (not_yet.attempt_id,))
    kept = [x for x in c if x not in (terminal, requeued)]
    leaked_units = units(conn, terminal.attempt_id) + units(conn, requeued.attempt_id)
    before = used_total(conn)
    assert leaked_units > 0

    # Before the lease (plus the grace) has passed, nothing is even looked at.
    early = room.run(p, svc.NAME)
    assert (early.examined, early.repaired) == (0, 0)

    past_every_lease(p)
    report = room.run(p, svc.NAME)
    assert report.complete
    assert report.details["attempts_released"] == 2 and report.repaired == 2
    assert report.details[svc.LIVE] == 6  # SUBMITTED, RUNNING, SUBMIT_UNKNOWN x2, MANUAL_REVIEW, DISPATCHING sent
    assert report.details[svc.NOT_FINAL] == 1 and report.details[svc.TASK_BUSY] == 1
    assert active(conn, terminal.attempt_id) == 0 and active(conn, requeued.attempt_id) == 0
    assert all(active(conn, x.attempt_id) > 0 for x in kept)
    # Decremented once, by exactly what was released: the counters equal the ACTIVE reservations.
    assert used_total(conn) == before - leaked_units
    assert rebuild_counters(conn) == 0

    # Released is released: the workflow's own release, and the service again, change nothing.
    assert release_attempt(conn, terminal.attempt_id, p.clock.now()) == []
    again = room.run(p, svc.NAME)
    assert again.details["attempts_released"] == 0 and again.details[svc.LIVE] == 6
    assert used_total(conn) == before - leaked_units


def test_credit_of_a_settled_terminal_task_is_released_and_unsettled_or_pending_credit_is_kept(make_platform, conn):
    p = start(make_platform)
    w = new_wallet(p, credits=1_000)
    now = p.clock.now()
    tasks = {}
    for name in ("settled", "cost_parked", "unsettled", "parked", "live"):
        tasks[name] = p.db.transaction(lambda c: make_task(c, w, now=now))
    for name, task_id in tasks.items():
        conn.execute("update generation_task set state = 'FAILED', finished_at = %s where task_id = %s", (now, task_id))
        if name != "unsettled":  # settlement finalized the snapshot but its release was lost
            conn.execute("""update generation_charge set finalized_at = %s, final_charge_amount = 0,
                                   settled_outcome = 'FAILED/PROVIDER_FAILED' where task_id = %s""", (now, task_id))
    p.db.transaction(lambda c: parked.park(c, reason="UNKNOWN_OUTCOME", event_type="TaskFailed",
                                           payload={"task_id": str(tasks["parked"])}, task_id=tasks["parked"],
                                           tenant_id=w.tenant_id))
    # The provider's cost of the task, parked (by orphan-jobs, or by settlement's cost recording):
    # about what the platform pays, not the user's charge, so it holds no credit back.
    for reason, event_type in (("COST_WITHOUT_CHARGE_ID", None), ("COST_MISMATCH", "TaskFailed")):
        p.db.transaction(lambda c, reason=reason, event_type=event_type: parked.park(
            c, reason=reason, event_type=event_type, payload={"cost": reason}, task_id=tasks["cost_parked"],
            tenant_id=w.tenant_id))
    attempt = p.db.transaction(lambda c: make_attempt(c, w, tasks["live"]))
    conn.execute("update task_attempt set state = 'SUBMIT_UNKNOWN', submit_started_at = now() where attempt_id = %s", (attempt,))
    reserved_before = conn.execute("select reserved_amount from wallet_account where wallet_id = %s",
                                   (w.wallet_id,)).fetchone()["reserved_amount"]
    assert reserved_before == 5 * 70

    past_every_lease(p)
    report = room.run(p, svc.NAME)
    assert report.details["credit_released"] == 2 and report.details["credit_released_amount"] == 2 * 70
    assert report.details[svc.UNSETTLED] == 1 and report.details[svc.PENDING_EVENTS] == 1
    assert report.details[svc.CREDIT_LIVE] == 1
    released = conn.execute("""select business_key, reason_code from ledger_transaction
                                where task_id = %s and event_type = 'RELEASE'""", (tasks["settled"],)).fetchall()
    assert [(r["business_key"], r["reason_code"]) for r in released] == [
        (f"release:generation:{tasks['settled']}:{svc.RELEASE_REASON}", svc.RELEASE_REASON)]
    open_of = {name: conn.execute("""select reserved_amount - settled_amount - released_amount as o, state
                                       from credit_reservation where task_id = %s""", (t,)).fetchone()
               for name, t in tasks.items()}
    assert (open_of["settled"]["o"], open_of["settled"]["state"]) == (0, "RELEASED")
    assert (open_of["cost_parked"]["o"], open_of["cost_parked"]["state"]) == (0, "RELEASED")
    assert all(open_of[n]["o"] == 70 for n in ("unsettled", "parked", "live"))
    w_row = assert_invariants(conn, w.wallet_id)  # ledger, snapshot, lots and reservations still agree
    assert w_row["reserved_amount"] == 3 * 70

    again = room.run(p, svc.NAME)
    assert again.details["credit_released"] == 0
    assert conn.execute("select count(*) as n from ledger_transaction where task_id = %s and event_type = 'RELEASE'",
                        (tasks["settled"],)).fetchone()["n"] == 1


def test_batches_cross_their_boundary_and_a_bounded_run_carries_on(make_platform, conn):
    p = start(make_platform, service=svc.NAME, batch_size=2, max_batches=2)
    c = claim(p, 5)
    for x in c:  # requeued, each release lost (tasks not terminal: no credit to look at)
        set_states(conn, x, attempt="NOT_ACCEPTED", task="QUEUED", current=False, final_reason="RATE_LIMITED")
    past_every_lease(p)
    first = room.run(p, svc.NAME)
    assert first.details["attempts_released"] == 4 and not first.complete  # two full batches, then the bound
    assert sum(active(conn, x.attempt_id) == 0 for x in c) == 4
    second = room.run(p, svc.NAME)
    assert second.details["attempts_released"] == 1 and second.complete
    assert all(active(conn, x.attempt_id) == 0 for x in c)
    assert rebuild_counters(conn) == 0 and used_total(conn) == 0


def test_an_attempt_held_by_another_transaction_does_not_end_the_scan(make_platform, conn, db_url):
    p = start(make_platform, service=svc.NAME, batch_size=2)
    c = claim(p, 3)
    for x in c:
        set_states(conn, x, attempt="NOT_ACCEPTED", task="QUEUED", current=False, final_reason="RATE_LIMITED")
    past_every_lease(p)
    held = min(c, key=lambda x: x.attempt_id.bytes)  # the first of the first batch (PostgreSQL orders uuids bytewise)
    with psycopg.connect(db_url) as other:  # a finishing attempt's transaction, say
        other.execute("select 1 from task_attempt where attempt_id = %s for update", (held.attempt_id,))
        report = room.run(p, svc.NAME)
        # The first batch scanned two (one of them locked): full, so the third attempt is scanned too.
        assert report.details[svc.LOCKED] == 1 and report.details["attempts_released"] == 2
        assert report.batches == 2 + 1 and report.examined == 3 and report.complete  # then one of credit
        other.rollback()
    assert [active(conn, x.attempt_id) == 0 for x in c] == [x is not held for x in c]
    again = room.run(p, svc.NAME)  # the next run looks at it again
    assert again.details["attempts_released"] == 1 and all(active(conn, x.attempt_id) == 0 for x in c)


def test_the_verdicts_alone():
    a = uuid.uuid4()
    row = lambda **kw: {"attempt_id": a, "submit_started_at": None, "current_attempt_id": a, **kw}  # noqa: E731
    assert svc.capacity_verdict(row(attempt_state="RUNNING", task_state="FAILED")) == svc.LIVE
    assert svc.capacity_verdict(row(attempt_state="DISPATCHING", task_state="DISPATCHING", submit_started_at="t")) == svc.LIVE
    assert svc.capacity_verdict(row(attempt_state="MANUAL_REVIEW", task_state="CANCELLED")) == svc.LIVE
    assert svc.capacity_verdict(row(attempt_state="DISPATCHING", task_state="DISPATCHING")) == svc.NOT_FINAL
    assert svc.capacity_verdict(row(attempt_state="SOMETHING_NEW", task_state="FAILED")) == svc.NOT_FINAL
    assert svc.capacity_verdict(row(attempt_state="SUCCEEDED", task_state="MEDIA_PROCESSING")) == svc.TASK_BUSY
    assert svc.capacity_verdict(row(attempt_state="SUCCEEDED", task_state="SUCCEEDED")) == svc.RELEASE
    assert svc.capacity_verdict(row(attempt_state="ABSENT_CONFIRMED", task_state="QUEUED", current_attempt_id=None)) == svc.RELEASE
    credit = lambda **kw: {"attempt_may_be_live": False, "finalized_at": "t", "events_pending": False, **kw}  # noqa: E731
    assert svc.credit_verdict(credit()) == svc.RELEASE
    assert svc.credit_verdict(credit(finalized_at=None)) == svc.UNSETTLED
    assert svc.credit_verdict(credit(events_pending=True)) == svc.PENDING_EVENTS
    assert svc.credit_verdict(credit(attempt_may_be_live=True, finalized_at=None)) == svc.CREDIT_LIVE
