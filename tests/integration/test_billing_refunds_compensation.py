"""Refunds and compensation as audited admin operations (issue 6, items 3 and "Bad input").

- a refund references the task's SETTLE (reversal_of), may be partial, returns each credit to the
  lot it was consumed from, and refunds never add up to more than was settled;
- a refund over the settled amount, of another tenant's task, of an unknown task, by an operator
  without the role, or on a frozen wallet raises a clear domain error and writes nothing;
- a refund before settlement waits in PENDING_SETTLEMENT and the settlement transaction applies it
  (or rejects it if the charge turned out smaller);
- the same request key never refunds twice;
- compensation needs a case id, a known reason code and evidence; at or below the threshold it is
  applied at once, above it two distinct approvers other than the requester are needed;
- every admin write leaves an audit_log row; the CLI prints the domain error and writes nothing."""
from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest

from aivedio.billing.compensation import approve_compensation, reject_compensation, request_compensation
from aivedio.billing.errors import (ApprovalRefused, CompensationInvalid, RefundExceedsSettled,
                                    RefundTenantMismatch, TaskNotFound, WalletFrozen)
from aivedio.billing.refunds import request_refund
from aivedio.billing.settlement import settle
from tests.billing_support import (ADMIN, APPROVER_1, APPROVER_2, SUPPORT, T0, Cli, add_lot, assert_invariants, footprint,
                                   make_task, new_wallet, terminal)

pytestmark = pytest.mark.timeout(120)
THRESHOLD = 500


@pytest.fixture
def p(make_platform):
    platform = make_platform(redis=False, pool_size=4)
    return platform


def settled_task(p, w, *, seconds="5", policy="USAGE_BASED"):
    task = p.db.transaction(lambda c: make_task(c, w, policy=policy))
    with p.db.connection() as c:
        s = settle(c, terminal(task, w.tenant_id, seconds=seconds), T0, event_type="TaskSucceeded", event_id=uuid.uuid4())
    return task, s


def refund(p, w, task, amount, *, operator=SUPPORT, key=None, tenant_id=None):
    return p.db.transaction(lambda c: request_refund(c, operator=operator, tenant_id=tenant_id or w.tenant_id, task_id=task,
                                                     amount=amount, reason="customer complaint", now=T0,
                                                     request_key=key or uuid.uuid4().hex))


def audit_actions(conn, tenant_id):
    return [r["action"] for r in conn.execute("select action from audit_log where tenant_id = %s order by audit_id", (tenant_id,))]


def test_partial_refunds_reference_the_settle_and_never_exceed_it(p, conn):
    w = new_wallet(p, credits=1000)
    task, s = settled_task(p, w)  # 70 settled
    r1 = refund(p, w, task, 30)
    assert r1["state"] == "COMPLETED" and r1["settle_ledger_txn_id"] == str(s.settle_ledger_txn_id)
    txn = conn.execute("select * from ledger_transaction where ledger_txn_id = %s", (r1["refund_ledger_txn_id"],)).fetchone()
    assert txn["event_type"] == "REFUND" and txn["reversal_of"] == s.settle_ledger_txn_id
    assert txn["business_key"] == f"refund:generation:{task}:{r1['refund_id']}"
    w_row = assert_invariants(conn, w.wallet_id)
    assert (w_row["available_amount"], w_row["consumed_amount"]) == (960, 40)
    before = footprint(conn, w.tenant_id, w.wallet_id)
    with pytest.raises(RefundExceedsSettled) as e:
        refund(p, w, task, 41)  # 40 left
    assert e.value.code == "REFUND_EXCEEDS_SETTLED"
    assert footprint(conn, w.tenant_id, w.wallet_id) == before  # nothing written, not even an audit row
    refund(p, w, task, 40)
    res = conn.execute("select refunded_amount, state from credit_reservation where task_id = %s", (task,)).fetchone()
    assert (res["refunded_amount"], res["state"]) == (70, "REFUNDED")
    with pytest.raises(RefundExceedsSettled):
        refund(p, w, task, 1)
    assert_invariants(conn, w.wallet_id)
    assert audit_actions(conn, w.tenant_id).count("refund.apply") == 2


def test_a_refund_returns_credit_to_the_lot_it_was_consumed_from(p, conn):
    w = new_wallet(p, credits=0)
    promo = p.db.transaction(lambda c: add_lot(c, w, 50, kind="PROMOTIONAL", expires_at=T0 + timedelta(days=3)))
    paid = p.db.transaction(lambda c: add_lot(c, w, 100, kind="PAID"))
    task, s = settled_task(p, w)  # 50 from the promotional lot, 20 paid
    refund(p, w, task, 25)  # latest expiry first: the 20 paid, then 5 promotional
    lots = {r["lot_id"]: r for r in conn.execute("select * from credit_lot where wallet_id = %s", (w.wallet_id,))}
    assert lots[paid]["remaining_amount"] == 100 and lots[promo]["remaining_amount"] == 5
    assert lots[promo]["expires_at"] == T0 + timedelta(days=3)  # still promotional credit, still expiring
    assert_invariants(conn, w.wallet_id)


