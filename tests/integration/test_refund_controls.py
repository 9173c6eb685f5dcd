"""Money controls on refunds (ch. 20.13.5: "大额退款和补偿采用双人审批", "限制单人、单日的操作额度").

- at or below BillingConfig.refund_dual_approval_above a refund is applied at once by one operator;
- above it, it waits in PENDING_APPROVAL and moves no money; its requester cannot approve it; an
  operator other than the requester approves it and it is applied exactly once (ledger, wallet,
  reservation); a second approval, sequential or concurrent, refunds nothing more; before its task
  settles the approved refund waits in PENDING_SETTLEMENT and the settlement applies it; a refund
  awaiting approval can be rejected, and then never approved;
- each operator refunds at most BillingConfig.refund_daily_limit_per_operator credits per UTC day
  of the platform clock: a refund counts against its requester when requested and against its
  approver when approved; the refund that would cross the limit is refused and writes nothing; a
  rejected refund frees its room; the next UTC day starts from zero;
- the limit check is race-safe: concurrent refunds by one operator on different wallets (so no
  wallet lock serialises them) never refund more than the limit, and the second one waits on the
  operator's lock until the first commits;
- every decision that passes leaves an audit_log row with the operator, the amounts and the limit's
  figures; the CLI's `refund approve`/`reject` print one JSON document with --json, lines without."""
from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from aivedio.billing.errors import ApprovalRefused, RefundDailyLimitExceeded
from aivedio.billing.refunds import approve_refund, reject_refund, request_refund
from aivedio.billing.settlement import settle
from aivedio.config import BillingConfig, ManualClock, PlatformConfig
from tests.billing_support import (ADMIN, APPROVER_1, APPROVER_2, SUPPORT, T0, Cli, assert_invariants, footprint, make_task,
                                   new_wallet, terminal)

pytestmark = pytest.mark.timeout(180)
THRESHOLD = 50  # a settled 5 s task is charged 70: refunds of 51..70 need a second operator
LIMIT = 300  # credits per operator per UTC day
ADMIN_2 = "op:admin-2"  # a second requester who may also approve
DAYS = itertools.count()  # the module shares one database: each test refunds on a day of its own


@pytest.fixture
def p(make_platform):
    config = PlatformConfig(billing=BillingConfig(refund_dual_approval_above=THRESHOLD, refund_daily_limit_per_operator=LIMIT))
    return make_platform(config, redis=False, pool_size=16, clock=ManualClock(T0 + timedelta(days=next(DAYS))))


def settled_task(p, w):
    task = p.db.transaction(lambda c: make_task(c, w, policy="USAGE_BASED"))
    with p.db.connection() as c:
        s = settle(c, terminal(task, w.tenant_id, seconds="5"), T0, event_type="TaskSucceeded", event_id=uuid.uuid4())
    assert s.charged == 70
    return task, s


def refund(p, w, task, amount, *, operator=SUPPORT, conn=None):
    def fn(c):
        return request_refund(c, operator=operator, tenant_id=w.tenant_id, task_id=task, amount=amount, reason="customer complaint",
                              now=p.clock.now(), request_key=uuid.uuid4().hex,
                              dual_approval_above=p.config.billing.refund_dual_approval_above,
                              daily_limit=p.config.billing.refund_daily_limit_per_operator)
    return fn(conn) if conn is not None else p.db.transaction(fn)


def approve(p, refund_id, operator):
    return p.db.transaction(lambda c: approve_refund(c, operator=operator, refund_id=uuid.UUID(str(refund_id)), now=p.clock.now(),
                                                     daily_limit=p.config.billing.refund_daily_limit_per_operator))


def reject(p, refund_id, operator, reason="not justified"):
    return p.db.transaction(lambda c: reject_refund(c, operator=operator, refund_id=uuid.UUID(str(refund_id)), reason=reason,
                                                    now=p.clock.now()))


def day(p) -> str:
    return p.clock.now().date().isoformat()


