"""Wallet checks and their rebuild (issue 6, "Wallet checks", ch. 20.8.5) on the real PostgreSQL.

- a consistent wallet passes and is left alone;
- a drifted snapshot is found, the wallet frozen (admission rejects REJECT_WALLET_FROZEN, refunds
  refuse), the finding recorded and logged; the rebuild recomputes the snapshot from the ledger,
  writes no ledger row for a snapshot-only drift, audits itself and unfreezes;
- a reservation released in its own rows but never in the ledger is repaired by one appended ADJUST
  (RESERVED -> AVAILABLE on the lot) that sums to zero, never by editing history;
- `aivedio reconcile wallets --json` runs the check over every wallet."""
from __future__ import annotations

import json
import uuid

import pytest

from aivedio.admission.decisions import Rejected
from aivedio.admission.models import GenerationRequest
from aivedio.admission.service import admit
from aivedio.billing import wallet_checks
from aivedio.billing.errors import WalletFrozen
from aivedio.billing.refunds import request_refund
from aivedio.billing.settlement import settle
from aivedio.errors import Conflict
from tests.admission_support import BODY, new_tenant
from tests.billing_support import (ADMIN, SUPPORT, T0, Cli, Wallet, assert_invariants, make_task, new_wallet,
                                   terminal)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def p(make_platform):
    platform = make_platform(pool_size=4)
    return platform


def check(p, wallet_id):
    return p.db.transaction(lambda c: wallet_checks.check_wallet(c, wallet_id=wallet_id, now=T0))


def rebuild(p, wallet_id, operator=ADMIN):
    return p.db.transaction(lambda c: wallet_checks.rebuild(c, operator=operator, wallet_id=wallet_id, now=T0, reason="test"))


def ledger_count(conn, wallet_id):
    return conn.execute("select count(*) as n from ledger_transaction where wallet_id = %s", (wallet_id,)).fetchone()["n"]


def test_a_consistent_wallet_passes(p, conn):
    w = new_wallet(p, credits=500)
    p.db.transaction(lambda c: make_task(c, w))
    r = check(p, w.wallet_id)
    assert r["ok"] and not r["frozen"] and r["findings"] == []


def test_a_drifted_snapshot_freezes_the_wallet_until_a_rebuild(p, conn, caplog):
    t = new_tenant(p, credits=1000)
    w = Wallet(t.tenant_id, t.user_id, t.wallet_id)
    task = p.db.transaction(lambda c: make_task(c, w))
    with p.db.connection() as c:
        settle(c, terminal(task, w.tenant_id), T0, event_type="TaskSucceeded", event_id=uuid.uuid4())
    conn.execute("update wallet_account set available_amount = available_amount + 5 where wallet_id = %s", (w.wallet_id,))  # a bug
    r = check(p, w.wallet_id)
    assert not r["ok"] and r["frozen"]
    assert {f["kind"] for f in r["findings"]} == {"SNAPSHOT_AVAILABLE", "LOTS_VS_AVAILABLE"}
    assert {(d["kind"], d["status"]) for d in conn.execute("select kind, status from wallet_discrepancy where wallet_id = %s",
                                                            (w.wallet_id,))} == {("SNAPSHOT_AVAILABLE", "OPEN"), ("LOTS_VS_AVAILABLE", "OPEN")}
    assert any("ALERT wallet check mismatch" in rec.getMessage() for rec in caplog.records)
    check(p, w.wallet_id)  # checking again records nothing new
    assert conn.execute("select count(*) as n from wallet_discrepancy where wallet_id = %s", (w.wallet_id,)).fetchone()["n"] == 2
    # Risky operations are refused while frozen.
    with pytest.raises(Rejected) as e:
        admit(p, t.caller, GenerationRequest.model_validate(BODY), BODY, uuid.uuid4().hex)
    assert e.value.decision == "REJECT_WALLET_FROZEN"
    with pytest.raises(WalletFrozen):
        p.db.transaction(lambda c: request_refund(c, operator=SUPPORT, tenant_id=w.tenant_id, task_id=task, amount=1, reason="x",
                                                  now=T0))
    with pytest.raises(Conflict):
        p.db.transaction(lambda c: wallet_checks.unfreeze(c, operator=ADMIN, wallet_id=w.wallet_id, now=T0, reason="x"))
    n = ledger_count(conn, w.wallet_id)
    out = rebuild(p, w.wallet_id)
    assert out["ok"] and out["unfrozen"] and out["adjust_ledger_txn_id"] is None  # the snapshot is derived: recomputed
    assert ledger_count(conn, w.wallet_id) == n  # history untouched
    assert_invariants(conn, w.wallet_id)
    assert conn.execute("select frozen from wallet_account where wallet_id = %s", (w.wallet_id,)).fetchone()["frozen"] is False
    assert {d["status"] for d in conn.execute("select status from wallet_discrepancy where wallet_id = %s", (w.wallet_id,))} == {"RESOLVED"}
    assert conn.execute("select count(*) as n from audit_log where action = 'wallet.rebuild' and tenant_id = %s",
                        (w.tenant_id,)).fetchone()["n"] == 1


