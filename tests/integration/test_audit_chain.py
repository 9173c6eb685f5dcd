"""The chained audit log (issue 16, migration 0150): each row carries its predecessor's hash and its
own; concurrent writers from many connections still make one verifiable chain; an edited row, a
deleted middle row, a deleted first row and a deleted tail each make verify fail and name the row;
`aivedio admin audit list|verify` as typed (verify exits 1 on a broken chain); the migration chains
rows that existed before it; the audit routes. Tampering tests each get a database of their own."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid

import psycopg
import pytest
from psycopg.rows import dict_row

from aivedio import audit
from aivedio.audit import list_audit, verify
from aivedio.admin.operators import create_operator
from aivedio.db.migrate import migrate
from aivedio.errors import InvalidRequest
from tests.conftest import create_test_database, database_migrated_before, drop_test_database


@pytest.fixture
def fresh_url():
    url = create_test_database("audit_chain")
    yield url
    drop_test_database(url)


def _connect(url: str, **kw) -> psycopg.Connection:
    return psycopg.connect(url, row_factory=dict_row, **kw)


def _write(url: str, n: int, *, prefix: str = "w") -> list[int]:
    with _connect(url) as c:
        for i in range(n):
            audit.append(c, operator=f"{prefix}-op", action="test.write", target=f"{prefix}:{i}", tenant_id=uuid.uuid4(),
                         old={"i": i, "nested": {"b": 1, "a": [1, 2]}}, new={"i": i + 1, "s": "é ✓"}, reason=f"r{i}",
                         policy_version=i)
            c.commit()
        return [r["audit_id"] for r in c.execute("select audit_id from audit_log where operator = %s order by audit_id",
                                                 (f"{prefix}-op",)).fetchall()]


def _verify(url: str) -> dict:
    with _connect(url) as c:
        return verify(c)


def _tamper(url: str, statement: str, *params) -> None:
    """What someone with the table owner's rights could do: switch the append-only guard off, write, switch it on."""
    with _connect(url) as c:
        c.execute("alter table audit_log disable trigger audit_log_append_only")
        c.execute(statement, params)
        c.execute("alter table audit_log enable trigger audit_log_append_only")


def test_each_row_links_to_the_one_before_and_verifies(fresh_url):
    ids = _write(fresh_url, 5)
    with _connect(fresh_url) as c:
        rows = c.execute("select * from audit_log order by audit_id").fetchall()
        head = c.execute("select * from audit_chain_head").fetchone()
        recomputed = c.execute(
            """select audit_id, aivedio_audit_row_hash(audit_id, tenant_id, operator, action, target, old_value, new_value,
                      reason, policy_version, created_at, prev_hash) = row_hash as same from audit_log""").fetchall()
    assert [r["audit_id"] for r in rows][-5:] == ids and ids == sorted(ids)
    assert rows[0]["prev_hash"] is None
    assert all(b["prev_hash"] == a["row_hash"] for a, b in zip(rows, rows[1:]))
    assert all(r["same"] for r in recomputed) and all(len(r["row_hash"]) == 64 for r in rows)
    assert (head["last_audit_id"], head["last_hash"]) == (rows[-1]["audit_id"], rows[-1]["row_hash"])
    doc = _verify(fresh_url)
    assert doc["ok"] is True and doc["rows_checked"] == len(rows) and doc["first_bad_audit_id"] is None, doc
    assert doc["problem"] is None

    # the hash is a function of the row, not of the session's TimeZone or DateStyle
    with _connect(fresh_url) as c:
        c.execute("set timezone = 'Asia/Kathmandu'")
        c.execute("set datestyle = 'SQL, DMY'")
        assert verify(c)["ok"] is True

    # a supplied hash is ignored: the trigger computes its own
    with _connect(fresh_url) as c:
        r = c.execute("insert into audit_log (operator, action, target, prev_hash, row_hash) values ('x', 'y', 'z', 'p', 'h') "
                      "returning prev_hash, row_hash").fetchone()
        c.commit()
    assert r["prev_hash"] == rows[-1]["row_hash"] and r["row_hash"] != "h"
    assert _verify(fresh_url)["ok"] is True


