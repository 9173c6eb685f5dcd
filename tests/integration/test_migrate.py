"""`aivedio db migrate` is tracked, idempotent, and safe from several processes at once."""
import os
import subprocess
import sys
import uuid

import psycopg
from psycopg import sql

from aivedio.db.migrate import discover
from tests.conftest import _with_db, admin_url


def _run_migrate(url: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIVEDIO_")}
    env["AIVEDIO_DATABASE_URL"] = url
    return subprocess.Popen([sys.executable, "-m", "aivedio_tools.cli", "db", "migrate", "--json"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_parallel_migrations_leave_one_schema():
    name = f"aivedio_mig_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url(), autocommit=True) as c:
        c.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    url = _with_db(admin_url(), name)
    try:
        procs = [_run_migrate(url) for _ in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        versions = [m.version for m in discover()]
        applied = sorted(v for out, _ in outs for v in __import__("json").loads(out)["applied"])
        assert applied == versions  # each migration applied exactly once, by one of the two
        with psycopg.connect(url) as c:
            rows = c.execute("select version from schema_migration order by version").fetchall()
            assert [r[0] for r in rows] == versions
        again = _run_migrate(url)
        out, err = again.communicate(timeout=60)
        assert again.returncode == 0, err
        assert __import__("json").loads(out) == {"applied": []}
    finally:
        with psycopg.connect(admin_url(), autocommit=True) as c:
            c.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


def test_unreachable_database_fails_with_one_clear_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIVEDIO_")}
    env["AIVEDIO_DATABASE_URL"] = "postgresql://postgres:secret@127.0.0.1:1/nope"
    p = subprocess.run([sys.executable, "-m", "aivedio_tools.cli", "db", "migrate"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("aivedio: database postgresql://postgres:***@127.0.0.1:1/nope: unreachable")
    assert "secret" not in p.stderr
