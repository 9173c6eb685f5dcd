"""Room service `unsettled-terminals` alone (ch. 20.7.5, 20.10.2 layer 2), on the real PostgreSQL: a
terminal task whose event never reached settlement is settled once from PostgreSQL's facts.

- an outbox row FAILED past outbox_max_attempts, and a TaskSucceeded marked PUBLISHED that never
  reached settlement (lost on purpose), both end with the task settled exactly once: one SETTLE in
  the ledger, the reservation closed, the credit it did not charge released; a task whose outbox
  row is gone is settled from the task and its attempt, with the payload lifecycle.finish wrote;
- nothing happens before the age; running again changes nothing; the dead letter, redriven and
  delivered to settlement afterwards, is a REPLAY;
- a parked provider cost of the task (orphan-jobs recorded a cost without a charge id, or one in
  another currency) does not hold its settlement back; parked settlement input does;
- batches: a small batch size crosses batch boundaries;
- `aivedio reconcile tasks --json` runs it and reports what is still unsettled or disagrees.
Each test gets a database of its own: the service scans every task."""
from __future__ import annotations

import json
from datetime import datetime

import pytest

from decimal import Decimal

from aivedio import outbox
from aivedio.spend import costs
from aivedio.spend import parked
from aivedio.billing.settlement import Usage, settle
from aivedio.config import Limits
from aivedio.reconcile import room
from aivedio.reconcile import unsettled_terminals as svc
from tests.billing_support import ADMIN, Cli, assert_invariants
from tests.conftest import create_test_database, drop_test_database
from tests.settle_support import claim, run_and_finish, start

pytestmark = pytest.mark.timeout(120)
MAX_ATTEMPTS = 2


@pytest.fixture
def db_url():
    url = create_test_database("unsettled")
    yield url
    drop_test_database(url)


def terminal_event(conn, task_id) -> dict:
    return conn.execute("""select event_id, event_type, status, attempts, payload from outbox_event
                            where aggregate_id = %s and event_type in ('TaskSucceeded', 'TaskFailed', 'TaskCancelled')""",
                        (task_id,)).fetchone()


def relay(p, conn, deliver, rounds: int = MAX_ATTEMPTS) -> None:
    """The relay, `rounds` times, each retry made due at once (its backoff is not under test)."""
    for _ in range(rounds):
        outbox.relay_once(p, deliver, batch=500)
        conn.execute("update outbox_event set next_retry_at = now() where status = 'PENDING'")


def ledger(conn, task_id) -> list[tuple[str, str]]:
    return [(r["event_type"], r["business_key"]) for r in conn.execute(
        "select event_type, business_key from ledger_transaction where task_id = %s order by created_at, business_key",
        (task_id,)).fetchall()]


def charge(conn, task_id) -> dict:
    return conn.execute("""select c.finalized_at, c.final_charge_amount, c.settled_outcome,
                                  r.reserved_amount - r.settled_amount - r.released_amount as still_reserved, r.state
                             from generation_charge c join credit_reservation r using (task_id) where c.task_id = %s""",
                        (task_id,)).fetchone()


def footprint(conn) -> dict:
    return {t: conn.execute(f"select count(*) as n from {t}").fetchone()["n"]
            for t in ("ledger_transaction", "ledger_entry", "provider_cost_event", "billing_parked_event", "outbox_event")} | {
        "wallets": [tuple(r.values()) for r in conn.execute(
            "select wallet_id, available_amount, reserved_amount, consumed_amount from wallet_account order by wallet_id")]}


