"""Operator roles for the admin commands, and the audit log they write (ch. 20.13.2, 20.13.5).

An operator is a name (the CLI uses `cli:<os user>` unless --operator says otherwise). Legacy roles
(uppercase) are rows of operator_role; the operator plane's roles (viewer, operator, finance, admin)
belong to operator accounts with admin tokens (aivedio.admin.operators, audited as `op:<name>`).
What a role may do is the table below. Every admin write checks its
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

# The operator plane's roles (issue 16, contracts/admin-api.md), lowercase beside the legacy ones. An API
# operator (aivedio.admin.operators) has exactly one of them; the admin API checks it with allowed().
READ_PERMISSIONS = frozenset({
    "tenant.read", "policy.read", "audit.read", "lane.read", "capacity.read", "review.read", "outbox.read",
    "costs.read", "wallet.check", "dashboard.read", "fair_share.read", "price.read", "budget.read", "invoice.read",
    "switch.read"})
OPERATOR_PERMISSIONS = frozenset({
    "policy.write", "capacity.write", "switch.write", "review.resolve", "outbox.redrive", "queue.redrive",
    "counters.repair", "redis.rebuild", "maintenance.run"})
FINANCE_PERMISSIONS = frozenset({
    "refund.create", "refund.approve", "refund.reject", "compensation.request", "compensation.approve",
    "compensation.reject", "budget.manage", "contract_budget.manage", "price.write", "invoice.reconcile",
    "invoice.resolve", "invoice.close", "wallet.rebuild", "wallet.unfreeze"})
ADMIN_ONLY_PERMISSIONS = frozenset({"operator.manage", "tenant.manage", "audit.verify"})

LEGACY_ROLE_PERMISSIONS: dict[str, frozenset[str]] = {
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
ROLES = tuple(LEGACY_ROLE_PERMISSIONS)  # what `admin operator grant` gives (rows of operator_role)

OPERATOR_ROLES = ("viewer", "operator", "finance", "admin")
NEW_ROLE_PERMISSIONS: dict[str, frozenset[str]] = {
    "viewer": READ_PERMISSIONS,
    "operator": READ_PERMISSIONS | OPERATOR_PERMISSIONS,
    "finance": READ_PERMISSIONS | FINANCE_PERMISSIONS,
}
# admin: every permission any role has (legacy ones included), plus the admin-only ones.
NEW_ROLE_PERMISSIONS["admin"] = frozenset().union(
    *NEW_ROLE_PERMISSIONS.values(), *LEGACY_ROLE_PERMISSIONS.values(), ADMIN_ONLY_PERMISSIONS)

ROLE_PERMISSIONS: dict[str, frozenset[str]] = {**LEGACY_ROLE_PERMISSIONS, **NEW_ROLE_PERMISSIONS}
ALL_PERMISSIONS = NEW_ROLE_PERMISSIONS["admin"]


def allowed(role: str, permission: str) -> bool:
    """May an operator of this role do this? (The admin API's check; an unknown role may do nothing.)"""
    return permission in ROLE_PERMISSIONS.get(role, frozenset())


# An API operator's audit name is "op:<name>" (aivedio.admin.operators.Operator.audit_name); a CLI
# --operator naming it gets that operator's role while the account is active.
ROLES_OF = """select role from operator_role where operator = %(name)s
              union
              select role from operator_account where 'op:' || name = %(name)s and revoked_at is null"""


def roles_of(conn: psycopg.Connection, operator: str) -> set[str]:
    return {r["role"] for r in conn.execute(ROLES_OF, {"name": operator}).fetchall()}


def can(conn: psycopg.Connection, operator: str, permission: str) -> bool:
    return any(permission in ROLE_PERMISSIONS[r] for r in roles_of(conn, operator) if r in ROLE_PERMISSIONS)


def require(conn: psycopg.Connection, operator: str, permission: str) -> None:
    if not operator:
        raise PermissionDenied("an operator name is required")
    if not can(conn, operator, permission):
        raise PermissionDenied(f"operator {operator!r} may not {permission}",
                               details={"operator": operator, "permission": permission})


INSERT_AUDIT = """insert into audit_log (tenant_id, operator, action, target, old_value, new_value, reason, policy_version)
                  values (%s, %s, %s, %s, %s, %s, %s, %s)"""


def audit(conn: psycopg.Connection, *, operator: str, action: str, target: str | None, tenant_id: UUID | None = None,
          old: Any = None, new: Any = None, reason: str | None = None, policy_version: int | None = None) -> None:
    """Append one audit_log row in the caller's transaction (the chain trigger of migration 0150 links it)."""
    conn.execute(INSERT_AUDIT, (tenant_id, operator, action, target, None if old is None else json.dumps(old, default=str),
                                None if new is None else json.dumps(new, default=str), reason, policy_version))


def audit_denied(platform, *, operator: str, action: str, target: str | None, reason: str,
                 tenant_id: UUID | None = None) -> None:
    """A refused attempt, audited in a transaction of its own: the refused request writes nothing else.
    `tenant_id`, the tenant the request named, files the denial with that tenant's audit rows."""
    platform.db.transaction(lambda conn: audit(conn, operator=operator, action=f"{action}.denied", target=target,
                                               tenant_id=tenant_id, new={"outcome": "DENIED", "action": action},
                                               reason=reason))


def grant(conn: psycopg.Connection, *, operator: str, grantee: str, role: str) -> bool:
    """Give `grantee` a role. True when it is new."""
    if role not in LEGACY_ROLE_PERMISSIONS:  # the lowercase roles belong to operator accounts (operators.py)
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