def audit_rows(conn, tenant_id, action=None):
    return conn.execute("""select operator, action, target, new_value, reason from audit_log
                            where tenant_id = %s and (%s::text is null or action = %s) order by audit_id""",
                        (tenant_id, action, action)).fetchall()


def refund_txns(conn, task):
    return conn.execute("select * from ledger_transaction where task_id = %s and event_type = 'REFUND'", (task,)).fetchall()


def money(conn, w):
    """What a refund moves: the wallet's buckets, the ledger, the lots and the reservations."""
    f = footprint(conn, w.tenant_id, w.wallet_id)
    f["wallet"].pop("version")
    return {k: f[k] for k in ("wallet", "ledger_transaction", "ledger_entry", "lots", "reservations", "settlement_allocation")}


def test_at_or_below_the_threshold_one_operator_refunds_at_once(p, conn):
    w = new_wallet(p, credits=1000)
    task, s = settled_task(p, w)
    out = refund(p, w, task, THRESHOLD)
    assert (out["state"], out["requested_by"], out["approved_by"]) == ("COMPLETED", SUPPORT, None)
    assert [t["reversal_of"] for t in refund_txns(conn, task)] == [s.settle_ledger_txn_id]
    w_row = assert_invariants(conn, w.wallet_id)
    assert (w_row["available_amount"], w_row["consumed_amount"]) == (1000 - 70 + THRESHOLD, 70 - THRESHOLD)
    (row,) = audit_rows(conn, w.tenant_id, "refund.apply")
    assert row["operator"] == SUPPORT and row["target"] == f"task:{task}" and row["reason"] == "customer complaint"
    assert row["new_value"]["amount"] == THRESHOLD
    assert row["new_value"]["daily_limit"] == {"operator": SUPPORT, "day": day(p), "used": 0, "amount": THRESHOLD,
                                               "limit": LIMIT}


def test_above_the_threshold_a_second_operator_approves_and_it_is_applied_once(p, conn):
    w = new_wallet(p, credits=1000)
    task, s = settled_task(p, w)
    before = money(conn, w)
    out = refund(p, w, task, THRESHOLD + 10, operator=ADMIN)
    assert (out["state"], out["refund_ledger_txn_id"]) == ("PENDING_APPROVAL", None)
    assert money(conn, w) == before  # recorded, no money moved
    footprint_pending = footprint(conn, w.tenant_id, w.wallet_id)
    with pytest.raises(ApprovalRefused) as e:
        approve(p, out["refund_id"], ADMIN)  # the requester is not a second pair of eyes
    assert e.value.code == "APPROVAL_REFUSED" and "requester" in e.value.message
    assert footprint(conn, w.tenant_id, w.wallet_id) == footprint_pending  # refusals write nothing

    done = approve(p, out["refund_id"], APPROVER_1)
    assert (done["state"], done["requested_by"], done["approved_by"]) == ("COMPLETED", ADMIN, APPROVER_1)
    (txn,) = refund_txns(conn, task)
    assert txn["reversal_of"] == s.settle_ledger_txn_id and txn["ledger_txn_id"] == uuid.UUID(done["refund_ledger_txn_id"])
    assert txn["business_key"] == f"refund:generation:{task}:{out['refund_id']}"
    w_row = assert_invariants(conn, w.wallet_id)
    assert (w_row["available_amount"], w_row["consumed_amount"]) == (1000 - 70 + THRESHOLD + 10, 70 - THRESHOLD - 10)

    after = footprint(conn, w.tenant_id, w.wallet_id)
    for again in (APPROVER_2, APPROVER_1, ADMIN_2):  # approved and applied: nothing left to approve
        with pytest.raises(ApprovalRefused) as e:
            approve(p, out["refund_id"], again)
        assert e.value.details["state"] == "COMPLETED"
    with pytest.raises(ApprovalRefused):
        reject(p, out["refund_id"], APPROVER_2)
    assert footprint(conn, w.tenant_id, w.wallet_id) == after
    assert len(refund_txns(conn, task)) == 1

    rows = audit_rows(conn, w.tenant_id)
    assert [(r["action"], r["operator"]) for r in rows if r["action"].startswith("refund.")] == [
        ("refund.request", ADMIN), ("refund.approve", APPROVER_1), ("refund.apply", APPROVER_1)]
    req, appr, app = (r for r in rows if r["action"].startswith("refund."))
    assert req["new_value"]["state"] == "PENDING_APPROVAL" and req["new_value"]["dual_approval_above"] == THRESHOLD
    assert req["new_value"]["daily_limit"]["operator"] == ADMIN and req["new_value"]["daily_limit"]["amount"] == THRESHOLD + 10
    assert appr["new_value"]["requested_by"] == ADMIN and appr["new_value"]["daily_limit"]["operator"] == APPROVER_1
    assert app["new_value"]["approved_by"] == APPROVER_1 and app["new_value"]["amount"] == THRESHOLD + 10


