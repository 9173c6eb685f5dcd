"""Operators of the admin API and their tokens (docs/admin-api.md).

An operator account has a name, one role (viewer, operator, finance, admin: what each may do is
aivedio.policy.roles) and one admin token. A token is `avop_` + 32 random bytes, shown once
and stored as sha256 hex only; tenant API keys start `av_` (aivedio.auth), so the two never pass for
each other: a tenant key on the admin API is FORBIDDEN, an admin token on the tenant API is unknown.
Every write is audited in its own transaction as `actor` (the CLI's `--operator` or `cli:<os user>`,
or the calling operator's audit name); neither a token nor its hash ever reaches the audit log.

The dashboard signs a browser in with a session of its own (`avds_` + 32 random bytes, stored as
sha256 hex only): the cookie never holds the operator token. A session ends on sign-out, when it
expires, when the token it was opened with is rotated, or when the operator is revoked."""
from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from uuid import UUID

import psycopg

from aivedio import audit, auth
from aivedio.errors import Conflict, Forbidden, InvalidRequest, NotFound, Unauthenticated
from aivedio.policy.roles import ROLES

ADMIN_TOKEN_PREFIX = "avop_"
SESSION_PREFIX = "avds_"
NAME_MAX = 64  # the operator_account_name_length CHECK
TOKEN_PREFIX_LEN = 12  # what list shows to tell tokens apart ("avop_" + 7 characters)
AUDIT_NAME_PREFIX = "op:"


@dataclass(frozen=True)
class Operator:
    """Who an admin request is."""

    operator_id: UUID
    name: str
    role: str

    @property
    def audit_name(self) -> str:
        return AUDIT_NAME_PREFIX + self.name


@dataclass(frozen=True)
class IssuedOperator:
    operator_id: UUID
    name: str
    role: str
    token: str  # shown once: only its hash is stored

    def as_dict(self) -> dict:
        return {"operator_id": str(self.operator_id), "name": self.name, "role": self.role, "token": self.token}


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _new_token() -> str:
    return ADMIN_TOKEN_PREFIX + secrets.token_urlsafe(32)


def validate_name(name) -> str:
    if not isinstance(name, str) or not name.strip():
        raise InvalidRequest("an operator name is required", {"name": f"1 to {NAME_MAX} characters"})
    name = name.strip()
    if len(name) > NAME_MAX or any(not ch.isprintable() for ch in name):
        raise InvalidRequest("invalid operator name", {"name": f"1 to {NAME_MAX} printable characters"})
    return name


def validate_role(role) -> str:
    if role not in ROLES:
        raise InvalidRequest("unknown operator role", {"role": f"one of {', '.join(ROLES)}"})
    return role


# --- authentication ---------------------------------------------------------------------------------------

FIND_ACTIVE_BY_TOKEN = """select operator_id, name, role from operator_account
                           where token_hash = %s and revoked_at is null"""
FIND_ACTIVE_TENANT_KEY = """select 1 from api_key k join tenant t on t.tenant_id = k.tenant_id
                             where k.key_hash = %s and k.revoked_at is null and t.status = 'ACTIVE'"""
# A live session of an active operator whose token is still the one the session was opened with.
FIND_ACTIVE_BY_SESSION = """select o.operator_id, o.name, o.role
                              from operator_session s join operator_account o on o.operator_id = s.operator_id
                             where s.session_hash = %s and s.ended_at is null and s.expires_at > now()
                               and o.revoked_at is null and o.token_hash = s.token_hash"""
