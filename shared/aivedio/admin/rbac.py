"""Operator roles for the admin commands, and the audit log they write (ch. 20.13.2, 20.13.5).

An operator is a name (the CLI uses `cli:<os user>` unless --operator says otherwise). Roles are
rows of operator_role; what a role may do is the table below. Every admin write checks its
permission inside its own transaction and appends an audit_log row in that same transaction, so an
operation and its audit record exist together or not at all. A refused operation writes nothing.

The first BILLING_ADMIN grant bootstraps the table (whoever can run the CLI against the database
can make it); after that only a BILLING_ADMIN grants or revokes, and each grant is audited."""
from __future__ import annotations

import json
from typing import Any
from uuid import UUID

import psycopg

from aivedio.billing.errors import PermissionDenied
from aivedio.errors import InvalidRequest

ROLE_PERMISSIONS: dict[str, frozenset[str]] = {
    "BILLING_ADMIN": frozenset({"refund.create", "refund.approve", "refund.reject", "compensation.request",
                                "compensation.approve", "compensation.reject", "wallet.check", "wallet.rebuild",
                                "wallet.unfreeze", "ledger.correct", "budget.manage",
                                "subscription.manage", "costs.read", "credits.expire", "operator.grant",
                                "contract_budget.manage", "costs.import", "api_key.create",
                                *("review.read", "review.resolve", "outbox.read", "outbox.redrive", "queue.redrive",
                                  "counters.repair", "redis.rebuild", "invoice.reconcile", "invoice.close",
                                  "invoice.resolve", "maintenance.run")}),
    # Runs the platform: reviews, dead letters, rebuilds and repairs, the maintenance room on demand.
    "OPERATOR": frozenset({"review.read", "review.resolve", "outbox.read", "outbox.redrive", "queue.redrive",
                           "counters.repair", "redis.rebuild", "maintenance.run", "invoice.reconcile", "costs.read",
                           "wallet.check"}),
    "SUPPORT": frozenset({"refund.create", "compensation.request", "costs.read", "wallet.check"}),
    "FINANCE_APPROVER": frozenset({"refund.approve", "refund.reject", "compensation.approve", "compensation.reject", "costs.read",
                                   "wallet.check", "invoice.reconcile", "invoice.resolve", "invoice.close"}),
    "AUDITOR": frozenset({"costs.read", "wallet.check", "review.read", "outbox.read"}),
}
ROLES = tuple(ROLE_PERMISSIONS)


def roles_of(conn: psycopg.Connection, operator: str) -> set[str]:
    return {r["role"] for r in conn.execute("select role from operator_role where operator = %s", (operator,)).fetchall()}


def can(conn: psycopg.Connection, operator: str, permission: str) -> bool:
    return any(permission in ROLE_PERMISSIONS[r] for r in roles_of(conn, operator) if r in ROLE_PERMISSIONS)


def require(conn: psycopg.Connection, operator: str, permission: str) -> None:
    if not operator:
        raise PermissionDenied("an operator name is required")
    if not can(conn, operator, permission):
        raise PermissionDenied(f"operator {operator!r} may not {permission}",
                               details={"operator": operator, "permission": permission})


def audit(conn: psycopg.Connection, *, operator: str, action: str, target: str, tenant_id: UUID | None = None,
          old: Any = None, new: Any = None, reason: str | None = None) -> None:
    conn.execute(
        """insert into audit_log (tenant_id, operator, action, target, old_value, new_value, reason)
           values (%s, %s, %s, %s, %s, %s, %s)""",
        (tenant_id, operator, action, target, None if old is None else json.dumps(old, default=str),
         None if new is None else json.dumps(new, default=str), reason),
    )


def grant(conn: psycopg.Connection, *, operator: str, grantee: str, role: str) -> bool:
    """Give `grantee` a role. True when it is new."""
    if role not in ROLE_PERMISSIONS:
        raise InvalidRequest("unknown role", {"role": f"one of {', '.join(ROLES)}"})
    if not grantee:
        raise InvalidRequest("grantee is required", {"grantee": "an operator name"})
    conn.execute("select pg_advisory_xact_lock(hashtext('operator_role'))")
    bootstrap = role == "BILLING_ADMIN" and conn.execute(
        "select 1 from operator_role where role = 'BILLING_ADMIN' limit 1").fetchone() is None
    if not bootstrap:
        require(conn, operator, "operator.grant")
    created = conn.execute(
        "insert into operator_role (operator, role, granted_by) values (%s, %s, %s) on conflict do nothing",
        (grantee, role, operator),
    ).rowcount == 1
    if created:
        audit(conn, operator=operator, action="operator.grant", target=f"operator:{grantee}", new={"role": role},
              reason="bootstrap: first BILLING_ADMIN" if bootstrap else None)
    return created


def revoke(conn: psycopg.Connection, *, operator: str, grantee: str, role: str) -> bool:
    require(conn, operator, "operator.grant")
    gone = conn.execute("delete from operator_role where operator = %s and role = %s", (grantee, role)).rowcount == 1
    if gone:
        audit(conn, operator=operator, action="operator.revoke", target=f"operator:{grantee}", old={"role": role})
    return gone
