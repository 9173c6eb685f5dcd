"""PostgreSQL faults the chaos injector inflicts on the database a run uses (issue 18, "Faults"): a
backend killed under a transaction, a hot row held by someone else, a snapshot that keeps vacuum
from cleaning up, and a lock_timeout short enough that waits fail. The platform must meet each one
as it would in production: retry, back off, or fail a request cleanly, and never lose or double a
write.

Each function returns a small dict of what it did, for faults.jsonl. The faults that last
(`hold_row_lock`, `pin_xmin`, `short_lock_timeout`) set themselves up before they return and then
run out their time in a background thread; they return a `Held`, whose `.detail` is that dict,
`.join()` waits for the end and `.release()` ends it early (the runner does when faults stop).

The side connections made here are named `aivedio-chaos-*` (application_name), and
`terminate_random_backends` spares them, so one fault does not end another early."""
from __future__ import annotations

import random
import threading
import time

import psycopg
from psycopg import sql

APP_PREFIX = "aivedio-chaos"
LOCK_WAIT = "5s"  # how long a side connection waits for its own row lock before giving up

CLIENT_BACKENDS = """
    select pid from pg_stat_activity
     where datname = %(db)s and backend_type = 'client backend' and pid <> pg_backend_pid()
       and coalesce(application_name, '') not like %(spare)s
     order by pid"""
# With a timeout (PostgreSQL 14+) it waits for the backend to be gone, so the fault has landed on return.
TERMINATE = "select pid, pg_terminate_backend(pid, 2000) as done from unnest(%(pids)s::int[]) as pid"
DATABASE_SETTINGS = """
    select s.setconfig from pg_db_role_setting s join pg_database d on d.oid = s.setdatabase
     where d.datname = %(db)s and s.setrole = 0"""


class Held:
    """A fault that lasts: the thread that ends it, and what it did."""

    def __init__(self, detail: dict, body):
        self.detail = detail
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(body,), daemon=True,
                                        name=f"{APP_PREFIX}-{detail['kind']}")
        self._thread.start()

    def _run(self, body) -> None:
        t0 = time.monotonic()
        try:
            body(self._release)
        except psycopg.Error as e:  # e.g. terminate_random_backends ended it: that is chaos too
            self.detail["error"] = f"{type(e).__name__}: {e}".strip()[:200]
        finally:
            self.detail["held_s"] = round(time.monotonic() - t0, 3)

    def release(self) -> None:
        self._release.set()

    def join(self, timeout: float | None = None) -> dict:
        self._thread.join(timeout)
        return self.detail

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()


def _side_connection(url: str, kind: str) -> psycopg.Connection:
    """A connection of the injector's own. It sets its timeouts itself, so neither a short
    lock_timeout fault nor a database's idle-in-transaction limit changes how long it holds."""
    c = psycopg.connect(url, application_name=f"{APP_PREFIX}-{kind}")
    c.execute(f"set lock_timeout = '{LOCK_WAIT}'")
    c.execute("set idle_in_transaction_session_timeout = 0")
    c.execute("set statement_timeout = 0")
    c.commit()
    return c


def terminate_random_backends(admin_url: str, dbname: str, rng: random.Random, n: int) -> dict:
    """pg_terminate_backend of up to n client backends of `dbname`, drawn by `rng` from the backends
    sorted by pid: the platform's pooled connections die under whatever they were doing. Never this
    connection, never another database, never the injector's own side connections."""
    with psycopg.connect(admin_url, autocommit=True, application_name=f"{APP_PREFIX}-terminate") as c:
        pids = [r[0] for r in c.execute(CLIENT_BACKENDS, {"db": dbname, "spare": APP_PREFIX + "%"}).fetchall()]
        chosen = sorted(rng.sample(pids, min(n, len(pids))))
        done = [pid for pid, ok in c.execute(TERMINATE, {"pids": chosen}).fetchall() if ok] if chosen else []
    return {"kind": "pg_terminate_backend", "database": dbname, "candidates": len(pids), "terminated": done}


