"""The operators' roles and what each may do (ch. 20.13.2): the one role model.

An operator of the admin API has exactly one role (aivedio.admin.operators): viewer reads; operator
runs the platform (policies, capacities, switches, reviews, dead letters, repairs); finance moves
money (refunds, compensation, budgets, prices, invoices, wallets); admin may do everything,
operators and tenants included. Each admin route declares the permission it needs and the admin
API's gate checks the token's role with `allowed` before the route runs (functions/admin_api/
access.py), auditing a refusal (aivedio.audit.append_denied).

The CLI is not gated: it runs with the database's credentials and is trusted as such (whoever holds
them could write the tables directly), so a documented command never refuses for want of a role.
Its --operator (default cli:<os user>) only names who acts in the audit log. The money controls
that do not depend on a role still hold there: a second operator's approval above a threshold, an
operator's daily refund limit."""
from __future__ import annotations

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

ROLES = ("viewer", "operator", "finance", "admin")
ROLE_PERMISSIONS: dict[str, frozenset[str]] = {
    "viewer": READ_PERMISSIONS,
    "operator": READ_PERMISSIONS | OPERATOR_PERMISSIONS,
    "finance": READ_PERMISSIONS | FINANCE_PERMISSIONS,
}
ROLE_PERMISSIONS["admin"] = frozenset().union(*ROLE_PERMISSIONS.values(), ADMIN_ONLY_PERMISSIONS)
ALL_PERMISSIONS = ROLE_PERMISSIONS["admin"]


def allowed(role: str, permission: str) -> bool:
    """May an operator of this role do this? An unknown role may do nothing."""
    return permission in ROLE_PERMISSIONS.get(role, frozenset())
