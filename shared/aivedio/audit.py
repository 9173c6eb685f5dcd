"""The audit log (ch. 20.13.2, 20.13.5): who changed what, when and why, for every operator
action, the admin API's refusals included.

`append` adds one row in the caller's transaction, so an operation and its audit record exist
together or not at all; a refused operation writes nothing but, where the refusal itself must be
kept (a role the token lacks, a money control's refusal), `append_denied` writes it in a
transaction of its own. The operator is a name: `op:<name>` for an operator of the admin API
(aivedio.admin.operators), `cli:<os user>` or the CLI's --operator for a command.

audit_log is append-only (a trigger refuses UPDATE, DELETE, TRUNCATE) and chained (migration 0150):
the BEFORE INSERT trigger locks audit_chain_head, draws the row's id, sets prev_hash to the head's
hash and row_hash to aivedio_audit_row_hash(row, prev_hash), then moves the head. So audit_id order
is the chain's order, and verify() recomputes it from the rows:
- a row whose columns were edited no longer matches its row_hash;
- a deleted row leaves its successor's prev_hash pointing at nothing that precedes it;
- a deleted tail leaves the head naming a row (or a hash) that is not the last one.
Someone who can rewrite every later row and the head as well is beyond what a chain inside the same
database can catch; publishing the head elsewhere would be the next step."""
from __future__ import annotations

import base64
import binascii
import json
from typing import Any
from uuid import UUID

import psycopg

from aivedio.errors import InvalidRequest

INSERT_AUDIT = """insert into audit_log (tenant_id, operator, action, target, old_value, new_value, reason, policy_version)
                  values (%s, %s, %s, %s, %s, %s, %s, %s)"""
DEFAULT_LIMIT = 50
MAX_LIMIT = 500

LIST_AUDIT = """select audit_id, tenant_id, operator, action, target, old_value, new_value, reason,
                       policy_version, created_at, prev_hash, row_hash
                  from audit_log
                 where %(before)s::bigint is null or audit_id < %(before)s::bigint
                 order by audit_id desc
                 limit %(limit)s"""

# One statement, so one snapshot: the rows and the head are read at the same instant (a snapshot
# always holds a prefix of the chain, since ids are drawn under the head's lock).
VERIFY_CHAIN = """
with chain as (
    select audit_id, prev_hash, row_hash,
           lag(row_hash) over (order by audit_id) as expected_prev,
           row_number() over (order by audit_id) as n,
           aivedio_audit_row_hash(audit_id, tenant_id, operator, action, target, old_value, new_value, reason,
                                  policy_version, created_at, prev_hash) as computed
      from audit_log
), first_bad as (
    select audit_id, n,
           case when row_hash is null or row_hash is distinct from computed then 'HASH_MISMATCH'
                else 'LINK_BROKEN' end as problem
      from chain
     where row_hash is null or row_hash is distinct from computed or prev_hash is distinct from expected_prev
     order by audit_id
     limit 1
), last_row as (
    select audit_id, row_hash from chain order by audit_id desc limit 1
)
select (select count(*) from chain) as rows_checked,
       (select audit_id from first_bad) as bad_id,
       (select n from first_bad) as bad_n,
       (select problem from first_bad) as bad_problem,
       (select audit_id from last_row) as last_id,
       (select row_hash from last_row) as last_hash,
       h.last_audit_id as head_id,
       h.last_hash as head_hash,
       h.singleton is not null as head_exists
  from (select 1) one left join audit_chain_head h on true
"""

PROBLEMS = {
    "HASH_MISMATCH": "row {id}: its columns no longer match its row_hash (the row was edited)",
    "LINK_BROKEN": "row {id}: its prev_hash does not match the row before it (a row before it was deleted or changed)",
    "FIRST_LINK": "row {id}: the first row points at a predecessor (rows before it were deleted)",
    "TAIL": "the chain head names row {id}, but the last row is {last} (rows at the end were deleted)",
    "HEAD_HASH": "the chain head's hash differs from the last row's ({id})",
    "NO_HEAD": "audit_chain_head is missing",
}