def test_two_concurrent_approvals_refund_once(p, conn):
    w = new_wallet(p, credits=1000)
    task, _ = settled_task(p, w)
    out = refund(p, w, task, 70, operator=ADMIN)
    barrier = threading.Barrier(2)

    def go(op):
        barrier.wait()
        try:
            return approve(p, out["refund_id"], op)["state"]
        except ApprovalRefused as e:
            return e.code
    with ThreadPoolExecutor(2) as ex:
        results = sorted(ex.map(go, [APPROVER_1, APPROVER_2]))
    assert results == ["APPROVAL_REFUSED", "COMPLETED"]
    assert len(refund_txns(conn, task)) == 1
    res = conn.execute("select refunded_amount, state from credit_reservation where task_id = %s", (task,)).fetchone()
    assert (res["refunded_amount"], res["state"]) == (70, "REFUNDED")
    assert assert_invariants(conn, w.wallet_id)["available_amount"] == 1000
    assert len(audit_rows(conn, w.tenant_id, "refund.approve")) == 1


def test_an_approved_refund_before_settlement_waits_for_it_and_an_unapproved_one_is_left_alone(p, conn):
    w = new_wallet(p, credits=1000)
    early = p.db.transaction(lambda c: make_task(c, w, policy="USAGE_BASED"))
    late = p.db.transaction(lambda c: make_task(c, w, policy="USAGE_BASED"))
    a = refund(p, w, early, 60, operator=ADMIN)
    b = refund(p, w, late, 60, operator=ADMIN)
    assert a["state"] == b["state"] == "PENDING_APPROVAL"
    assert approve(p, a["refund_id"], APPROVER_1)["state"] == "PENDING_SETTLEMENT"  # approved, the charge not yet known
    assert assert_invariants(conn, w.wallet_id)["available_amount"] == 1000 - 140
    with p.db.connection() as c:
        for task in (early, late):
            settle(c, terminal(task, w.tenant_id, seconds="5"), T0, event_type="TaskSucceeded", event_id=uuid.uuid4())
    states = {r["refund_id"]: r["state"] for r in conn.execute("select refund_id, state from refund_request where tenant_id = %s",
                                                               (w.tenant_id,))}
    assert states == {uuid.UUID(a["refund_id"]): "COMPLETED", uuid.UUID(b["refund_id"]): "PENDING_APPROVAL"}
    assert (len(refund_txns(conn, early)), len(refund_txns(conn, late))) == (1, 0)
    assert approve(p, b["refund_id"], APPROVER_2)["state"] == "COMPLETED"  # settled now: applied at once
    assert len(refund_txns(conn, late)) == 1
    w_row = assert_invariants(conn, w.wallet_id)
    assert (w_row["available_amount"], w_row["consumed_amount"]) == (1000 - 140 + 120, 140 - 120)


