"""`aivedio admin user create` (docs/operations.md) as a user types it: another user of a tenant
with its own API key (shown once), its own per-user limits, audited; an unknown tenant is NOT_FOUND."""
from __future__ import annotations

import json
import subprocess
import sys

import psycopg

from aivedio import auth


def _aivedio(env: dict, *args: str) -> tuple[int, dict | None, str]:
    done = subprocess.run([sys.executable, "-m", "aivedio_tools.cli", *args], env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout.strip()
    return done.returncode, (json.loads(out) if out else None), done.stderr


def test_a_second_user_gets_its_own_key_and_limits_and_is_audited(db_url, redis_url, redis_prefix, make_platform):
    env = {"AIVEDIO_DATABASE_URL": db_url, "AIVEDIO_REDIS_URL": redis_url, "AIVEDIO_REDIS_PREFIX": redis_prefix,
           "PATH": "/usr/bin:/bin"}
    rc, tenant, _ = _aivedio(env, "admin", "tenant", "create", "--name", "acme-users", "--service-class", "PAID_SHARED",
                             "--weight", "2", "--credits", "1000", "--json")
    assert rc == 0
    rc, user, _ = _aivedio(env, "admin", "user", "create", "--tenant-id", tenant["tenant_id"], "--json")
    assert rc == 0 and {"user_id", "api_key"} <= set(user) and user["role"] == "MEMBER"
    assert user["user_id"] != tenant["user_id"] and user["api_key"] != tenant["api_key"]
    rc, owner, _ = _aivedio(env, "admin", "user", "create", "--tenant-id", tenant["tenant_id"], "--role", "OWNER",
                            "--operator", "ops-jane", "--json")
    assert rc == 0 and owner["role"] == "OWNER"

    p = make_platform()
    with p.db.connection() as c:
        caller = auth.authenticate(c, f"Bearer {user['api_key']}")
        assert (str(caller.tenant_id), str(caller.user_id), caller.role) == (tenant["tenant_id"], user["user_id"], "MEMBER")
    with psycopg.connect(db_url) as c:
        audited = c.execute("select operator, target, new_value from audit_log where action = 'user.create' and tenant_id = %s "
                            "order by audit_id", (tenant["tenant_id"],)).fetchall()
    assert [a[1] for a in audited] == [f"user:{user['user_id']}", f"user:{owner['user_id']}"]
    assert audited[0][0].startswith("cli:") and audited[1][0] == "ops-jane"
    assert user["api_key"] not in json.dumps([a[2] for a in audited])  # the secret is never audited

    rc, err, _ = _aivedio(env, "admin", "user", "create", "--tenant-id", "00000000-0000-4000-8000-000000000000", "--json")
    assert rc == 1 and err["error"] == "NOT_FOUND"
    rc, _, stderr = _aivedio(env, "admin", "user", "create", "--tenant-id", tenant["tenant_id"], "--role", "ADMIN", "--json")
    assert rc == 2 and "invalid choice" in stderr
