"""API keys: shown once, stored as sha256 hex, each mapping to one tenant and one user."""
from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from uuid import UUID

import psycopg

from aivedio.errors import Unauthenticated

KEY_PREFIX = "av_"


@dataclass(frozen=True)
class Caller:
    tenant_id: UUID
    user_id: UUID
    role: str


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def issue_key(conn: psycopg.Connection, tenant_id: UUID, user_id: UUID) -> str:
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    conn.execute(
        "insert into api_key (tenant_id, user_id, key_hash, key_prefix) values (%s, %s, %s, %s)",
        (tenant_id, user_id, hash_key(secret), secret[:8]),
    )
    return secret


def authenticate(conn: psycopg.Connection, authorization: str | None) -> Caller:
    if not authorization or not authorization.startswith("Bearer "):
        raise Unauthenticated("missing bearer API key")
    secret = authorization[len("Bearer "):].strip()
    if not secret.startswith(KEY_PREFIX) or len(secret) > 200:
        raise Unauthenticated("unknown API key")
    row = conn.execute(
        """select k.tenant_id, k.user_id, u.role from api_key k
             join app_user u on u.tenant_id = k.tenant_id and u.user_id = k.user_id
             join tenant t on t.tenant_id = k.tenant_id
            where k.key_hash = %s and k.revoked_at is null and t.status = 'ACTIVE'""",
        (hash_key(secret),),
    ).fetchone()
    if row is None:
        raise Unauthenticated("unknown API key")
    return Caller(row["tenant_id"], row["user_id"], row["role"])