def test_a_refund_awaiting_approval_is_rejected_moves_nothing_and_frees_the_limit(p, conn):
    w = new_wallet(p, credits=1000)
    tasks = [settled_task(p, w)[0] for _ in range(5)]
    before = money(conn, w)
    pending = [refund(p, w, t, 60, operator=ADMIN) for t in tasks]  # 300: ADMIN's whole day
    with pytest.raises(RefundDailyLimitExceeded):
        refund(p, w, tasks[0], 1, operator=ADMIN)
    out = reject(p, pending[0]["refund_id"], APPROVER_1, reason="duplicate ticket")
    assert out["state"] == "REJECTED"
    row = conn.execute("select * from refund_request where refund_id = %s", (pending[0]["refund_id"],)).fetchone()
    assert (row["rejected_by"], row["rejected_reason"], row["approved_by"]) == (APPROVER_1, "duplicate ticket", None)
    assert money(conn, w) == before
    with pytest.raises(ApprovalRefused) as e:
        approve(p, pending[0]["refund_id"], APPROVER_2)
    assert e.value.details["state"] == "REJECTED"
    with pytest.raises(ApprovalRefused):
        reject(p, pending[0]["refund_id"], APPROVER_2)
    assert refund(p, w, tasks[0], 60, operator=ADMIN)["state"] == "PENDING_APPROVAL"  # the rejected 60 counts no more
    (rej,) = audit_rows(conn, w.tenant_id, "refund.reject")
    assert rej["operator"] == APPROVER_1 and rej["reason"] == "duplicate ticket" and rej["new_value"]["requested_by"] == ADMIN


def test_the_daily_limit_refuses_the_refund_that_would_cross_it_and_resets_the_next_utc_day(p, conn):
    w = new_wallet(p, credits=1000)
    tasks = [settled_task(p, w)[0] for _ in range(7)]
    for t in tasks[:6]:
        refund(p, w, t, THRESHOLD)  # 6 x 50 = 300: exactly the limit
    before = footprint(conn, w.tenant_id, w.wallet_id)
    with pytest.raises(RefundDailyLimitExceeded) as e:
        refund(p, w, tasks[6], 1)
    assert e.value.code == "REFUND_DAILY_LIMIT_EXCEEDED"
    today = day(p)
    assert e.value.details == {"operator": SUPPORT, "day": today, "used": LIMIT, "amount": 1, "limit": LIMIT}
    assert footprint(conn, w.tenant_id, w.wallet_id) == before  # no money, no refund row, no audit row
    assert refund(p, w, tasks[6], 1, operator=ADMIN)["state"] == "COMPLETED"  # the limit is per operator
    now = p.clock.now()
    p.clock.advance((now.replace(hour=23, minute=59, second=59) - now).total_seconds())
    with pytest.raises(RefundDailyLimitExceeded):
        refund(p, w, tasks[6], 1)  # 23:59:59Z: still the same UTC day
    p.clock.advance(1)  # midnight UTC: a new day
    assert p.clock.now().hour == 0 and day(p) != today
    out = refund(p, w, tasks[6], THRESHOLD)
    assert out["state"] == "COMPLETED"
    row = audit_rows(conn, w.tenant_id, "refund.apply")[-1]
    assert row["new_value"]["daily_limit"] == {"operator": SUPPORT, "day": day(p), "used": 0, "amount": THRESHOLD,
                                               "limit": LIMIT}
    assert len(audit_rows(conn, w.tenant_id, "refund.apply")) == 8
    assert_invariants(conn, w.wallet_id)