MAX_CREDENTIAL_LEN = 200


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def authenticate_operator(conn: psycopg.Connection, authorization: str | None, *,
                          session_id: str | None = None) -> Operator:
    """The operator behind `Authorization: Bearer <token>`, else behind the dashboard's session id.
    Unauthenticated when missing, unknown, ended or revoked; Forbidden when the bearer is a valid
    tenant API key. A session cookie holding anything but a session id is unknown."""
    token = _bearer(authorization)
    if token is None and session_id and session_id.strip():
        return _by_session(conn, session_id.strip())
    if not token:
        raise Unauthenticated("missing bearer operator token")
    if len(token) > MAX_CREDENTIAL_LEN:
        raise Unauthenticated("unknown operator token")
    if token.startswith(ADMIN_TOKEN_PREFIX):
        row = conn.execute(FIND_ACTIVE_BY_TOKEN, (hash_token(token),)).fetchone()
        if row is None:
            raise Unauthenticated("unknown or revoked operator token")
        return Operator(row["operator_id"], row["name"], row["role"])
    if token.startswith(auth.KEY_PREFIX) and conn.execute(FIND_ACTIVE_TENANT_KEY, (auth.hash_key(token),)).fetchone():
        raise Forbidden("a tenant API key cannot call the admin API; use an operator token")
    raise Unauthenticated("unknown operator token")


def _by_session(conn: psycopg.Connection, session_id: str) -> Operator:
    row = None
    if session_id.startswith(SESSION_PREFIX) and len(session_id) <= MAX_CREDENTIAL_LEN:
        row = conn.execute(FIND_ACTIVE_BY_SESSION, (hash_token(session_id),)).fetchone()
    if row is None:
        raise Unauthenticated("unknown, expired or ended dashboard session: sign in again")
    return Operator(row["operator_id"], row["name"], row["role"])


# --- dashboard sessions -------------------------------------------------------------------------------------

# A session is opened with the token just authenticated; the same statement checks it is still current.
OPEN_SESSION = """insert into operator_session (session_hash, operator_id, token_hash, expires_at)
                  select %(session_hash)s, operator_id, token_hash, now() + make_interval(secs => %(max_age)s)
                    from operator_account
                   where operator_id = %(operator_id)s and token_hash = %(token_hash)s and revoked_at is null
                  returning operator_id"""
# Bounded without a sweeper: each sign-in deletes what expired a day ago or more.
DELETE_EXPIRED_SESSIONS = "delete from operator_session where expires_at < now() - interval '1 day'"
END_SESSION = """update operator_session set ended_at = now() where session_hash = %s and ended_at is null
                 returning operator_id"""


def open_session(conn: psycopg.Connection, operator: Operator, token: str, *, max_age_seconds: int) -> str:
    """A new dashboard session for the operator whose `token` was just authenticated; the session id
    is returned once (only its hash is stored). Unauthenticated if the token changed meanwhile."""
    session_id = SESSION_PREFIX + secrets.token_urlsafe(32)
    conn.execute(DELETE_EXPIRED_SESSIONS)
    row = conn.execute(OPEN_SESSION, {"session_hash": hash_token(session_id), "operator_id": operator.operator_id,
                                      "token_hash": hash_token(token), "max_age": max_age_seconds}).fetchone()
    if row is None:
        raise Unauthenticated("unknown or revoked operator token")
    return session_id


def end_session(conn: psycopg.Connection, session_id: str | None) -> bool:
    """Ends a dashboard session (sign-out); False when there was no live one by that id."""
    if not session_id or not session_id.startswith(SESSION_PREFIX) or len(session_id) > MAX_CREDENTIAL_LEN:
        return False
    return conn.execute(END_SESSION, (hash_token(session_id),)).fetchone() is not None


# --- writes -------------------------------------------------------------------------------------------------

INSERT_OPERATOR = """insert into operator_account (name, role, token_hash, token_prefix, created_by)
                     values (%s, %s, %s, %s, %s)
                     on conflict (name) do nothing
                     returning operator_id, name, role"""
ROTATE_TOKEN = """update operator_account set token_hash = %s, token_prefix = %s, rotated_at = now()
                   where operator_id = %s and revoked_at is null
                   returning operator_id, name, role"""
REVOKE = """update operator_account set revoked_at = now() where operator_id = %s and revoked_at is null
            returning *"""