def test_concurrent_writers_on_many_connections_make_one_chain(fresh_url):
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(k: int) -> None:
        try:
            start.wait()
            with _connect(fresh_url) as c:
                for i in range(25):
                    for j in range(1 + i % 3):  # one to three rows per transaction
                        audit.append(c, operator=f"t{k}", action="test.concurrent", target=f"{k}:{i}:{j}", new={"k": k})
                    if i % 7 == 6:
                        c.rollback()  # a transaction that never commits leaves no link
                    else:
                        c.commit()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    with _connect(fresh_url) as c:
        n = c.execute("select count(*) n from audit_log where action = 'test.concurrent'").fetchone()["n"]
    committed_per_worker = sum(1 + i % 3 for i in range(25) if i % 7 != 6)
    assert n == 8 * committed_per_worker
    doc = _verify(fresh_url)
    assert doc["ok"] is True and doc["rows_checked"] >= n, doc


def test_an_edited_row_fails_verify_and_is_named(fresh_url):
    ids = _write(fresh_url, 6)
    _tamper(fresh_url, "update audit_log set reason = 'nothing to see' where audit_id = %s", ids[2])
    doc = _verify(fresh_url)
    assert doc["ok"] is False and doc["first_bad_audit_id"] == ids[2] and doc["problem_code"] == "HASH_MISMATCH", doc
    assert str(ids[2]) in doc["problem"]


@pytest.mark.parametrize("column, value", [("new_value", '{"i": 999}'), ("operator", "someone-else"),
                                           ("created_at", "2001-01-01T00:00:00Z"), ("policy_version", "77"),
                                           ("tenant_id", None)])
def test_editing_any_column_is_caught(fresh_url, column, value):
    ids = _write(fresh_url, 3)
    _tamper(fresh_url, f"update audit_log set {column} = %s where audit_id = %s", value, ids[1])
    doc = _verify(fresh_url)
    assert doc["ok"] is False and doc["first_bad_audit_id"] == ids[1], doc


def test_a_rehashed_edit_still_breaks_the_next_link(fresh_url):
    ids = _write(fresh_url, 4)
    _tamper(fresh_url, """update audit_log set reason = 'forged',
                          row_hash = aivedio_audit_row_hash(audit_id, tenant_id, operator, action, target, old_value, new_value,
                                                            'forged', policy_version, created_at, prev_hash)
                          where audit_id = %s""", ids[1])
    doc = _verify(fresh_url)
    assert doc["ok"] is False and doc["first_bad_audit_id"] == ids[2] and doc["problem_code"] == "LINK_BROKEN", doc


def test_a_deleted_middle_row_fails_verify(fresh_url):
    ids = _write(fresh_url, 5)
    _tamper(fresh_url, "delete from audit_log where audit_id = %s", ids[2])
    doc = _verify(fresh_url)
    assert doc["ok"] is False and doc["first_bad_audit_id"] == ids[3] and doc["problem_code"] == "LINK_BROKEN", doc


def test_a_deleted_last_row_fails_verify(fresh_url):
    ids = _write(fresh_url, 5)
    _tamper(fresh_url, "delete from audit_log where audit_id = %s", ids[-1])
    doc = _verify(fresh_url)
    assert doc["ok"] is False and doc["first_bad_audit_id"] == ids[-1] and doc["problem_code"] == "TAIL", doc
    assert str(ids[-2]) in doc["problem"]