def test_a_dead_letter_and_a_lost_message_still_settle_each_task_exactly_once(make_platform, conn):
    p = start(make_platform, limits=Limits(outbox_max_attempts=MAX_ATTEMPTS))
    dead, lost, gone = claim(p, 3)
    run_and_finish(p, dead)
    run_and_finish(p, lost)
    doc = run_and_finish(p, gone, "failed", charged=False, cost="0")
    gone_event = terminal_event(conn, gone.task_id)

    def deliver(envelope: dict) -> None:
        if envelope["aggregate_id"] == str(dead.task_id):
            raise ConnectionError("the settlement queue refused it")
        # every other event is "delivered": the lost one to nowhere (the consumer never sees it)

    relay(p, conn, deliver)
    assert terminal_event(conn, dead.task_id)["status"] == outbox.FAILED
    assert terminal_event(conn, dead.task_id)["attempts"] == MAX_ATTEMPTS
    assert terminal_event(conn, lost.task_id)["status"] == outbox.PUBLISHED
    conn.execute("delete from outbox_event where event_id = %s", (gone_event["event_id"],))  # purged, say
    for c in (dead, lost, gone):
        assert charge(conn, c.task_id)["finalized_at"] is None and charge(conn, c.task_id)["still_reserved"] == 70

    # The payload rebuilt from the task and its attempt is the one lifecycle.finish wrote.
    with p.db.connection() as c:
        task = c.execute("select * from generation_task where task_id = %s", (gone.task_id,)).fetchone()
        attempt = c.execute("select * from task_attempt where attempt_id = %s", (gone.attempt_id,)).fetchone()
    event_type, rebuilt = svc.terminal_payload(task, attempt)
    written = dict(gone_event["payload"])
    assert event_type == gone_event["event_type"] == "TaskFailed"
    assert datetime.fromisoformat(rebuilt.pop("finished_at")) == datetime.fromisoformat(written.pop("finished_at"))
    assert rebuilt == written and rebuilt["error_code"] == "PROVIDER_CONTENT_POLICY" and rebuilt["provider_job_id"] == doc["id"]

    # Within the age nothing is touched: the consumer may still be on its way.
    early = room.run(p, svc.NAME)
    assert (early.examined, early.repaired) == (0, 0)

    p.clock.advance(svc.DEFAULTS.age_seconds + 1)
    report = room.run(p, svc.NAME)
    assert report.complete and report.repaired == 3
    assert report.details["settled"] == 3
    assert (report.details["from_outbox"], report.details["from_facts"]) == (2, 1)
    assert (report.details["event_failed"], report.details["event_published"]) == (1, 1)
    for c, outcome, charged in ((dead, "SUCCEEDED/PROVIDER_SUCCEEDED", 70), (lost, "SUCCEEDED/PROVIDER_SUCCEEDED", 70),
                                (gone, "FAILED/PROVIDER_FAILED", 0)):
        ch = charge(conn, c.task_id)
        assert (ch["settled_outcome"], ch["final_charge_amount"], ch["still_reserved"]) == (outcome, charged, 0)
        settles = [k for t, k in ledger(conn, c.task_id) if t == "SETTLE"]
        assert settles == ([f"settle:generation:{c.task_id}:1"] if charged else [])
        if not charged:  # SUCCESS_ONLY: the failure's whole reservation goes back
            assert ("RELEASE", f"release:generation:{c.task_id}:SETTLED_FAILED") in ledger(conn, c.task_id)
    w = assert_invariants(conn, dead.wallet_id)
    assert (w["reserved_amount"], w["consumed_amount"]) == (0, 140)
    settled_events = conn.execute("select count(*) as n from outbox_event where event_type = 'TaskSettled'").fetchone()["n"]
    assert settled_events == 3

    # Again: nothing is unsettled, nothing changes; a task settled between the read and the
    # settlement (by its consumer, say) is a REPLAY.
    before = footprint(conn)
    again = room.run(p, svc.NAME)
    assert (again.examined, again.repaired) == (0, 0)
    with p.db.connection() as c:
        row = c.execute("select * from generation_task where task_id = %s", (dead.task_id,)).fetchone()
    assert svc.settle_one(p, row, terminal_event(conn, dead.task_id), p.clock.now()) == ("REPLAY", "outbox:FAILED")
    assert svc.settle_one(p, task, None, p.clock.now()) == ("REPLAY", "facts")
    assert footprint(conn) == before

    # The dead letter, redriven and delivered after all, and the lost message turning up: replays.
    with p.db.connection() as c:
        [row] = outbox.redrive(c, event_ids=[terminal_event(conn, dead.task_id)["event_id"]])
    assert row["attempts_before"] == MAX_ATTEMPTS
    outcomes = []

    def to_settlement(envelope: dict) -> None:
        if envelope["event_type"] in ("TaskSucceeded", "TaskFailed", "TaskCancelled"):
            with p.db.connection() as c:
                outcomes.append(settle(c, envelope["payload"], p.clock.now(), event_type=envelope["event_type"],
                                       event_id=envelope["event_id"]).outcome)

    outbox.relay_once(p, to_settlement, batch=500)
    lost_event = terminal_event(conn, lost.task_id)
    with p.db.connection() as c:
        outcomes.append(settle(c, lost_event["payload"], p.clock.now(), event_type=lost_event["event_type"],
                               event_id=lost_event["event_id"]).outcome)
    assert outcomes == ["REPLAY", "REPLAY"]
    after = footprint(conn)
    assert {k: v for k, v in after.items() if k != "outbox_event"} == {k: v for k, v in before.items() if k != "outbox_event"}