OPERATOR_COLUMNS = "operator_id, name, role, token_prefix, created_at, created_by, rotated_at, revoked_at"
GET_OPERATOR = f"select {OPERATOR_COLUMNS} from operator_account where operator_id = %s"
LIST_OPERATORS = f"select {OPERATOR_COLUMNS} from operator_account order by created_at, name"


def _as_uuid(operator_id) -> UUID:
    if isinstance(operator_id, UUID):
        return operator_id
    try:
        return UUID(str(operator_id))
    except ValueError:
        raise InvalidRequest("invalid operator id", {"operator_id": "a UUID"}) from None


def _view(row: dict) -> dict:
    return {"operator_id": str(row["operator_id"]), "name": row["name"], "role": row["role"],
            "status": "REVOKED" if row["revoked_at"] is not None else "ACTIVE",
            "token_prefix": row["token_prefix"], "created_by": row["created_by"],
            **{k: None if row[k] is None else row[k].isoformat() for k in ("created_at", "rotated_at", "revoked_at")}}


def create_operator(conn: psycopg.Connection, *, actor: str, name: str, role: str) -> IssuedOperator:
    name, role = validate_name(name), validate_role(role)
    token = _new_token()
    row = conn.execute(INSERT_OPERATOR, (name, role, hash_token(token), token[:TOKEN_PREFIX_LEN], actor)).fetchone()
    if row is None:
        raise Conflict(f"an operator named {name!r} exists", details={"name": name})
    audit.append(conn, operator=actor, action="operator.create", target=f"operator:{row['operator_id']}",
                 new={"name": name, "role": role, "token_prefix": token[:TOKEN_PREFIX_LEN]})
    return IssuedOperator(row["operator_id"], row["name"], row["role"], token)


def _missing_or_revoked(conn: psycopg.Connection, operator_id: UUID) -> Exception:
    row = conn.execute(GET_OPERATOR, (operator_id,)).fetchone()
    if row is None:
        return NotFound(f"no operator {operator_id}", details={"operator_id": str(operator_id)})
    return Conflict(f"operator {operator_id} is revoked", details={"operator_id": str(operator_id)})


def rotate_operator_token(conn: psycopg.Connection, *, actor: str, operator_id: UUID) -> IssuedOperator:
    """A new token for an active operator; the old one stops working when this commits."""
    operator_id = _as_uuid(operator_id)
    token = _new_token()
    row = conn.execute(ROTATE_TOKEN, (hash_token(token), token[:TOKEN_PREFIX_LEN], operator_id)).fetchone()
    if row is None:
        raise _missing_or_revoked(conn, operator_id)
    audit.append(conn, operator=actor, action="operator.rotate", target=f"operator:{operator_id}",
                 new={"name": row["name"], "token_prefix": token[:TOKEN_PREFIX_LEN]})
    return IssuedOperator(row["operator_id"], row["name"], row["role"], token)


def revoke_operator(conn: psycopg.Connection, *, actor: str, operator_id: UUID) -> dict:
    """Revoke an operator and its token. Revoking a revoked operator changes nothing and says so."""
    operator_id = _as_uuid(operator_id)
    row = conn.execute(REVOKE, (operator_id,)).fetchone()
    if row is None:
        existing = conn.execute(GET_OPERATOR, (operator_id,)).fetchone()
        if existing is None:
            raise _missing_or_revoked(conn, operator_id)
        return {**_view(existing), "revoked": False}
    audit.append(conn, operator=actor, action="operator.revoke", target=f"operator:{operator_id}",
                 old={"name": row["name"], "role": row["role"], "status": "ACTIVE"}, new={"status": "REVOKED"})
    return {**_view(row), "revoked": True}


def get_operator(conn: psycopg.Connection, operator_id: UUID) -> dict:
    operator_id = _as_uuid(operator_id)
    row = conn.execute(GET_OPERATOR, (operator_id,)).fetchone()
    if row is None:
        raise _missing_or_revoked(conn, operator_id)
    return _view(row)


def list_operators(conn: psycopg.Connection) -> list[dict]:
    return [_view(r) for r in conn.execute(LIST_OPERATORS).fetchall()]
