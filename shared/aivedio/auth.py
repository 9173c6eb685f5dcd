"""API keys: shown once, stored as sha256 hex, each mapping to one tenant and one user, and
optionally to one of the tenant's projects (chosen by the operator who issues the key).

A key that authenticated is remembered for Limits.api_key_cache_seconds (real seconds, a few) in
this process, so a request costs no database round trip for its authentication. A key revoked or
rotated here is forgotten at once (forget_tenant); in other processes (other Lambda instances, API
workers) it stops working within those seconds."""
from __future__ import annotations

import hashlib
import re
import secrets
import threading
import time
from dataclasses import dataclass
from uuid import UUID

import psycopg

from aivedio.errors import InvalidRequest, Unauthenticated

KEY_PREFIX = "av_"
PROJECT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # the same rule as the api_key_project_name CHECK


@dataclass(frozen=True)
class Caller:
    tenant_id: UUID
    user_id: UUID
    role: str
    project: str | None = None  # from the key, never from the request


@dataclass(frozen=True)
class IssuedKey:
    key_id: UUID
    secret: str  # shown once: only its hash is stored


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def validate_project(project: str) -> str:
    if not isinstance(project, str) or not PROJECT_NAME.fullmatch(project):
        raise InvalidRequest("invalid project name", {"project": "1 to 64 characters of A-Z a-z 0-9 _ . -"})
    return project


def issue_key(conn: psycopg.Connection, tenant_id: UUID, user_id: UUID, *, project: str | None = None) -> IssuedKey:
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    key_id = conn.execute(
        "insert into api_key (tenant_id, user_id, key_hash, key_prefix, project) values (%s, %s, %s, %s, %s) returning key_id",
        (tenant_id, user_id, hash_key(secret), secret[:8], None if project is None else validate_project(project)),
    ).fetchone()["key_id"]
    return IssuedKey(key_id, secret)


CACHE_MAX_KEYS = 10_000  # a flood of distinct keys clears the cache rather than growing it
_cache: dict[str, tuple[Caller, float]] = {}
_cache_lock = threading.Lock()


def _secret_of(authorization: str | None) -> str:
    if not authorization or not authorization.startswith("Bearer "):
        raise Unauthenticated("missing bearer API key")
    secret = authorization[len("Bearer "):].strip()
    if not secret.startswith(KEY_PREFIX) or len(secret) > 200:
        raise Unauthenticated("unknown API key")
    return secret


def cached_caller(authorization: str | None, ttl_seconds: float) -> Caller | None:
    """The caller of a key that authenticated within ttl_seconds in this process, else None."""
    if ttl_seconds <= 0 or not authorization or not authorization.startswith("Bearer "):
        return None
    digest = hash_key(authorization[len("Bearer "):].strip())
    with _cache_lock:
        hit = _cache.get(digest)
    if hit is None or time.monotonic() - hit[1] > ttl_seconds:
        return None
    return hit[0]


def forget_tenant(tenant_id: UUID) -> None:
    """Drop this process's remembered keys of a tenant (a key of it was revoked or rotated)."""
    with _cache_lock:
        for digest in [d for d, (c, _) in _cache.items() if c.tenant_id == tenant_id]:
            del _cache[digest]


def authenticate(conn: psycopg.Connection, authorization: str | None, *, cache: bool = False) -> Caller:
    """The key's caller, read from PostgreSQL; `cache` remembers it for cached_caller()."""
    secret = _secret_of(authorization)
    row = conn.execute(
        """select k.tenant_id, k.user_id, u.role, k.project from api_key k
             join app_user u on u.tenant_id = k.tenant_id and u.user_id = k.user_id
             join tenant t on t.tenant_id = k.tenant_id
            where k.key_hash = %s and k.revoked_at is null and t.status = 'ACTIVE'""",
        (hash_key(secret),),
    ).fetchone()
    if row is None:
        raise Unauthenticated("unknown API key")
    caller = Caller(row["tenant_id"], row["user_id"], row["role"], row["project"])
    if cache:
        with _cache_lock:
            if len(_cache) >= CACHE_MAX_KEYS:
                _cache.clear()
            _cache[hash_key(secret)] = (caller, time.monotonic())
    return caller