def test_bad_refunds_are_refused_and_write_nothing(p, conn):
    w = new_wallet(p, credits=1000)
    other = new_wallet(p, credits=1000)
    task, _ = settled_task(p, w)
    before = (footprint(conn, w.tenant_id, w.wallet_id), footprint(conn, other.tenant_id, other.wallet_id))
    with pytest.raises(RefundTenantMismatch):
        refund(p, w, task, 10, tenant_id=other.tenant_id)  # another tenant's task
    with pytest.raises(TaskNotFound):
        refund(p, w, uuid.uuid4(), 10)
    with pytest.raises(RefundExceedsSettled):
        refund(p, w, task, 71)
    from aivedio.errors import InvalidRequest
    with pytest.raises(InvalidRequest):
        refund(p, w, task, 0)
    conn.execute("update wallet_account set frozen = true, freeze_reason = 'test' where wallet_id = %s", (w.wallet_id,))
    with pytest.raises(WalletFrozen):
        refund(p, w, task, 10)
    conn.execute("update wallet_account set frozen = false, freeze_reason = null where wallet_id = %s", (w.wallet_id,))
    after = (footprint(conn, w.tenant_id, w.wallet_id), footprint(conn, other.tenant_id, other.wallet_id))
    for b, a in zip(before, after):
        b["wallet"].pop("version"), a["wallet"].pop("version")
    assert after == before


def test_the_same_request_key_never_refunds_twice(p, conn):
    w = new_wallet(p, credits=1000)
    task, _ = settled_task(p, w)
    a = refund(p, w, task, 10, key="ticket-1")
    b = refund(p, w, task, 10, key="ticket-1")
    assert b["replayed"] and b["refund_id"] == a["refund_id"]
    from aivedio.errors import Conflict
    with pytest.raises(Conflict):
        refund(p, w, task, 11, key="ticket-1")
    assert conn.execute("select count(*) as n from refund_request where task_id = %s", (task,)).fetchone()["n"] == 1


def test_a_refund_before_settlement_waits_and_the_settlement_applies_it(p, conn):
    w = new_wallet(p, credits=1000)
    task = p.db.transaction(lambda c: make_task(c, w, policy="USAGE_BASED"))
    early = refund(p, w, task, 20)
    assert early["state"] == "PENDING_SETTLEMENT" and early["refund_ledger_txn_id"] is None
    w_row = assert_invariants(conn, w.wallet_id)
    assert w_row["available_amount"] == 930  # nothing given back before the charge exists
    too_big = refund(p, w, task, 40)  # fits the reservation, not the charge that comes
    with pytest.raises(RefundExceedsSettled):
        refund(p, w, task, 11)  # 20 + 40 + 11 > 70 reserved: can never be covered
    with p.db.connection() as c:
        s = settle(c, terminal(task, w.tenant_id, seconds="3"), T0, event_type="TaskSucceeded", event_id=uuid.uuid4())
    assert (s.charged, s.refunds_applied, s.refunds_rejected) == (50, 1, 1)
    rows = {r["refund_id"]: r for r in conn.execute("select * from refund_request where task_id = %s", (task,))}
    applied, rejected = rows[uuid.UUID(early["refund_id"])], rows[uuid.UUID(too_big["refund_id"])]
    assert applied["state"] == "COMPLETED" and applied["settle_ledger_txn_id"] == s.settle_ledger_txn_id
    assert rejected["state"] == "REJECTED" and "not refundable" in rejected["rejected_reason"]
    w_row = assert_invariants(conn, w.wallet_id)
    assert (w_row["available_amount"], w_row["consumed_amount"]) == (970, 30)
    assert {"refund.request", "refund.apply", "refund.reject"} <= set(audit_actions(conn, w.tenant_id))


def compensate(p, w, amount, *, case_id="case-1", operator=SUPPORT, reason_code="SERVICE_OUTAGE", evidence=None, **kw):
    return p.db.transaction(lambda c: request_compensation(
        c, operator=operator, tenant_id=w.tenant_id, case_id=case_id, amount=amount, reason_code=reason_code,
        evidence={"ticket": "SUP-1"} if evidence is None else evidence, now=T0, dual_approval_above=THRESHOLD, **kw))


def approve(p, w, case_id, operator):
    return p.db.transaction(lambda c: approve_compensation(c, operator=operator, tenant_id=w.tenant_id, case_id=case_id, now=T0))


def test_compensation_without_case_id_reason_or_evidence_is_refused_and_writes_nothing(p, conn):
    w = new_wallet(p, credits=100)
    before = footprint(conn, w.tenant_id, w.wallet_id)
    for kw in ({"case_id": None}, {"case_id": "  "}, {"reason_code": "BECAUSE"}, {"evidence": {}}):
        with pytest.raises(CompensationInvalid) as e:
            compensate(p, w, 50, **kw)
        assert e.value.code == "COMPENSATION_INVALID" and e.value.fields
    assert footprint(conn, w.tenant_id, w.wallet_id) == before


