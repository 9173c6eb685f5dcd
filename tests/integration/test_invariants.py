"""aivedio.invariants over a real PostgreSQL: each statement counts what breaks its promise, and the
pure forms the chaos checkers use on recorded rows say the same of the same rows. The database is
tampered with behind the append-only triggers, as only a bug or an attacker could."""
from __future__ import annotations

import psycopg
import pytest
from psycopg.rows import dict_row

from aivedio import invariants, tasks
from aivedio.billing.ledger import ledger_aggregate
from aivedio.scheduling.resources import ensure_platform_pools
from tests.admission_support import BODY, new_tenant
from tests.conftest import create_test_database, drop_test_database
from tests.scheduler_support import submit


@pytest.fixture
def db_url():
    url = create_test_database("invariants")
    yield url
    drop_test_database(url)


def _rows(conn, sql: str, *params) -> list[dict]:
    return [dict(r) for r in conn.execute(sql, params).fetchall()]


def test_terminal_states_come_from_the_task_state_machine():
    assert invariants.TERMINAL_STATES == sorted(tasks.TERMINAL)
    assert set(invariants.AT_REST) | set(invariants.ALWAYS) >= {invariants.LEDGER_BALANCED, invariants.DRR_NON_NEGATIVE}
    names = [i.name for i in (*invariants.AT_REST, *invariants.ALWAYS)]
    assert len(set(names)) == len({i for i in (*invariants.AT_REST, *invariants.ALWAYS)})  # one name, one invariant


def test_a_healthy_database_breaks_nothing(make_platform, conn):
    p = make_platform()
    t = new_tenant(p, credits=10_000)
    [task_id] = submit(p, t.tenant_id, t.user_id, BODY, n=1)
    for inv in (*invariants.AT_REST, *invariants.ALWAYS):
        expected = 1 if inv is invariants.EVERY_TASK_TERMINAL else 0  # the task is still queued
        assert invariants.broken(conn, inv, [str(task_id)]) == expected, inv.name
    wallet = conn.execute("select * from wallet_account where tenant_id = %s", (t.tenant_id,)).fetchone()
    assert invariants.wallet_findings(conn, wallet) == []


def test_the_statements_and_their_pure_forms_agree_on_a_tampered_database(make_platform, db_url):
    p = make_platform()  # this test's own database (db_url above): tampering it touches no other test
    with p.db.connection() as c:
        ensure_platform_pools(c, p.config)
    t = new_tenant(p, credits=10_000)
    [task_id] = submit(p, t.tenant_id, t.user_id, BODY, n=1)
    with psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as c:
        wallet_id = c.execute("select wallet_id from wallet_account where tenant_id = %s", (t.tenant_id,)).fetchone()["wallet_id"]
        # An entry edited in place: its transaction no longer sums to zero, nor the snapshot to the ledger.
        c.execute("alter table ledger_entry disable trigger ledger_entry_append_only")
        c.execute("""update ledger_entry set amount_delta = amount_delta + 1
                      where entry_id = (select entry_id from ledger_entry where wallet_id = %s and bucket = 'AVAILABLE'
                                         order by entry_id limit 1)""", (wallet_id,))
        c.execute("alter table ledger_entry enable trigger ledger_entry_append_only")
        # The queued task marked FAILED behind the state machine, its credit still reserved.
        c.execute("update generation_task set state = 'FAILED' where task_id = %s", (task_id,))
        # A shard counter that no reservation accounts for (past its capacity the schema's CHECK refuses).
        shard = c.execute("""select * from resource_pool_shard where capacity_units > 0 and used_units = 0
                              order by resource_key, shard_no limit 1""").fetchone()
        c.execute("update resource_pool_shard set used_units = 1 where resource_key = %s and shard_no = %s",
                  (shard["resource_key"], shard["shard_no"]))

        scoped = [str(task_id)]
        assert invariants.broken(c, invariants.LEDGER_BALANCED) == 1
        assert invariants.broken(c, invariants.EVERY_TASK_TERMINAL, scoped) == 0
        assert invariants.broken(c, invariants.NO_OPEN_CREDIT_ON_TERMINAL_TASKS, scoped) == 1
        assert invariants.broken(c, invariants.SHARDS_WITHIN_CAPACITY) == 0
        assert invariants.broken(c, invariants.SHARDS_EQUAL_ACTIVE_RESERVATIONS) == 1

        # The pure forms, over the same rows as a chaos run records them.
        entries = _rows(c, "select * from ledger_entry where wallet_id = %s", wallet_id)
        [(txn, sums)] = invariants.unbalanced(entries).items()
        assert sums == {entries[0]["unit_code"]: 1}
        wallet = c.execute("select * from wallet_account where wallet_id = %s", (wallet_id,)).fetchone()
        found = {f["kind"] for f in invariants.wallet_findings(c, wallet)}
        assert found == {"SNAPSHOT_AVAILABLE", "UNBALANCED_TRANSACTIONS"}
        lots = _rows(c, "select * from credit_lot where wallet_id = %s", wallet_id)
        open_reserved = c.execute(invariants.OPEN_RESERVED, {"w": wallet_id}).fetchone()["n"]
        diffs = invariants.wallet_differences(wallet, ledger_aggregate(c, wallet_id), lots, open_reserved)
        assert set(diffs) == {"available_amount"}  # the snapshot column the finding names (SNAPSHOT_AVAILABLE)
        tampered = c.execute("select * from resource_pool_shard where resource_key = %s and shard_no = %s",
                             (shard["resource_key"], shard["shard_no"])).fetchone()
        active = c.execute("""select coalesce(sum(reserved_units), 0)::int as n from resource_reservation
                               where resource_key = %s and shard_no = %s and state = 'ACTIVE'""",
                           (shard["resource_key"], shard["shard_no"])).fetchone()["n"]
        assert invariants.shard_problem(tampered, active) == f"used 1 != ACTIVE reservations {active}"
        assert invariants.shard_problem({**tampered, "used_units": active}, active) is None
        assert invariants.shard_problem({**tampered, "used_units": -1}, -1) == f"used -1 outside [0, {tampered['capacity_units']}]"
