"""Operators of the admin API (issue 16): admin tokens `avop_...` shown once and stored as sha256 only,
rotate and revoke (the old token stops working on commit), a tenant API key refused as FORBIDDEN, an
admin token unknown to the tenant API, every write audited without the token, the CLI as typed
(`aivedio admin operator create|rotate|revoke|list`), and the admin routes."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import uuid

import psycopg
import pytest
from psycopg.rows import dict_row

from aivedio import auth
from aivedio.admin import operators
from aivedio import audit
from aivedio.policy import roles
from aivedio.admin.operators import ADMIN_TOKEN_PREFIX, authenticate_operator, create_operator, list_operators
from aivedio.admin.operators import revoke_operator, rotate_operator_token
from aivedio.errors import Conflict, Forbidden, InvalidRequest, NotFound, Unauthenticated
from tests.admission_support import new_tenant


def _name() -> str:
    return f"op-{uuid.uuid4().hex[:8]}"


def _create(platform, role="viewer", name=None, actor="cli:test"):
    return platform.db.transaction(lambda c: create_operator(c, actor=actor, name=name or _name(), role=role))


def _auth(platform, authorization, **kw):
    with platform.db.connection() as c:
        return authenticate_operator(c, authorization, **kw)


def _session(platform, op, token: str, max_age_seconds: int = 3600) -> str:
    return platform.db.transaction(lambda c: operators.open_session(c, op, token, max_age_seconds=max_age_seconds))


def _audit_rows(conn, target: str) -> list[dict]:
    return conn.execute("select * from audit_log where target = %s order by audit_id", (target,)).fetchall()


def test_a_token_is_shown_once_stored_hashed_and_authenticates(platform, conn):
    issued = _create(platform, role="admin", actor="ops-jane")
    assert issued.token.startswith(ADMIN_TOKEN_PREFIX) and len(issued.token) > 40
    assert set(issued.as_dict()) == {"operator_id", "name", "role", "token"}
    row = conn.execute("select * from operator_account where operator_id = %s", (issued.operator_id,)).fetchone()
    assert row["token_hash"] == hashlib.sha256(issued.token.encode()).hexdigest()
    assert issued.token not in json.dumps(row, default=str)  # only the hash (and a short prefix) is kept
    assert row["token_prefix"] == issued.token[:12] and row["created_by"] == "ops-jane" and row["revoked_at"] is None

    op = _auth(platform, f"Bearer {issued.token}")
    assert (op.operator_id, op.name, op.role, op.audit_name) == (issued.operator_id, issued.name, "admin", f"op:{issued.name}")
    # The dashboard's session cookie holds a session id, never the token itself.
    assert _auth(platform, None, session_id=_session(platform, op, issued.token)) == op
    with pytest.raises(Unauthenticated):
        _auth(platform, None, session_id=issued.token)
    assert _auth(platform, "bearer " + issued.token) == op  # the scheme is case-insensitive

    [a] = _audit_rows(conn, f"operator:{issued.operator_id}")
    assert (a["operator"], a["action"], a["new_value"]["role"]) == ("ops-jane", "operator.create", "admin")
    assert issued.token not in json.dumps(a, default=str) and row["token_hash"] not in json.dumps(a, default=str)

    listed = {o["operator_id"]: o for o in platform.db.transaction(list_operators)}
    assert listed[str(issued.operator_id)]["status"] == "ACTIVE"
    assert issued.token not in json.dumps(listed) and row["token_hash"] not in json.dumps(listed)


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer ", "Basic abc", "Bearer avop_unknown",
                                           "Bearer av_notakey", "Bearer something", "Bearer avop_" + "x" * 300])
def test_missing_or_unknown_tokens_are_unauthenticated(platform, authorization):
    with pytest.raises(Unauthenticated) as e:
        _auth(platform, authorization)
    assert e.value.code == "UNAUTHENTICATED"


def test_a_tenant_key_is_forbidden_on_the_admin_api_and_an_admin_token_unknown_on_the_tenant_api(platform):
    t = new_tenant(platform)
    with pytest.raises(Forbidden) as e:
        _auth(platform, f"Bearer {t.api_key}")
    assert e.value.code == "FORBIDDEN"
    issued = _create(platform)
    with platform.db.connection() as c, pytest.raises(Unauthenticated):
        auth.authenticate(c, f"Bearer {issued.token}")
    # a revoked tenant key is just unknown
    with platform.db.connection() as c:
        c.execute("update api_key set revoked_at = now() where tenant_id = %s", (t.tenant_id,))
        c.commit()
    with pytest.raises(Unauthenticated):
        _auth(platform, f"Bearer {t.api_key}")


def test_rotate_replaces_the_token_and_revoke_ends_it(platform, conn):
    issued = _create(platform, role="operator")
    rotated = platform.db.transaction(lambda c: rotate_operator_token(c, actor="ops-jane", operator_id=issued.operator_id))
    assert rotated.operator_id == issued.operator_id and rotated.token != issued.token
    assert rotated.token.startswith(ADMIN_TOKEN_PREFIX)
    with pytest.raises(Unauthenticated):
        _auth(platform, f"Bearer {issued.token}")
    assert _auth(platform, f"Bearer {rotated.token}").role == "operator"

    out = platform.db.transaction(lambda c: revoke_operator(c, actor="ops-jane", operator_id=issued.operator_id))
    assert out["revoked"] is True and out["status"] == "REVOKED" and out["revoked_at"]
    with pytest.raises(Unauthenticated):
        _auth(platform, f"Bearer {rotated.token}")
    again = platform.db.transaction(lambda c: revoke_operator(c, actor="ops-jane", operator_id=issued.operator_id))
    assert again["revoked"] is False and again["status"] == "REVOKED"  # changes nothing, audits nothing
    with pytest.raises(Conflict):
        platform.db.transaction(lambda c: rotate_operator_token(c, actor="ops-jane", operator_id=issued.operator_id))

    audited = _audit_rows(conn, f"operator:{issued.operator_id}")
    assert [a["action"] for a in audited] == ["operator.create", "operator.rotate", "operator.revoke"]
    blob = json.dumps(audited, default=str)
    assert issued.token not in blob and rotated.token not in blob
    assert hashlib.sha256(rotated.token.encode()).hexdigest() not in blob

    missing = uuid.uuid4()
    for fn in (rotate_operator_token, revoke_operator):
        with pytest.raises(NotFound):
            platform.db.transaction(lambda c: fn(c, actor="x", operator_id=missing))


@pytest.mark.parametrize("name, role, field", [("ok-name", "superuser", "role"), ("ok-name", "ADMIN", "role"),
                                               ("ok-name", "BILLING_ADMIN", "role"), ("", "viewer", "name"),
                                               ("   ", "viewer", "name"), ("x" * 65, "viewer", "name"),
                                               ("tab\there", "viewer", "name"), (None, "viewer", "name")])
def test_bad_input_names_the_field_and_writes_nothing(platform, conn, name, role, field):
    before = conn.execute("select (select count(*) from operator_account) o, (select count(*) from audit_log) a").fetchone()
    with pytest.raises(InvalidRequest) as e:
        platform.db.transaction(lambda c: create_operator(c, actor="x", name=name, role=role))
    assert set(e.value.fields) == {field}
    after = conn.execute("select (select count(*) from operator_account) o, (select count(*) from audit_log) a").fetchone()
    assert after == before


def test_a_duplicate_name_is_a_conflict(platform):
    name = _name()
    _create(platform, name=name)
    with pytest.raises(Conflict) as e:
        _create(platform, name=name, role="admin")
    assert e.value.code == "CONFLICT"


def test_the_roles(platform, conn):
    assert roles.allowed("viewer", "audit.read") and not roles.allowed("viewer", "policy.write")
    assert roles.allowed("admin", "refund.approve") and roles.allowed("finance", "refund.approve")
    assert not roles.allowed("operator", "refund.approve") and not roles.allowed("nobody", "audit.read")
    assert conn.execute("select to_regclass('operator_role') as t").fetchone()["t"] is None  # one role model (0250)


def test_a_denied_attempt_is_audited_in_its_own_transaction(platform, conn):
    audit.append_denied(platform, operator="op:viewer-1", action="policy.write", target="PATCH /admin/v1/tenants/x/policy",
                        reason="role viewer lacks policy.write")
    [row] = conn.execute("select * from audit_log where operator = 'op:viewer-1'").fetchall()
    assert row["action"] == "policy.write.denied" and row["new_value"]["outcome"] == "DENIED"
    assert row["reason"] == "role viewer lacks policy.write" and row["row_hash"]


# --- the CLI, as a user types it -------------------------------------------------------------------------------

def _aivedio(env: dict, *args: str) -> tuple[int, dict | None, str]:
    done = subprocess.run([sys.executable, "-m", "aivedio_tools.cli", *args], env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout.strip()
    return done.returncode, (json.loads(out) if out else None), done.stderr


def test_the_cli_creates_rotates_revokes_and_lists_operators(db_url, redis_url, redis_prefix, make_platform):
    env = {"AIVEDIO_DATABASE_URL": db_url, "AIVEDIO_REDIS_URL": redis_url, "AIVEDIO_REDIS_PREFIX": redis_prefix,
           "PATH": "/usr/bin:/bin"}
    name = _name()
    rc, made, err = _aivedio(env, "admin", "operator", "create", "--name", name, "--role", "admin", "--json")
    assert rc == 0, err
    assert {"operator_id", "token"} <= set(made) and made["token"].startswith("avop_") and made["role"] == "admin"
    p = make_platform()
    assert _auth(p, f"Bearer {made['token']}").name == name

    rc, again, _ = _aivedio(env, "admin", "operator", "create", "--name", name, "--role", "viewer", "--json")
    assert rc == 1 and again["error"] == "CONFLICT"
    rc, _, stderr = _aivedio(env, "admin", "operator", "create", "--name", _name(), "--role", "root", "--json")
    assert rc == 2 and "invalid choice" in stderr

    rc, rotated, _ = _aivedio(env, "admin", "operator", "rotate", "--operator-id", made["operator_id"], "--operator", "ops-jane",
                              "--json")
    assert rc == 0 and rotated["operator_id"] == made["operator_id"] and rotated["token"] != made["token"]
    with pytest.raises(Unauthenticated):
        _auth(p, f"Bearer {made['token']}")

    rc, listed, _ = _aivedio(env, "admin", "operator", "list", "--json")
    assert rc == 0 and [o["status"] for o in listed["items"] if o["operator_id"] == made["operator_id"]] == ["ACTIVE"]
    assert rotated["token"] not in json.dumps(listed)

    rc, revoked, _ = _aivedio(env, "admin", "operator", "revoke", "--operator-id", made["operator_id"], "--json")
    assert rc == 0 and revoked["status"] == "REVOKED"
    with pytest.raises(Unauthenticated):
        _auth(p, f"Bearer {rotated['token']}")
    rc, missing, _ = _aivedio(env, "admin", "operator", "revoke", "--operator-id", str(uuid.uuid4()), "--json")
    assert rc == 1 and missing["error"] == "NOT_FOUND"

    with psycopg.connect(db_url, row_factory=dict_row) as c:
        audited = _audit_rows(c, f"operator:{made['operator_id']}")
    assert [(a["action"], a["operator"].startswith("cli:") or a["operator"]) for a in audited] == [
        ("operator.create", True), ("operator.rotate", "ops-jane"), ("operator.revoke", True)]
    assert made["token"] not in json.dumps(audited, default=str) and rotated["token"] not in json.dumps(audited, default=str)

    # One role model: the CLI's old `grant` and its roles are gone, and --operator only names who acts,
    # even the name of an operator just revoked (the CLI holds the database's credentials).
    rc, _, stderr = _aivedio(env, "admin", "operator", "grant", "--grantee", _name(), "--role", "SUPPORT", "--json")
    assert rc == 2 and "invalid choice" in stderr
    rc, listed_again, err = _aivedio(env, "admin", "operator", "list", "--operator", f"op:{name}", "--json")
    assert rc == 0 and made["operator_id"] in {o["operator_id"] for o in listed_again["items"]}, err


# --- the admin routes ---------------------------------------------------------------------------------------

def _admin(platform, method: str, path: str, token: str | None, body: dict | None = None, query: str = "") -> tuple[int, dict]:
    from aivedio.context import set_platform
    from aivedio_tools.local.apigw import to_event
    from aivedio_tools.local.lambda_context import FakeLambdaContext
    from functions.admin_api.handler import lambda_handler

    set_platform(platform)
    headers = [("Authorization", f"Bearer {token}")] if token else []
    raw = b""
    if body is not None:
        headers.append(("Content-Type", "application/json"))
        raw = json.dumps(body).encode()
    resp = lambda_handler(to_event(method, path, query, headers, raw), FakeLambdaContext("aivedio-admin-api"))
    return resp["statusCode"], json.loads(resp["body"]) if resp.get("body") else {}


def test_the_operator_routes_are_admin_only(platform, conn):
    admin = _create(platform, role="admin")
    viewer = _create(platform, role="viewer")

    status, made = _admin(platform, "POST", "/admin/v1/operators", admin.token, {"name": (n := _name()), "role": "finance"})
    assert status == 201 and made["token"].startswith("avop_") and made["role"] == "finance", made
    assert _auth(platform, f"Bearer {made['token']}").role == "finance"
    [a] = _audit_rows(conn, f"operator:{made['operator_id']}")
    assert a["operator"] == f"op:{admin.name}"

    status, err = _admin(platform, "POST", "/admin/v1/operators", admin.token, {"name": n, "role": "finance"})
    assert status == 409 and err["error"] == "CONFLICT"
    status, err = _admin(platform, "POST", "/admin/v1/operators", admin.token, {"name": _name(), "role": "god"})
    assert status == 422 and "role" in json.dumps(err["details"]), err

    status, err = _admin(platform, "POST", "/admin/v1/operators", viewer.token, {"name": _name(), "role": "admin"})
    assert status == 403 and err["error"] == "FORBIDDEN"
    denied = conn.execute("select * from audit_log where operator = %s and action like '%%.denied'",
                          (f"op:{viewer.name}",)).fetchall()
    assert [d["action"] for d in denied] == ["operator.manage.denied"]

    status, listed = _admin(platform, "GET", "/admin/v1/operators", admin.token)
    assert status == 200 and made["operator_id"] in {o["operator_id"] for o in listed["items"]}
    assert made["token"] not in json.dumps(listed)

    status, rotated = _admin(platform, "POST", f"/admin/v1/operators/{made['operator_id']}/rotate", admin.token)
    assert status == 200 and rotated["token"] != made["token"]
    status, revoked = _admin(platform, "DELETE", f"/admin/v1/operators/{made['operator_id']}", admin.token)
    assert status == 200 and revoked["status"] == "REVOKED"
    status, err = _admin(platform, "GET", "/admin/v1/operators", rotated["token"])
    assert status == 401 and err["error"] == "UNAUTHENTICATED"
    for path in (f"/admin/v1/operators/{uuid.uuid4()}", "/admin/v1/operators/not-a-uuid"):
        status, err = _admin(platform, "DELETE", path, admin.token)
        assert status == 404 and err["error"] == "NOT_FOUND"

    t = new_tenant(platform)
    status, err = _admin(platform, "GET", "/admin/v1/operators", t.api_key)
    assert status == 403 and err["error"] == "FORBIDDEN"
    status, err = _admin(platform, "GET", "/admin/v1/operators", None)
    assert status == 401 and err["error"] == "UNAUTHENTICATED"


def test_the_module_exports_what_the_brief_promises():
    assert operators.ROLES == roles.ROLES == ("viewer", "operator", "finance", "admin")
    assert operators.Operator(uuid.uuid4(), "n", "viewer").audit_name == "op:n"


def test_a_dashboard_session_ends_on_sign_out_expiry_rotation_and_revocation(platform, conn):
    issued = _create(platform, role="viewer")
    op = _auth(platform, f"Bearer {issued.token}")
    sid = _session(platform, op, issued.token)
    assert sid.startswith(operators.SESSION_PREFIX) and len(sid) > 40
    [row] = conn.execute("select * from operator_session where operator_id = %s", (op.operator_id,)).fetchall()
    assert row["session_hash"] == hashlib.sha256(sid.encode()).hexdigest()
    assert sid not in json.dumps(row, default=str) and issued.token not in json.dumps(row, default=str)

    # Sign-out ends it at once; a second sign-out finds nothing.
    assert _auth(platform, None, session_id=sid) == op
    assert platform.db.transaction(lambda c: operators.end_session(c, sid)) is True
    assert platform.db.transaction(lambda c: operators.end_session(c, sid)) is False
    for bad in (sid, "avds_unknown", "avds_" + "x" * 300, "", "   ", issued.token):
        with pytest.raises(Unauthenticated):
            _auth(platform, None, session_id=bad)

    # Expiry is the database's, not only the cookie's Max-Age.
    expiring = _session(platform, op, issued.token)
    conn.execute("update operator_session set created_at = now() - interval '2 hours', expires_at = now() - interval '1 second'"
                 " where session_hash = %s", (operators.hash_token(expiring),))
    with pytest.raises(Unauthenticated):
        _auth(platform, None, session_id=expiring)

    # A rotation ends the sessions opened with the old token; the new token opens new ones.
    old_session = _session(platform, op, issued.token)
    rotated = platform.db.transaction(lambda c: rotate_operator_token(c, actor="t", operator_id=op.operator_id))
    with pytest.raises(Unauthenticated):
        _auth(platform, None, session_id=old_session)
    with pytest.raises(Unauthenticated):
        _session(platform, op, issued.token)  # the old token cannot open one either
    fresh = _session(platform, op, rotated.token)
    assert _auth(platform, None, session_id=fresh) == op

    # Revocation ends every session of the operator.
    platform.db.transaction(lambda c: revoke_operator(c, actor="t", operator_id=op.operator_id))
    with pytest.raises(Unauthenticated):
        _auth(platform, None, session_id=fresh)

    # A bearer header, even a bad one, is read first; a session is read only without one.
    other = _create(platform, role="admin")
    other_op = _auth(platform, f"Bearer {other.token}")
    other_sid = _session(platform, other_op, other.token)
    assert _auth(platform, "Basic abc", session_id=other_sid) == other_op  # not a bearer: the session counts
    with pytest.raises(Unauthenticated):
        _auth(platform, "Bearer avop_unknown", session_id=other_sid)


def test_sessions_that_expired_a_day_ago_are_deleted_at_the_next_sign_in(platform, conn):
    issued = _create(platform, role="viewer")
    op = _auth(platform, f"Bearer {issued.token}")
    stale, recent = _session(platform, op, issued.token), _session(platform, op, issued.token)
    for sid, ago in ((stale, "2 days"), (recent, "1 hour")):
        conn.execute("update operator_session set created_at = now() - interval '3 days', expires_at = now() - %s::interval"
                     " where session_hash = %s", (ago, operators.hash_token(sid)))
    _session(platform, op, issued.token)
    left = {r["session_hash"] for r in conn.execute("select session_hash from operator_session where operator_id = %s",
                                                    (op.operator_id,)).fetchall()}
    assert operators.hash_token(stale) not in left and operators.hash_token(recent) in left and len(left) == 2