def test_a_release_lost_from_the_ledger_is_repaired_by_an_appended_adjust(p, conn):
    w = new_wallet(p, credits=300)
    task = p.db.transaction(lambda c: make_task(c, w))
    # A release whose bookkeeping rows were written but whose RELEASE never reached the ledger.
    conn.execute("""update credit_reservation set released_amount = reserved_amount, state = 'RELEASED' where task_id = %s""", (task,))
    conn.execute("""update reservation_allocation set released_amount = amount
                     where reservation_id = (select reservation_id from credit_reservation where task_id = %s)""", (task,))
    r = check(p, w.wallet_id)
    assert {f["kind"] for f in r["findings"]} == {"RESERVED_VS_RESERVATIONS"}
    out = rebuild(p, w.wallet_id)
    assert out["ok"] and out["unfrozen"]
    txn = conn.execute("select * from ledger_transaction where ledger_txn_id = %s", (out["adjust_ledger_txn_id"],)).fetchone()
    assert txn["event_type"] == "ADJUST" and txn["business_key"] == f"adjust:wallet:{w.wallet_id}:1"
    entries = conn.execute("select bucket, amount_delta, lot_id from ledger_entry where ledger_txn_id = %s", (txn["ledger_txn_id"],)).fetchall()
    assert sum(e["amount_delta"] for e in entries) == 0 and all(e["lot_id"] for e in entries)
    assert {(e["bucket"], e["amount_delta"]) for e in entries} == {("RESERVED", -70), ("AVAILABLE", 70)}
    w_row = assert_invariants(conn, w.wallet_id)
    assert (w_row["available_amount"], w_row["reserved_amount"]) == (300, 0)
    assert check(p, w.wallet_id)["ok"]


def test_reconcile_wallets_cli(p, conn, db_url, monkeypatch, capsys):
    monkeypatch.setenv("AIVEDIO_DATABASE_URL", db_url)
    monkeypatch.setenv("AIVEDIO_REDIS_URL", "none")
    w = new_wallet(p, credits=100)
    conn.execute("update wallet_account set consumed_amount = consumed_amount + 1 where wallet_id = %s", (w.wallet_id,))
    cli = Cli(monkeypatch)
    assert cli.main(["reconcile", "wallets", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mismatched"] >= 1 and str(w.wallet_id) in {f["wallet_id"] for f in doc["findings"]}
    assert cli.main(["admin", "wallet", "rebuild", "--wallet-id", str(w.wallet_id), "--reason", "cli", "--operator", ADMIN, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert_invariants(conn, w.wallet_id)


def test_the_scheduled_handler_freezes_a_drifted_wallet(p, conn):
    from aivedio.context import set_platform
    from aivedio_tools.local.lambda_context import FakeLambdaContext
    from functions.wallet_check.handler import lambda_handler

    w = new_wallet(p, credits=100)
    conn.execute("update wallet_account set reserved_amount = reserved_amount + 3 where wallet_id = %s", (w.wallet_id,))
    set_platform(p)
    try:
        with open("events/wallet_check.json") as f:
            out = lambda_handler(json.load(f), FakeLambdaContext("aivedio-wallet-check"))
    finally:
        set_platform(None)
    assert str(w.wallet_id) in out["details"]["mismatched_wallets"] and out["details"]["wallets"] >= 1
    assert conn.execute("select frozen from wallet_account where wallet_id = %s", (w.wallet_id,)).fetchone()["frozen"] is True
