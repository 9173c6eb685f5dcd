"""Migration 0230 (admission's write cost, issue 15) over a database that already holds a tenant's
money and queued tasks, written by the schema before it: the single-column checks become domains
over the rows that are there (no table rewritten), the ledger's headers get their wallet's unit,
and afterwards the wallet check still balances, the queue usage still counts the queued tasks,
admission goes on, and the keys that replaced others refuse what those refused. And the admission
function it defines runs alone in its transaction."""
from __future__ import annotations

import json
import uuid

import psycopg
import pytest
from psycopg.rows import dict_row

from aivedio.admission.models import GenerationRequest
from aivedio.admission.service import admit
from aivedio.billing import lots
from aivedio.billing.wallet_checks import check_wallet
from aivedio.config import PlatformConfig, Settings
from aivedio.context import build_platform
from aivedio.db.migrate import migrate
from tests.admission_support import BODY, GENEROUS, Tenant
from tests.conftest import database_migrated_before, drop_test_database

MIGRATION = 230
CREDITS = 10_000
# Tables whose columns become domains: retyped in place, never rewritten.
BIG = ["generation_task", "ledger_entry", "ledger_transaction", "credit_reservation", "outbox_event", "idempotency_record"]


def _grant_the_old_way(conn, wallet: dict) -> None:
    """A GRANT as the schema before 0230 took it: a lot, and a header without a unit."""
    lot_id = lots.create_lot(conn, wallet=wallet, kind="PAID", amount=CREDITS, source_business_key="grant:old")
    txn = conn.execute("""insert into ledger_transaction (wallet_id, tenant_id, business_key, event_type, metadata)
                          values (%s, %s, 'grant:old', 'GRANT', '{}') returning ledger_txn_id""",
                       (wallet["wallet_id"], wallet["tenant_id"])).fetchone()["ledger_txn_id"]
    conn.execute("""insert into ledger_entry (ledger_txn_id, wallet_id, lot_id, bucket, amount_delta, unit_code)
                    values (%s, %s, %s, 'AVAILABLE', %s, 'CREDIT'), (%s, %s, %s, 'ISSUED', %s, 'CREDIT')""",
                 (txn, wallet["wallet_id"], lot_id, CREDITS, txn, wallet["wallet_id"], lot_id, -CREDITS))
    conn.execute("update wallet_account set available_amount = available_amount + %s where wallet_id = %s",
                 (CREDITS, wallet["wallet_id"]))