def test_a_refund_counts_against_its_requester_when_requested_and_its_approver_when_approved(p, conn):
    w = new_wallet(p, credits=1000)
    tasks = [settled_task(p, w)[0] for _ in range(7)]
    # APPROVER_1 approves 4 x 70 = 280 of refunds others requested (ADMIN 140, ADMIN_2 140).
    for i, t in enumerate(tasks[:4]):
        approve(p, refund(p, w, t, 70, operator=ADMIN if i % 2 else ADMIN_2)["refund_id"], APPROVER_1)
    late = refund(p, w, tasks[4], 60, operator=ADMIN)  # ADMIN: 140 + 60 = 200
    before = footprint(conn, w.tenant_id, w.wallet_id)
    with pytest.raises(RefundDailyLimitExceeded) as e:
        approve(p, late["refund_id"], APPROVER_1)  # 280 + 60 > 300
    assert (e.value.details["operator"], e.value.details["used"]) == (APPROVER_1, 280)
    assert footprint(conn, w.tenant_id, w.wallet_id) == before  # still awaiting approval, nothing moved
    assert approve(p, late["refund_id"], APPROVER_2)["state"] == "COMPLETED"
    assert refund(p, w, tasks[5], 70, operator=ADMIN)["state"] == "PENDING_APPROVAL"  # ADMIN: 270, counted when requested
    with pytest.raises(RefundDailyLimitExceeded) as e:
        refund(p, w, tasks[6], 31, operator=ADMIN)
    assert (e.value.details["operator"], e.value.details["used"]) == (ADMIN, 270)
    assert refund(p, w, tasks[6], 30, operator=ADMIN)["state"] == "COMPLETED"
    approvals = audit_rows(conn, w.tenant_id, "refund.approve")
    assert [(r["operator"], r["new_value"]["daily_limit"]["used"]) for r in approvals] == [
        (APPROVER_1, 0), (APPROVER_1, 70), (APPROVER_1, 140), (APPROVER_1, 210), (APPROVER_2, 0)]
    assert_invariants(conn, w.wallet_id)


def test_concurrent_refunds_by_one_operator_never_pass_the_limit(p, conn):
    wallets = [new_wallet(p, credits=1000) for _ in range(12)]  # one wallet each: no wallet lock serialises them
    tasks = [(w, settled_task(p, w)[0]) for w in wallets]
    barrier = threading.Barrier(len(tasks))

    def go(wt):
        w, t = wt
        barrier.wait()
        try:
            return refund(p, w, t, THRESHOLD)["state"]
        except RefundDailyLimitExceeded as e:
            return e.code
    with ThreadPoolExecutor(len(tasks)) as ex:
        results = list(ex.map(go, tasks))
    assert sorted(results) == ["COMPLETED"] * 6 + ["REFUND_DAILY_LIMIT_EXCEEDED"] * 6
    refunded = conn.execute(
        """select coalesce(sum(amount), 0)::bigint as n from refund_request
            where requested_by = %s and state = 'COMPLETED' and tenant_id = any(%s)""",
        (SUPPORT, [w.tenant_id for w in wallets])).fetchone()["n"]
    assert refunded == LIMIT
    for w, _ in tasks:
        assert_invariants(conn, w.wallet_id)


def test_a_second_refund_by_the_operator_waits_on_its_lock_until_the_first_commits(p, conn):
    w1, w2 = new_wallet(p, credits=1000), new_wallet(p, credits=1000)
    t1, t2 = settled_task(p, w1)[0], settled_task(p, w2)[0]
    for t in [settled_task(p, w1)[0] for _ in range(5)]:
        refund(p, w1, t, 50)  # 250 of 300 used: one more 50 fits, not two
    holding, release = threading.Event(), threading.Event()

    def first(c):
        out = refund(p, w1, t1, 50, conn=c)
        holding.set()
        assert release.wait(30)
        return out["state"]

    def second():
        try:
            return refund(p, w2, t2, 50)["state"]
        except RefundDailyLimitExceeded as e:
            return e.code
    waiting = """select 1 from pg_locks where locktype = 'advisory' and not granted
                  and database = (select oid from pg_database where datname = current_database())"""
    with ThreadPoolExecutor(2) as ex:
        a = ex.submit(p.db.transaction, first)
        try:
            assert holding.wait(30)
            b = ex.submit(second)
            deadline = time.monotonic() + 10
            while not conn.execute(waiting).fetchone():
                assert time.monotonic() < deadline, "the second refund never waited on the operator's lock"
                time.sleep(0.02)
            assert not b.done()
        finally:
            release.set()
        assert (a.result(30), b.result(30)) == ("COMPLETED", "REFUND_DAILY_LIMIT_EXCEEDED")
    assert len(refund_txns(conn, t2)) == 0


