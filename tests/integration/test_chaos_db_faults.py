"""The chaos suite's PostgreSQL faults against a throwaway database: each does what faults.jsonl will
say it did, touches nothing beyond its target, and undoes itself when its time is up."""
from __future__ import annotations

import random
import re
import time
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import errors

from aivedio_tools.chaos import db_faults
from tests.conftest import admin_url

pytestmark = pytest.mark.timeout(60)


def _dbname(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


def _alive(c: psycopg.Connection) -> bool:
    try:
        c.execute("select 1")
        return True
    except psycopg.OperationalError:
        return False


def _show(url: str, setting: str) -> str:
    with psycopg.connect(url) as c:
        return c.execute(f"show {setting}").fetchone()[0]


def test_terminate_random_backends_only_of_that_database_and_never_the_spared(db_url):
    mine = [psycopg.connect(db_url, autocommit=True) for _ in range(4)]
    spared = psycopg.connect(db_url, autocommit=True, application_name="aivedio-chaos-sampler")
    elsewhere = psycopg.connect(admin_url(), autocommit=True)  # another database
    try:
        pids_of = [c.info.backend_pid for c in mine]  # a broken connection's backend_pid reads 0
        pids = sorted(pids_of)
        done = db_faults.terminate_random_backends(admin_url(), _dbname(db_url), random.Random(7), 2)
        assert done["kind"] == "pg_terminate_backend" and done["candidates"] == 4
        assert done["terminated"] == sorted(random.Random(7).sample(pids, 2))  # the seed picks them
        assert sorted(pid for pid, c in zip(pids_of, mine) if not _alive(c)) == done["terminated"]
        assert _alive(spared) and _alive(elsewhere)

        rest = db_faults.terminate_random_backends(admin_url(), _dbname(db_url), random.Random(1), 10)
        assert sorted(rest["terminated"]) == sorted(set(pids) - set(done["terminated"]))
        assert _alive(spared) and _alive(elsewhere)
        none = db_faults.terminate_random_backends(admin_url(), _dbname(db_url), random.Random(1), 3)
        assert none == {**none, "candidates": 0, "terminated": []}
    finally:
        for c in (*mine, spared, elsewhere):
            c.close()


def test_hold_row_lock_blocks_writers_of_that_row_only_and_ends_on_time(conn, db_url):
    conn.execute("delete from resource_pool_shard where resource_key = 'chaos-hot'")
    conn.execute("""insert into resource_pool_shard (resource_key, shard_no, capacity_units)
                    values ('chaos-hot', 0, 10), ('chaos-hot', 1, 10)""")
    bump = "update resource_pool_shard set used_units = used_units + 1 where resource_key = 'chaos-hot' and shard_no = %s"
    t0 = time.monotonic()
    held = db_faults.hold_row_lock(db_url, "resource_pool_shard", "resource_key = %(k)s and shard_no = %(n)s",
                                   {"k": "chaos-hot", "n": 0}, seconds=1.0)
    assert held.detail["rows"] == 1 and not held.done
    with psycopg.connect(db_url, autocommit=True) as w:
        w.execute("set lock_timeout = '100ms'")
        with pytest.raises(errors.LockNotAvailable):
            w.execute(bump, (0,))
        w.execute(bump, (1,))  # the other shard is free
        w.execute("set lock_timeout = '5s'")
        w.execute(bump, (0,))  # waits for the hold to end
        assert time.monotonic() - t0 >= 0.9
    detail = held.join(5)
    assert held.done and 0.9 <= detail["held_s"] < 3 and "error" not in detail
    rows = conn.execute("select shard_no, used_units from resource_pool_shard where resource_key = 'chaos-hot'").fetchall()
    used = {r["shard_no"]: r["used_units"] for r in rows}
    assert used == {0: 1, 1: 1}  # the hold wrote nothing


def test_hold_row_lock_released_early_and_nothing_matched(db_url):
    held = db_faults.hold_row_lock(db_url, "resource_pool_shard", "resource_key = %s", ("chaos-hot",), seconds=30)
    t0 = time.monotonic()
    held.release()
    held.join(5)
    assert held.done and time.monotonic() - t0 < 1
    nothing = db_faults.hold_row_lock(db_url, "wallet_account", "wallet_id = %s", ("00000000-0000-0000-0000-000000000000",), 5)
    assert nothing.join(1)["rows"] == 0 and nothing.done


def _vacuum(c: psycopg.Connection, table: str) -> tuple[int, int]:
    """(removed, dead but not yet removable) from VACUUM VERBOSE's report."""
    notes: list[str] = []
    c.add_notice_handler(lambda d: notes.append(d.message_primary or ""))
    c.execute(f"vacuum (verbose) {table}")
    text = " ".join(notes)
    m = re.search(r"tuples: (\d+) removed, \d+ remain, (\d+) are dead but not yet removable", text)
    assert m, text
    return int(m.group(1)), int(m.group(2))


def test_pin_xmin_keeps_vacuum_from_removing_dead_rows_until_it_ends(db_url):
    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("drop table if exists chaos_pin")
        c.execute("create table chaos_pin (id int) with (autovacuum_enabled = off)")
        c.execute("insert into chaos_pin select generate_series(1, 100)")
        held = db_faults.pin_xmin(db_url, seconds=30)
        assert held.detail["kind"] == "pin_xmin" and held.detail["xmin"]
        pinned = c.execute("""select backend_xmin from pg_stat_activity
                               where application_name = 'aivedio-chaos-pin-xmin' and datname = current_database()""").fetchone()
        assert pinned and pinned[0] is not None
        c.execute("delete from chaos_pin")
        assert _vacuum(c, "chaos_pin") == (0, 100)
        held.release()
        assert "error" not in held.join(5)
        assert _vacuum(c, "chaos_pin") == (100, 0)
        c.execute("drop table chaos_pin")


def test_short_lock_timeout_applies_to_new_sessions_only_and_is_put_back(db_url):
    name = _dbname(db_url)
    with psycopg.connect(db_url, autocommit=True) as before:
        held = db_faults.short_lock_timeout(admin_url(), name, 150, seconds=1.0)
        assert held.detail == {**held.detail, "kind": "short_lock_timeout", "ms": 150, "before": None}
        assert _show(db_url, "lock_timeout") == "150ms"
        assert before.execute("show lock_timeout").fetchone()[0] == "0"  # a pooled connection keeps its own
        held.join(5)
    assert held.done and _show(db_url, "lock_timeout") == "0"

    with psycopg.connect(admin_url(), autocommit=True) as a:
        a.execute(f'alter database "{name}" set lock_timeout = \'7s\'')
        try:
            held = db_faults.short_lock_timeout(admin_url(), name, 50, seconds=0.2)
            assert held.detail["before"] == "7s" and _show(db_url, "lock_timeout") == "50ms"
            held.join(5)
            assert _show(db_url, "lock_timeout") == "7s"  # what it was, not the default
        finally:
            a.execute(f'alter database "{name}" reset lock_timeout')


def test_a_short_lock_timeout_fails_a_wait_on_a_held_row(conn, db_url):
    conn.execute("delete from resource_pool_shard where resource_key = 'chaos-lt'")
    conn.execute("insert into resource_pool_shard (resource_key, shard_no, capacity_units) values ('chaos-lt', 0, 5)")
    held = db_faults.hold_row_lock(db_url, "resource_pool_shard", "resource_key = 'chaos-lt'", None, seconds=3)
    short = db_faults.short_lock_timeout(admin_url(), _dbname(db_url), 100, seconds=3)
    try:
        with psycopg.connect(db_url, autocommit=True) as w:
            t0 = time.monotonic()
            with pytest.raises(errors.LockNotAvailable):
                w.execute("update resource_pool_shard set used_units = 1 where resource_key = 'chaos-lt'")
            assert time.monotonic() - t0 < 1
    finally:
        held.release()
        short.release()
        held.join(5)
        short.join(5)
    assert _show(db_url, "lock_timeout") == "0"