def test_the_migration_keeps_a_tenants_money_and_queue_and_admission_goes_on(tmp_path, redis_url, redis_prefix):
    from aivedio.admin.tenants import create_tenant

    url = database_migrated_before(tmp_path, MIGRATION, "mig230")
    try:
        p = build_platform(Settings(database_url=url, redis_url=redis_url, redis_prefix=redis_prefix), PlatformConfig(),
                           pool_size=2)
        try:
            made = create_tenant(p, name="before-0230", service_class="PAID_SHARED", weight=3, credits=0,
                                 policy_overrides=GENEROUS, trusted=True)
            t = Tenant(made.tenant_id, made.user_id, made.wallet_id, made.api_key)
            with p.db.connection() as conn, conn.transaction():
                wallet = conn.execute("select * from wallet_account where wallet_id = %s", (t.wallet_id,)).fetchone()
                _grant_the_old_way(conn, wallet)
            req = GenerationRequest(**BODY)
            before = [json.loads(admit(p, t.caller, req, BODY, f"old-{i}").body)["task_id"] for i in range(3)]  # 0195's function
        finally:
            p.close()

        with psycopg.connect(url) as c:
            files = dict(c.execute("select relname, relfilenode from pg_class where relname = any(%s)", (BIG,)).fetchall())
        migrate(url)
        with psycopg.connect(url) as c:
            assert dict(c.execute("select relname, relfilenode from pg_class where relname = any(%s)", (BIG,)).fetchall()) == files

        p = build_platform(Settings(database_url=url, redis_url=redis_url, redis_prefix=redis_prefix), PlatformConfig(),
                           pool_size=2)
        try:
            with psycopg.connect(url, row_factory=dict_row) as c:
                assert c.execute("select max(version) as v from schema_migration").fetchone()["v"] >= MIGRATION
                headers = c.execute("""select t.unit_code, w.unit_code as wallet_unit from ledger_transaction t
                                         join wallet_account w using (wallet_id)""").fetchall()
                assert len(headers) == 4 and all(h["unit_code"] == h["wallet_unit"] == "CREDIT" for h in headers)
                # The rows the retyped columns held are there, under their domains.
                tasks = c.execute("select task_id::text, state, queue_class, fairness_units from generation_task "
                                  "order by created_at").fetchall()
                assert [r["task_id"] for r in tasks] == before and {r["state"] for r in tasks} == {"QUEUED"}
                usage = c.execute("select sum(queued_tasks) as n from task_queue_usage where tenant_id = %s",
                                  (t.tenant_id,)).fetchone()["n"]
                assert usage == 3
            after = admit(p, t.caller, GenerationRequest(**BODY), BODY, "new-0")
            assert after.status == 202
            with p.db.connection() as conn, conn.transaction():
                check = check_wallet(conn, wallet_id=t.wallet_id, now=p.clock.now(), freeze=False)
            assert check["ok"], check["findings"]
            with psycopg.connect(url, row_factory=dict_row, autocommit=True) as c:  # each transaction() commits: its keys are checked
                w = c.execute("select available_amount, reserved_amount from wallet_account where wallet_id = %s",
                              (t.wallet_id,)).fetchone()
                assert w == {"available_amount": CREDITS - 4 * 70, "reserved_amount": 4 * 70}
                # An entry whose unit is not its transaction's (and so not its wallet's) is refused, as the
                # wallet key it no longer has refused it; a header's unit must be its wallet's.
                txn = c.execute("select ledger_txn_id from ledger_transaction where business_key = 'grant:old'").fetchone()
                with pytest.raises(psycopg.errors.ForeignKeyViolation), c.transaction():
                    c.execute("""insert into ledger_entry (ledger_txn_id, wallet_id, bucket, amount_delta, unit_code)
                                 values (%s, %s, 'AVAILABLE', 1, 'USD'), (%s, %s, 'ISSUED', -1, 'USD')""",
                              (txn["ledger_txn_id"], t.wallet_id, txn["ledger_txn_id"], t.wallet_id))
                with pytest.raises(psycopg.errors.ForeignKeyViolation), c.transaction():
                    h = c.execute("""insert into ledger_transaction (wallet_id, business_key, event_type, unit_code)
                                     values (%s, 'grant:usd', 'GRANT', 'USD') returning ledger_txn_id""",
                                  (t.wallet_id,)).fetchone()["ledger_txn_id"]
                    c.execute("""insert into ledger_entry (ledger_txn_id, bucket, amount_delta)
                                 values (%s, 'AVAILABLE', 1), (%s, 'ISSUED', -1)""", (h, h))
        finally:
            p.close()
    finally:
        drop_test_database(url)


def test_the_admission_function_refuses_a_transaction_that_wrote_before_it(platform, conn):
    """aivedio_admit makes the deferred constraints immediate for the rest of its transaction, so it
    runs alone in one (aivedio.admission.write calls it on an autocommit connection)."""
    from aivedio.scheduling import queue_stats
    from aivedio.admission import write
    from aivedio.admission.service import prepare, tenant_policy
    from tests.admission_support import new_tenant

    t = new_tenant(platform)
    req = GenerationRequest(**BODY)
    policy = tenant_policy(platform, t.tenant_id)
    est, q = prepare(platform, policy, req)
    params = write.params(platform, t.caller, req, "alone", "h", policy, est, q, task_id=uuid.uuid4(), claimed=False,
                          lane=queue_stats.lane_stats(platform, est.queue_class), best_effort=None)
    args = [params[name] for name, _ in write.ADMIT_ARGS]
    with pytest.raises(psycopg.errors.RaiseException, match="runs alone in its transaction"):
        with conn.transaction():
            conn.execute("insert into idempotency_record (tenant_id, idempotency_key, request_hash) values (%s, 'other', 'h')",
                         (t.tenant_id,))
            psycopg.RawCursor(conn).execute(write.ADMIT, args)
    row = psycopg.RawCursor(conn).execute(write.ADMIT, args).fetchone()  # alone: admitted
    assert row["status"] == "ADMITTED"