def test_a_parked_provider_cost_does_not_hold_the_settlement_back(make_platform, conn):
    p = start(make_platform)
    no_charge_id, other_currency, waiting = claim(p, 3)
    for c in (no_charge_id, other_currency, waiting):
        run_and_finish(p, c)
    outbox.relay_once(p, lambda envelope: None, batch=500)  # every event lost on its way to settlement

    def orphan_cost(c, currency: str, charge_id: str | None) -> str:
        """What orphan-jobs records for a job of the task's attempt (record_provider_cost, no event type)."""
        usage = Usage(seconds=Decimal(5), cost_amount=Decimal("0.25"), currency=currency)
        return p.db.transaction(lambda cx: costs.record_provider_cost(
            cx, payload={"orphan": "SECOND_JOB_FOR_KEY"}, state="SUCCEEDED", stage="PROVIDER_SUCCEEDED",
            tenant_id=c.ref.tenant_id, task_id=c.task_id, attempt_id=c.attempt_id, provider="provider-a",
            provider_account="account-01", provider_job_id=f"other-{c.task_id}", charge_id=charge_id,
            provider_charged=True, usage=usage, occurred_at=p.clock.now()).status)

    assert orphan_cost(no_charge_id, "USD", None) == "RECORDED"  # parks COST_WITHOUT_CHARGE_ID
    assert orphan_cost(other_currency, "USD", f"ch-x-{other_currency.task_id}") == "RECORDED"
    assert orphan_cost(other_currency, "EUR", f"ch-y-{other_currency.task_id}") == "PARKED"  # CURRENCY_MISMATCH
    # What settlement itself parks for a terminal event it cannot apply: that one waits.
    p.db.transaction(lambda cx: parked.park(cx, reason="UNKNOWN_OUTCOME", event_type="TaskSucceeded", payload={"x": 1},
                                            task_id=waiting.task_id, tenant_id=waiting.ref.tenant_id))
    reasons = {r["task_id"]: r["reason"] for r in conn.execute("select task_id, reason from billing_parked_event").fetchall()}
    assert reasons == {no_charge_id.task_id: "COST_WITHOUT_CHARGE_ID", other_currency.task_id: "CURRENCY_MISMATCH",
                       waiting.task_id: "UNKNOWN_OUTCOME"}

    p.clock.advance(svc.DEFAULTS.age_seconds + 1)
    report = room.run(p, svc.NAME)
    assert report.details["settled"] == 2 and report.details["parked_waiting"] == 1
    for c in (no_charge_id, other_currency):
        assert charge(conn, c.task_id)["settled_outcome"] == "SUCCEEDED/PROVIDER_SUCCEEDED"
        assert charge(conn, c.task_id)["still_reserved"] == 0
    assert charge(conn, waiting.task_id)["finalized_at"] is None


def test_batches_cross_their_boundary(make_platform, conn):
    p = start(make_platform, service=svc.NAME, batch_size=2)
    claimed = claim(p, 5)
    for c in claimed:
        run_and_finish(p, c)
    outbox.relay_once(p, lambda envelope: None, batch=500)  # every event "delivered", none reached settlement
    p.clock.advance(svc.DEFAULTS.age_seconds + 1)
    report = room.run(p, svc.NAME)
    assert report.batches == 3 and report.complete  # 2 + 2 + 1
    assert report.details["settled"] == 5 and report.examined == 5
    assert all(charge(conn, c.task_id)["finalized_at"] is not None for c in claimed)
    assert room.run(p, svc.NAME).examined == 0


def test_reconcile_tasks_as_a_user_types_it(make_platform, conn, db_url, monkeypatch, capsys):
    monkeypatch.setenv("AIVEDIO_DATABASE_URL", db_url)
    monkeypatch.setenv("AIVEDIO_REDIS_URL", "none")
    p = start(make_platform)
    settled_ok, lost, odd = claim(p, 3)
    for c in (settled_ok, lost, odd):
        run_and_finish(p, c)
    outbox.relay_once(p, lambda envelope: None, batch=500)
    with p.db.connection() as c:  # one is settled by its consumer as usual
        ev = terminal_event(conn, settled_ok.task_id)
        assert settle(c, ev["payload"], p.clock.now(), event_type=ev["event_type"], event_id=ev["event_id"]).outcome == "SETTLED"
    # One of them was parked by settlement (input it could not apply): it waits for that, not for us.
    conn.execute("""insert into billing_parked_event (dedupe_key, reason, event_type, task_id, tenant_id, payload)
                    values ('t', 'UNKNOWN_OUTCOME', 'TaskSucceeded', %s, %s, '{}')""", (odd.task_id, odd.ref.tenant_id))
    # A settled task whose ledger disagrees (a settle posting that lost its CONSUMED side, say).
    conn.execute("""update generation_charge set final_charge_amount = final_charge_amount + 1 where task_id = %s""",
                 (settled_ok.task_id,))
    cli = Cli(monkeypatch)

    def reconcile(operator: str) -> tuple[int, dict]:
        code = cli.main(["reconcile", "tasks", "--json", "--operator", operator, "--since-hours", "1000000"])
        return code, json.loads(capsys.readouterr().out)

    p.clock.advance(svc.DEFAULTS.age_seconds + 1)
    # The CLI's platform has its own clock (real time), so age the facts instead of its clock.
    conn.execute("update generation_task set finished_at = finished_at - interval '1 hour'")
    code, doc = reconcile(ADMIN)
    assert code == 0 and doc["run"]["details"]["settled"] == 1 and doc["run"]["details"]["parked_waiting"] == 1
    assert charge(conn, lost.task_id)["settled_outcome"] == "SUCCEEDED/PROVIDER_SUCCEEDED"
    assert [(u["task_id"], u["why"]) for u in doc["unsettled"]] == [(str(odd.task_id), "parked")]
    assert [d["task_id"] for d in doc["disagreements"]] == [str(settled_ok.task_id)]
    assert doc["disagreements"][0]["ledger_consumed"] == 70 and doc["disagreements"][0]["final_charge_amount"] == 71
    assert doc["clean"] is False
    audited = conn.execute("select operator, target from audit_log where action = 'maintenance.run'").fetchall()
    assert [(a["operator"], a["target"]) for a in audited] == [(ADMIN, "reconcile:tasks")]