def test_cli_refund_approve_and_reject(p, conn, db_url, monkeypatch, capsys, tmp_path):
    cli = Cli(monkeypatch)
    monkeypatch.setenv("AIVEDIO_DATABASE_URL", db_url)
    monkeypatch.setenv("AIVEDIO_REDIS_URL", "none")
    config = tmp_path / "aivedio.toml"
    config.write_text(f"[billing]\nrefund_dual_approval_above = {THRESHOLD}\nrefund_daily_limit_per_operator = {LIMIT}\n")
    w = new_wallet(p, credits=1000)
    (t1, _), (t2, _) = settled_task(p, w), settled_task(p, w)

    tight = tmp_path / "tight.toml"  # a limit ADMIN's 60 of today leaves 40 of
    tight.write_text(f"[billing]\nrefund_dual_approval_above = {THRESHOLD}\nrefund_daily_limit_per_operator = 100\n")

    def run(*argv, operator, json_out=True, cfg=config):
        code = cli.main(["admin", "refund", *argv, "--operator", operator, "--config", str(cfg),
                         *(["--json"] if json_out else [])])
        return code, capsys.readouterr().out

    code, out = run("create", "--tenant-id", str(w.tenant_id), "--task-id", str(t1), "--amount", "60", "--reason", "bad output",
                    "--request-key", "cli-1", operator=ADMIN)
    doc = json.loads(out)  # exactly one JSON document
    assert code == 0 and (doc["state"], doc["requested_by"]) == ("PENDING_APPROVAL", ADMIN)
    code, out = run("approve", "--refund-id", doc["refund_id"], operator=ADMIN)
    assert code == 1 and json.loads(out)["error"] == "APPROVAL_REFUSED"
    refused = conn.execute("select * from audit_log where action = 'refund.approve.refused' and operator = %s", (ADMIN,)).fetchall()
    assert len(refused) == 1 and refused[0]["target"] == f"refund:{doc['refund_id']}"
    assert refused[0]["new_value"]["error"] == "APPROVAL_REFUSED"
    code, out = run("approve", "--refund-id", doc["refund_id"], operator=APPROVER_1)
    done = json.loads(out)
    assert code == 0 and (done["state"], done["approved_by"]) == ("COMPLETED", APPROVER_1)
    assert len(refund_txns(conn, t1)) == 1
    code, out = run("approve", "--refund-id", doc["refund_id"], operator=APPROVER_2)
    assert code == 1 and json.loads(out)["details"]["state"] == "COMPLETED"
    assert len(refund_txns(conn, t1)) == 1

    code, out = run("create", "--tenant-id", str(w.tenant_id), "--task-id", str(t2), "--amount", "50",
                    "--reason", "too much today", "--request-key", "cli-over", operator=ADMIN, cfg=tight)
    assert code == 1 and json.loads(out)["error"] == "REFUND_DAILY_LIMIT_EXCEEDED"
    over = conn.execute("select * from audit_log where action = 'refund.request.refused' and operator = %s",
                        (ADMIN,)).fetchall()
    assert len(over) == 1 and over[0]["target"] == f"task:{t2}" and over[0]["tenant_id"] == w.tenant_id
    assert len(refund_txns(conn, t2)) == 0
    code, out = run("create", "--tenant-id", str(w.tenant_id), "--task-id", str(t2), "--amount", "70", "--reason", "bad output",
                    "--request-key", "cli-2", operator=ADMIN)
    second = json.loads(out)
    code, out = run("reject", "--refund-id", second["refund_id"], "--reason", "policy", operator=APPROVER_2, json_out=False)
    assert code == 0 and "state: REJECTED" in out.splitlines()
    assert all(": " in line and "{" not in line for line in out.splitlines())  # lines, never a dict's repr
    assert len(refund_txns(conn, t2)) == 0
