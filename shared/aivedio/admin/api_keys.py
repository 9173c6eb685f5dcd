"""Issuing API keys for an existing tenant: a project key attributes the work it submits to one of
the tenant's projects, which the claim then reserves against the PROJECT budget (ch. 20.9.4). The
project is the operator's choice, never the client's (the tenant API has no field for it). Under
RBAC and audit like every admin write; the secret is returned once and never audited or stored."""
from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

import psycopg

from aivedio import audit, auth
from aivedio.errors import Conflict, NotFound
from aivedio.spend.budgets import project_scope_id
from aivedio.views import decode_cursor, encode_cursor

FIRST_OWNER = """
select user_id from app_user where tenant_id = %s and role = 'OWNER' order by created_at, user_id limit 1
"""


@dataclass(frozen=True)
class CreatedKey:
    key_id: UUID
    tenant_id: UUID
    user_id: UUID
    project: str | None
    api_key: str

    def as_dict(self) -> dict:
        return {"key_id": str(self.key_id), "tenant_id": str(self.tenant_id), "user_id": str(self.user_id),
                "project": self.project, "api_key": self.api_key,
                # for `admin budget set --scope-type PROJECT`
                "budget_scope_id": None if self.project is None else project_scope_id(self.tenant_id, self.project)}


def create_api_key(conn: psycopg.Connection, *, operator: str, tenant_id: UUID, project: str | None,
                   user_id: UUID | None = None) -> CreatedKey:
    """A new key of `user_id` (default: the tenant's first OWNER) bound to `project` (None: to none;
    the admin API's keys may be either, the CLI's name one)."""
    if project is not None:
        auth.validate_project(project)
    if conn.execute("select 1 from tenant where tenant_id = %s", (tenant_id,)).fetchone() is None:
        raise NotFound(f"no tenant {tenant_id}", details={"tenant_id": str(tenant_id)})
    if user_id is None:
        owner = conn.execute(FIRST_OWNER, (tenant_id,)).fetchone()
        if owner is None:
            raise NotFound(f"tenant {tenant_id} has no OWNER user: name the key's user", details={"user_id": "required"})
        user_id = owner["user_id"]
    elif conn.execute("select 1 from app_user where tenant_id = %s and user_id = %s", (tenant_id, user_id)).fetchone() is None:
        raise NotFound(f"no user {user_id} in tenant {tenant_id}", details={"user_id": str(user_id)})
    issued = auth.issue_key(conn, tenant_id, user_id, project=project)
    audit.append(conn, operator=operator, action="api_key.create", target=f"api_key:{issued.key_id}", tenant_id=tenant_id,
                 new={"user_id": user_id, "project": project, "key_prefix": issued.secret[:8]})
    return CreatedKey(issued.key_id, tenant_id, user_id, project, issued.secret)


# --- listing, rotating and revoking (the admin API) ---------------------------------------------------

# Prefixes only: a key's hash never leaves the database.
LIST_KEYS = """
select key_id, tenant_id, user_id, key_prefix, project, created_at, revoked_at from api_key
 where tenant_id = %(tenant)s
   and (%(after_ts)s::timestamptz is null or (created_at, key_id) > (%(after_ts)s, %(after_id)s::uuid))
 order by created_at, key_id
 limit %(limit)s
"""
KEY_FOR_UPDATE = """select key_id, tenant_id, user_id, key_prefix, project, created_at, revoked_at from api_key
                     where key_id = %s and (%s::uuid is null or tenant_id = %s) for update"""
REVOKE_KEY = "update api_key set revoked_at = %s where key_id = %s and revoked_at is null returning revoked_at"


def _key_view(row: dict) -> dict:
    return {"key_id": str(row["key_id"]), "tenant_id": str(row["tenant_id"]), "user_id": str(row["user_id"]),
            "key_prefix": row["key_prefix"], "project": row["project"], "created_at": row["created_at"].isoformat(),
            "revoked_at": row["revoked_at"].isoformat() if row["revoked_at"] else None,
            "status": "REVOKED" if row["revoked_at"] else "ACTIVE"}


def list_api_keys(conn: psycopg.Connection, *, tenant_id: UUID, limit: int, cursor: str | None = None) -> dict:
    """A tenant's keys, oldest first, by prefix (never the secret or its hash); NOT_FOUND for no tenant."""
    if conn.execute("select 1 from tenant where tenant_id = %s", (tenant_id,)).fetchone() is None:
        raise NotFound(f"no tenant {tenant_id}", details={"tenant_id": str(tenant_id)})
    after_ts, after_id = decode_cursor(cursor) if cursor else (None, None)
    rows = conn.execute(LIST_KEYS, {"tenant": tenant_id, "after_ts": after_ts, "after_id": after_id,
                                    "limit": limit + 1}).fetchall()
    page = rows[:limit]
    return {"items": [_key_view(r) for r in page],
            "next_cursor": encode_cursor(page[-1]["created_at"], page[-1]["key_id"]) if len(rows) > limit else None}


def _locked_key(conn: psycopg.Connection, key_id: UUID, tenant_id: UUID | None) -> dict:
    row = conn.execute(KEY_FOR_UPDATE, (key_id, tenant_id, tenant_id)).fetchone()
    if row is None:  # another tenant's key reads like one that does not exist
        raise NotFound(f"no API key {key_id}", details={"key_id": str(key_id)})
    return row


def revoke_api_key(conn: psycopg.Connection, *, operator: str, key_id: UUID, now, tenant_id: UUID | None = None) -> dict:
    """Revoke a key: aivedio.auth.authenticate refuses it from the commit on; this process forgets
    it at once, other API processes within Limits.api_key_cache_seconds. Revoking a revoked key
    changes nothing and says so (`revoked: false`)."""
    row = _locked_key(conn, key_id, tenant_id)
    done = conn.execute(REVOKE_KEY, (now, key_id)).fetchone()
    if done is None:
        return {**_key_view(row), "revoked": False}
    auth.forget_tenant(row["tenant_id"])
    audit.append(conn, operator=operator, action="api_key.revoke", target=f"api_key:{key_id}", tenant_id=row["tenant_id"],
                 old={"status": "ACTIVE", "key_prefix": row["key_prefix"]}, new={"status": "REVOKED"})
    return {**_key_view({**row, "revoked_at": done["revoked_at"]}), "revoked": True}


def rotate_api_key(conn: psycopg.Connection, *, operator: str, key_id: UUID, now,
                   tenant_id: UUID | None = None) -> CreatedKey:
    """A new key for the same user and project, the old one revoked in the same transaction."""
    row = _locked_key(conn, key_id, tenant_id)
    if row["revoked_at"] is not None:
        raise Conflict(f"API key {key_id} is revoked", details={"key_id": str(key_id)})
    conn.execute(REVOKE_KEY, (now, key_id))
    auth.forget_tenant(row["tenant_id"])
    issued = auth.issue_key(conn, row["tenant_id"], row["user_id"], project=row["project"])
    audit.append(conn, operator=operator, action="api_key.rotate", target=f"api_key:{key_id}", tenant_id=row["tenant_id"],
                 old={"key_id": key_id, "key_prefix": row["key_prefix"]},
                 new={"key_id": issued.key_id, "key_prefix": issued.secret[:8]})
    return CreatedKey(issued.key_id, row["tenant_id"], row["user_id"], row["project"], issued.secret)