def test_a_deleted_first_row_and_an_emptied_log_fail_verify(fresh_url):
    _write(fresh_url, 3)
    with _connect(fresh_url) as c:
        first = c.execute("select min(audit_id) m from audit_log").fetchone()["m"]
    _tamper(fresh_url, "delete from audit_log where audit_id = %s", first)
    doc = _verify(fresh_url)
    assert doc["ok"] is False and doc["problem_code"] == "FIRST_LINK" and doc["first_bad_audit_id"] > first, doc
    _tamper(fresh_url, "delete from audit_log")
    doc = _verify(fresh_url)
    assert doc["ok"] is False and doc["problem_code"] == "TAIL" and doc["rows_checked"] == 0, doc


def test_list_is_newest_first_and_pages_with_an_opaque_cursor(fresh_url):
    ids = _write(fresh_url, 7, prefix="page")
    with _connect(fresh_url) as c:
        total = c.execute("select count(*) n from audit_log").fetchone()["n"]
        seen, cursor = [], None
        while True:
            page = list_audit(c, limit=3, cursor=cursor)
            assert len(page["items"]) <= 3
            seen += page["items"]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        first = list_audit(c, limit=1)["items"][0]
        for bad in ("nope", "eyJ4IjogMX0", "!!"):
            with pytest.raises(InvalidRequest) as e:
                list_audit(c, limit=3, cursor=bad)
            assert set(e.value.fields) == {"cursor"}
        for bad in (0, 501, -1):
            with pytest.raises(InvalidRequest):
                list_audit(c, limit=bad)
    assert [i["audit_id"] for i in seen] == sorted((i["audit_id"] for i in seen), reverse=True) and len(seen) == total
    assert first["audit_id"] == ids[-1]
    assert set(first) >= {"audit_id", "operator", "operation", "target", "old_value", "new_value", "reason",
                          "policy_version", "created_at"}
    assert first["operation"] == "test.write" and first["operator"] == "page-op" and first["policy_version"] == 6
    assert first["new_value"] == {"i": 7, "s": "é ✓"}


def _aivedio(url: str, *args: str) -> tuple[int, dict | None, str]:
    env = {"AIVEDIO_DATABASE_URL": url, "AIVEDIO_REDIS_URL": "none", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "aivedio_tools.cli", *args], env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout.strip()
    return done.returncode, (json.loads(out) if out and "--json" in args else None), done.stderr


def test_the_cli_lists_and_verifies_as_typed(fresh_url):
    rc, made, err = _aivedio(fresh_url, "admin", "operator", "create", "--name", "root-admin", "--role", "admin", "--json")
    assert rc == 0, err
    ids = _write(fresh_url, 4)
    rc, page, err = _aivedio(fresh_url, "admin", "audit", "list", "--limit", "2", "--json")
    assert rc == 0 and [i["audit_id"] for i in page["items"]] == ids[::-1][:2] and page["next_cursor"], err
    rc, rest, _ = _aivedio(fresh_url, "admin", "audit", "list", "--limit", "50", "--cursor", page["next_cursor"], "--json")
    assert rc == 0 and [i["operation"] for i in rest["items"]][-1] == "operator.create"
    assert made["token"] not in json.dumps(rest)
    rc, doc, _ = _aivedio(fresh_url, "admin", "audit", "verify", "--json")
    assert rc == 0 and doc["ok"] is True and doc["rows_checked"] == 5

    _tamper(fresh_url, "update audit_log set new_value = '{\"i\": 0}' where audit_id = %s", ids[1])
    rc, doc, _ = _aivedio(fresh_url, "admin", "audit", "verify", "--json")
    assert rc == 1 and doc["ok"] is False and doc["first_bad_audit_id"] == ids[1], doc
    rc, _, stderr = _aivedio(fresh_url, "admin", "audit", "verify")
    assert rc == 1 and "broken" in stderr
    rc, err, _ = _aivedio(fresh_url, "admin", "audit", "list", "--cursor", "garbage", "--json")
    assert rc == 1 and err["error"] == "VALIDATION_ERROR" and "cursor" in err["details"]["fields"]


