"""`aivedio admin ...`: operator commands. Every write goes through the domain core and the audit log."""
from __future__ import annotations

import argparse
import getpass
from uuid import UUID

from aivedio.admin.tenants import ACCOUNT_TYPES, create_tenant
from aivedio.config import SERVICE_CLASSES


def _tenant_create(args: argparse.Namespace) -> int:
    from aivedio_tools.cli import _emit, _platform

    platform = _platform(args)
    try:
        created = create_tenant(platform, name=args.name, service_class=args.service_class, weight=args.weight,
                                credits=args.credits, account_type=args.account_type, operator=f"cli:{getpass.getuser()}")
    finally:
        platform.close()
    _emit(created.as_dict(), args.json)
    return 0


def _api_key_create(args: argparse.Namespace) -> int:
    from aivedio.admin.api_keys import create_api_key
    from aivedio_tools.cli.admin_billing import _operator, _run

    return _run(args, lambda p, c: create_api_key(c, operator=_operator(args), tenant_id=args.tenant_id, user_id=args.user_id,
                                                  project=args.project).as_dict())


def _user_create(args: argparse.Namespace) -> int:
    from aivedio.admin.users import create_user
    from aivedio_tools.cli.admin_billing import _operator, _run

    # Like `tenant create`, the CLI runs with the database's credentials and is trusted as such: the
    # write is audited as --operator or cli:<os user> (contracts/operations.md).
    return _run(args, lambda p, c: create_user(c, operator=_operator(args), tenant_id=args.tenant_id, role=args.role,
                                               name=args.name).as_dict())


def register(sub) -> None:
    admin = sub.add_parser("admin", help="operator commands").add_subparsers(dest="admin_command", required=True)
    tenant = admin.add_parser("tenant", help="tenants").add_subparsers(dest="tenant_command", required=True)
    c = tenant.add_parser("create", help="create a tenant, its first user, wallet and API key")
    c.add_argument("--name", required=True)
    c.add_argument("--service-class", required=True, choices=SERVICE_CLASSES)
    c.add_argument("--weight", required=True, type=int)
    c.add_argument("--credits", type=int, default=0)
    c.add_argument("--account-type", default="PREPAID", choices=ACCOUNT_TYPES)
    c.add_argument("--config", default=None)
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=_tenant_create)
    from aivedio_tools.cli import admin_policy as policy_cli

    policy_cli.register(tenant)

    from aivedio_tools.cli.admin_billing import _common, register_admin

    key = admin.add_parser("api-key", help="API keys").add_subparsers(dest="api_key_command", required=True)
    k = _common(key.add_parser("create", help="issue an existing tenant a key bound to a project (shown once)"))
    k.add_argument("--tenant-id", required=True, type=UUID)
    k.add_argument("--user-id", type=UUID, default=None, help="the key's user (default: the tenant's first OWNER)")
    k.add_argument("--project", required=True, help="1 to 64 of A-Z a-z 0-9 _ . - ; its budgets use the scope id TENANT_ID:PROJECT")
    k.set_defaults(fn=_api_key_create)

    user = admin.add_parser("user", help="users of a tenant").add_subparsers(dest="user_command", required=True)
    u = _common(user.add_parser("create", help="another user of a tenant, with its own API key (shown once) and its "
                                               "own per-user limits"))
    u.add_argument("--tenant-id", required=True, type=UUID)
    u.add_argument("--role", default="MEMBER", choices=["MEMBER", "OWNER"])
    u.add_argument("--name", default=None)
    u.set_defaults(fn=_user_create)

    register_admin(admin)
    # --- further admin commands, by capability (review, outbox, queue, counters; each registers its own) ---
    from aivedio_tools.cli.admin_review import register as register_review

    register_review(admin)
    from aivedio_tools.cli import admin_outbox as dead_letters_cli
    dead_letters_cli.register(admin)
    # The operator plane (issue 16): operators' tokens and the audit chain, capacities and switches.
    from aivedio_tools.cli import admin_capacity as capacity_cli, admin_operators as operators_cli

    operators_cli.register(admin)
    capacity_cli.register(admin)