def append(conn: psycopg.Connection, *, operator: str, action: str, target: str | None, tenant_id: UUID | None = None,
           old: Any = None, new: Any = None, reason: str | None = None, policy_version: int | None = None) -> None:
    """Append one audit_log row in the caller's transaction (the chain trigger of migration 0150 links it)."""
    conn.execute(INSERT_AUDIT, (tenant_id, operator, action, target, None if old is None else json.dumps(old, default=str),
                                None if new is None else json.dumps(new, default=str), reason, policy_version))


def append_denied(platform, *, operator: str, action: str, target: str | None, reason: str,
                  tenant_id: UUID | None = None) -> None:
    """A refused attempt, audited in a transaction of its own: the refused request writes nothing else.
    `tenant_id`, the tenant the request named, files the denial with that tenant's audit rows."""
    platform.db.transaction(lambda conn: append(conn, operator=operator, action=f"{action}.denied", target=target,
                                                tenant_id=tenant_id, new={"outcome": "DENIED", "action": action},
                                                reason=reason))


def _encode_cursor(audit_id: int) -> str:
    return base64.urlsafe_b64encode(json.dumps({"audit_id": audit_id}).encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        audit_id = json.loads(raw)["audit_id"]
        if not isinstance(audit_id, int) or isinstance(audit_id, bool):
            raise ValueError(audit_id)
        return audit_id
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeDecodeError):
        raise InvalidRequest("invalid cursor", {"cursor": "a next_cursor from an earlier page"}) from None


def _item(row: dict) -> dict:
    return {"audit_id": row["audit_id"], "tenant_id": None if row["tenant_id"] is None else str(row["tenant_id"]),
            "operator": row["operator"], "operation": row["action"], "target": row["target"],
            "old_value": row["old_value"], "new_value": row["new_value"], "reason": row["reason"],
            "policy_version": row["policy_version"], "created_at": row["created_at"].isoformat(),
            "prev_hash": row["prev_hash"], "row_hash": row["row_hash"]}


def list_audit(conn: psycopg.Connection, *, limit: int | None = None, cursor: str | None = None) -> dict:
    """A page of the audit log, newest first: {"items": [...], "next_cursor": str | None}."""
    if limit is None:
        limit = DEFAULT_LIMIT
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidRequest("invalid limit", {"limit": f"an integer from 1 to {MAX_LIMIT}"})
    before = _decode_cursor(cursor) if cursor else None
    rows = conn.execute(LIST_AUDIT, {"before": before, "limit": limit + 1}).fetchall()
    items = [_item(r) for r in rows[:limit]]
    return {"items": items, "next_cursor": _encode_cursor(items[-1]["audit_id"]) if len(rows) > limit else None}


def verify(conn: psycopg.Connection) -> dict:
    """Walk the whole chain: {"ok", "rows_checked", "first_bad_audit_id", "problem"} (problem is
    null when ok), plus the head it checked against."""
    r = conn.execute(VERIFY_CHAIN).fetchone()
    doc = {"ok": True, "rows_checked": r["rows_checked"], "first_bad_audit_id": None, "problem": None, "problem_code": None,
           "head_audit_id": r["head_id"], "head_hash": r["head_hash"]}

    def bad(kind: str, audit_id, **fmt) -> dict:
        return {**doc, "ok": False, "first_bad_audit_id": audit_id, "problem_code": kind,
                "problem": PROBLEMS[kind].format(id=audit_id, **fmt)}

    if r["bad_id"] is not None:
        kind = "FIRST_LINK" if r["bad_problem"] == "LINK_BROKEN" and r["bad_n"] == 1 else r["bad_problem"]
        return bad(kind, r["bad_id"])
    if not r["head_exists"]:
        return bad("NO_HEAD", None)
    if r["head_id"] != r["last_id"]:
        return bad("TAIL", r["head_id"], last="none" if r["last_id"] is None else r["last_id"])
    if r["head_hash"] != r["last_hash"]:
        return bad("HEAD_HASH", r["last_id"])
    return doc