def test_compensation_at_or_below_the_threshold_is_applied_as_a_new_lot(p, conn):
    w = new_wallet(p, credits=100)
    out = compensate(p, w, THRESHOLD, case_id="inc-7", expires_at=T0 + timedelta(days=90))
    assert out["state"] == "APPLIED" and out["required_approvals"] == 1
    txn = conn.execute("select * from ledger_transaction where ledger_txn_id = %s", (out["ledger_txn_id"],)).fetchone()
    assert txn["event_type"] == "COMPENSATE" and txn["business_key"] == "compensate:inc-7"
    lot = conn.execute("select * from credit_lot where source_business_key = 'compensate:inc-7'").fetchone()
    assert (lot["kind"], lot["remaining_amount"], lot["expires_at"]) == ("COMPENSATION", THRESHOLD, T0 + timedelta(days=90))
    again = compensate(p, w, THRESHOLD, case_id="inc-7", expires_at=T0 + timedelta(days=90))
    assert again["replayed"]
    w_row = assert_invariants(conn, w.wallet_id)
    assert w_row["available_amount"] == 100 + THRESHOLD
    assert audit_actions(conn, w.tenant_id)[-2:] == ["compensation.request", "compensation.apply"]


def test_compensation_above_the_threshold_needs_two_distinct_approvers(p, conn):
    w = new_wallet(p, credits=100)
    out = compensate(p, w, THRESHOLD + 1, case_id="inc-8", operator=ADMIN)
    assert (out["state"], out["required_approvals"]) == ("PENDING_APPROVAL", 2)
    assert assert_invariants(conn, w.wallet_id)["available_amount"] == 100
    with pytest.raises(ApprovalRefused):
        approve(p, w, "inc-8", ADMIN)  # the requester may not approve their own case
    assert approve(p, w, "inc-8", APPROVER_1)["state"] == "PENDING_APPROVAL"
    before = footprint(conn, w.tenant_id, w.wallet_id)
    with pytest.raises(ApprovalRefused):
        approve(p, w, "inc-8", APPROVER_1)  # the same approver twice is still one approver
    assert footprint(conn, w.tenant_id, w.wallet_id) == before
    done = approve(p, w, "inc-8", APPROVER_2)
    assert done["state"] == "APPLIED" and done["approvals"] == [APPROVER_1, APPROVER_2]
    assert assert_invariants(conn, w.wallet_id)["available_amount"] == 100 + THRESHOLD + 1
    with pytest.raises(ApprovalRefused):
        approve(p, w, "inc-8", ADMIN)  # applied: nothing left to approve
    rejected = compensate(p, w, THRESHOLD + 5, case_id="inc-9")
    p.db.transaction(lambda c: reject_compensation(c, operator=APPROVER_1, tenant_id=w.tenant_id, case_id="inc-9",
                                                   reason="no evidence of outage", now=T0))
    with pytest.raises(ApprovalRefused):
        approve(p, w, "inc-9", APPROVER_2)
    assert rejected["state"] == "PENDING_APPROVAL"
    actions = audit_actions(conn, w.tenant_id)
    assert actions.count("compensation.approve") == 2 and "compensation.reject" in actions


def test_cli_refund_and_compensation(p, conn, db_url, monkeypatch, capsys):
    cli = Cli(monkeypatch)
    monkeypatch.setenv("AIVEDIO_DATABASE_URL", db_url)
    monkeypatch.setenv("AIVEDIO_REDIS_URL", "none")
    w = new_wallet(p, credits=1000)
    task, s = settled_task(p, w)
    base = ["--operator", SUPPORT, "--json"]
    assert cli.main(["admin", "refund", "create", "--tenant-id", str(w.tenant_id), "--task-id", str(task), "--amount", "20",
                     "--reason", "bad output", "--request-key", "t-1", *base]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["state"] == "COMPLETED" and doc["amount"] == 20
    before = footprint(conn, w.tenant_id, w.wallet_id)
    assert cli.main(["admin", "refund", "create", "--tenant-id", str(w.tenant_id), "--task-id", str(task), "--amount", "51",
                     "--reason", "bad output", "--request-key", "t-2", *base]) == 1
    err = json.loads(capsys.readouterr().out)
    assert err["error"] == "REFUND_EXCEEDS_SETTLED" and err["details"]["requested"] == 51
    assert cli.main(["admin", "compensation", "request", "--tenant-id", str(w.tenant_id), "--amount", "10",
                     "--reason-code", "GOODWILL", "--evidence", '{"ticket": "x"}', *base]) == 1
    assert json.loads(capsys.readouterr().out)["error"] == "COMPENSATION_INVALID"  # no --case-id
    assert footprint(conn, w.tenant_id, w.wallet_id) == before
    assert cli.main(["admin", "compensation", "request", "--tenant-id", str(w.tenant_id), "--amount", "10", "--case-id", "c-1",
                     "--reason-code", "GOODWILL", "--evidence", '{"ticket": "x"}', *base]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "APPLIED"