def test_the_migration_chains_the_rows_that_were_there_before_it(tmp_path):
    url = database_migrated_before(tmp_path, 150, "backfill")
    try:
        with psycopg.connect(url) as c:
            for i in range(4):
                c.execute("insert into audit_log (operator, action, target, new_value, created_at) "
                          "values (%s, 'old.write', %s, %s, now() - make_interval(days => %s))",
                          (f"old-{i}", f"t:{i}", json.dumps({"i": i}), 10 - i))
        migrate(url)
        with _connect(url) as c:
            rows = c.execute("select * from audit_log order by audit_id").fetchall()
            assert len(rows) == 4 and rows[0]["prev_hash"] is None and all(r["row_hash"] for r in rows)
            assert verify(c)["ok"] is True
            create_operator(c, actor="after", name="after", role="viewer")  # new rows continue the chain
            c.commit()
            doc = verify(c)
            assert doc["ok"] is True and doc["rows_checked"] == 5
            with pytest.raises(psycopg.errors.RaiseException):  # still append-only after the backfill
                c.execute("update audit_log set reason = 'x' where audit_id = %s", (rows[0]["audit_id"],))
    finally:
        drop_test_database(url)


def test_the_audit_routes(fresh_url, redis_url, redis_prefix):
    from aivedio.config import PlatformConfig, Settings
    from aivedio.context import build_platform, set_platform
    from aivedio_tools.local.apigw import to_event
    from aivedio_tools.local.lambda_context import FakeLambdaContext
    from functions.admin_api.handler import lambda_handler
    from tests.conftest import TEST_HOME

    p = build_platform(Settings(database_url=fresh_url, redis_url=redis_url, redis_prefix=redis_prefix, home=TEST_HOME),
                       PlatformConfig())
    try:
        set_platform(p)
        made = {role: p.db.transaction(lambda c: create_operator(c, actor="t", name=f"{role}-1", role=role))
                for role in ("viewer", "admin")}

        def call(method, path, token, query=""):
            resp = lambda_handler(to_event(method, path, query, [("Authorization", f"Bearer {token}")]),
                                  FakeLambdaContext("aivedio-admin-api"))
            return resp["statusCode"], json.loads(resp["body"])

        status, page = call("GET", "/admin/v1/audit", made["viewer"].token, "limit=1")
        assert status == 200 and len(page["items"]) == 1 and page["next_cursor"]
        assert page["items"][0]["operation"] == "operator.create"
        status, page2 = call("GET", "/admin/v1/audit", made["viewer"].token, f"limit=5&cursor={page['next_cursor']}")
        assert status == 200 and page2["items"][0]["audit_id"] < page["items"][0]["audit_id"]
        status, err = call("GET", "/admin/v1/audit", made["viewer"].token, "limit=0")
        assert status == 422 and err["error"] == "VALIDATION_ERROR"
        status, err = call("GET", "/admin/v1/audit", made["viewer"].token, "cursor=garbage")
        assert status == 422 and "cursor" in err["details"]["fields"], err

        status, err = call("POST", "/admin/v1/audit/verify", made["viewer"].token)
        assert status == 403 and err["error"] == "FORBIDDEN"
        status, doc = call("POST", "/admin/v1/audit/verify", made["admin"].token)
        assert status == 200 and doc["ok"] is True and doc["rows_checked"] == 3, doc  # two creates and the denial
        _tamper(fresh_url, "update audit_log set reason = 'x' where action = 'operator.create' and target like %s",
                f"operator:{made['admin'].operator_id}")
        status, doc = call("POST", "/admin/v1/audit/verify", made["admin"].token)
        assert status == 200 and doc["ok"] is False and doc["problem_code"] == "HASH_MISMATCH"
    finally:
        set_platform(None)
        p.close()


def test_audit_module_constants():
    assert audit.DEFAULT_LIMIT <= audit.MAX_LIMIT
