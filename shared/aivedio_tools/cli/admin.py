"""`aivedio admin ...`: the operator's commands, one module per group of them. Every write goes
through the domain core in one transaction with its audit row; the CLI is trusted (common)."""
from __future__ import annotations

from aivedio_tools.cli import (
    admin_capacity,
    admin_credit,
    admin_operators,
    admin_outbox,
    admin_review,
    admin_spend,
    admin_tenants,
)

GROUPS = (admin_tenants, admin_operators, admin_capacity, admin_credit, admin_spend, admin_review, admin_outbox)


def register(sub) -> None:
    admin = sub.add_parser("admin", help="operator commands: tenants, policies, capacities, money, reviews, dead letters"
                           ).add_subparsers(dest="admin_command", required=True)
    for group in GROUPS:
        group.register(admin)