def hold_row_lock(db_url: str, table: str, where_sql: str, params: dict | tuple | None, seconds: float) -> Held:
    """A side transaction that takes `select ... for update` on the rows of `table` matching
    `where_sql` (trusted SQL from the fault plan, with `params`), e.g. a hot wallet_account or a
    resource_pool_shard row, and holds the lock for `seconds`: the platform's writers of that row
    wait, time out or go elsewhere. The lock is held when this returns; when nothing matched, or
    the lock itself could not be had within LOCK_WAIT (detail["error"]), rows is 0 and it is over."""
    c = _side_connection(db_url, "row-lock")
    stmt = sql.SQL("select 1 from {} where {} for update").format(sql.Identifier(table), sql.SQL(where_sql))
    detail = {"kind": "hold_row_lock", "table": table, "where": where_sql, "seconds": seconds}
    try:
        detail["rows"] = len(c.execute(stmt, params).fetchall())
    except psycopg.Error as e:
        detail.update(rows=0, error=f"{type(e).__name__}: {e}".strip()[:200])
    if not detail["rows"]:  # nothing locked, nothing to hold
        c.close()
        return Held(detail, lambda release: None)

    return Held(detail, _until_released(c, seconds))


def _until_released(c: psycopg.Connection, seconds: float):
    """A Held body: keep the side connection's open transaction for `seconds` (or until released)."""
    def hold(release: threading.Event) -> None:
        try:
            release.wait(seconds)
            c.rollback()
        finally:
            c.close()

    return hold


def pin_xmin(db_url: str, seconds: float) -> Held:
    """A REPEATABLE READ transaction that has read (so holds a snapshot) and stays open for
    `seconds`: its xmin keeps vacuum from removing any row version deleted after it began, so dead
    tuples pile up on the hot tables (outbox, attempts, shards) as behind a forgotten session."""
    c = _side_connection(db_url, "pin-xmin")
    c.execute("begin isolation level repeatable read")
    xmin = c.execute("select pg_snapshot_xmin(pg_current_snapshot())::text").fetchone()[0]
    detail = {"kind": "pin_xmin", "xmin": xmin, "seconds": seconds}
    return Held(detail, _until_released(c, seconds))


def short_lock_timeout(admin_url: str, dbname: str, ms: int, seconds: float) -> Held:
    """`alter database X set lock_timeout` to `ms` for `seconds`, then back to what it was: a lock
    wait longer than that fails with 55P03 (lock_not_available), which the platform must treat as a
    retryable refusal. It applies to sessions that start while it is set only: connections already
    in a pool keep the lock_timeout they began with, so this bites as pools recycle (or after
    terminate_random_backends). If the injector dies before the end, the setting stays: the run's
    database is a throwaway."""
    ident = sql.Identifier(dbname)
    with psycopg.connect(admin_url, autocommit=True, application_name=f"{APP_PREFIX}-lock-timeout") as c:
        row = c.execute(DATABASE_SETTINGS, {"db": dbname}).fetchone()
        before = next((s.split("=", 1)[1] for s in (row[0] if row else None) or [] if s.startswith("lock_timeout=")), None)
        c.execute(sql.SQL("alter database {} set lock_timeout = {}").format(ident, sql.Literal(f"{int(ms)}ms")))
    detail = {"kind": "short_lock_timeout", "database": dbname, "ms": int(ms), "seconds": seconds, "before": before}

    def hold(release: threading.Event) -> None:
        release.wait(seconds)
        with psycopg.connect(admin_url, autocommit=True, application_name=f"{APP_PREFIX}-lock-timeout") as c:
            if before is None:
                c.execute(sql.SQL("alter database {} reset lock_timeout").format(ident))
            else:
                c.execute(sql.SQL("alter database {} set lock_timeout = {}").format(ident, sql.Literal(before)))

    return Held(detail, hold)
