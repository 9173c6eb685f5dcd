"""`aivedio admin tenant create`, `admin tenant policy show|set`, `admin user create` and
`admin api-key create`: tenants, their scheduling policy, their users and keys.

`tenant policy set` takes one flag per column of aivedio.policy.tenant_policy.COLUMNS. Flag values
are parsed here, not by argparse, so a bad one is the same JSON error document (exit 1) as any
other invalid change. A secret (an API key) is printed once."""
from __future__ import annotations

import argparse
from uuid import UUID

from aivedio.admin.api_keys import create_api_key
from aivedio.admin.tenants import ACCOUNT_TYPES, create_tenant
from aivedio.admin.users import create_user
from aivedio.config import SERVICE_CLASSES
from aivedio.policy import tenant_policy
from aivedio_tools.cli.common import add_common, emit, operator, platform_for, run


def _tenant_create(args: argparse.Namespace) -> int:
    platform = platform_for(args)
    try:
        created = create_tenant(platform, name=args.name, service_class=args.service_class, weight=args.weight,
                                credits=args.credits, account_type=args.account_type, operator=operator(args))
    finally:
        platform.close()
    emit(created.as_dict(), args.json)
    return 0


def _policy_show(args: argparse.Namespace) -> int:
    return run(args, lambda p, c: tenant_policy.show_policy(c, args.tenant_id))


def changes_of(args: argparse.Namespace) -> tuple[dict, dict[str, str]]:
    """The flags given as typed column values, and the problem of each one that does not parse."""
    changes, bad = {}, {}
    for col in tenant_policy.COLUMNS:
        text = getattr(args, col.name, None)
        if text is None:
            continue
        try:
            changes[col.name] = col.parse(text)
        except ValueError as e:
            bad[col.name] = str(e)
    return changes, bad


def _policy_set(args: argparse.Namespace) -> int:
    changes, unparsed = changes_of(args)
    return run(args, lambda p, c: tenant_policy.set_policy(
        c, operator=operator(args), tenant_id=args.tenant_id, changes=changes, reason=args.reason, config=p.config,
        now=p.clock.now(), problems=unparsed))


def _user_create(args: argparse.Namespace) -> int:
    return run(args, lambda p, c: create_user(c, operator=operator(args), tenant_id=args.tenant_id, role=args.role,
                                              name=args.name).as_dict())


def _api_key_create(args: argparse.Namespace) -> int:
    return run(args, lambda p, c: create_api_key(c, operator=operator(args), tenant_id=args.tenant_id,
                                                 user_id=args.user_id, project=args.project).as_dict())


def register(admin) -> None:
    tenant = admin.add_parser("tenant", help="tenants and their scheduling policies").add_subparsers(
        dest="tenant_command", required=True)
    c = add_common(tenant.add_parser("create", help="create a tenant, its first user, wallet and API key (shown once)"))
    c.add_argument("--name", required=True, help="the tenant's name")
    c.add_argument("--service-class", required=True, choices=SERVICE_CLASSES, help="the lane its tasks go to")
    c.add_argument("--weight", required=True, type=int, help="its DRR weight: its share against other tenants'")
    c.add_argument("--credits", type=int, default=0, help="credits granted at once, as a paid lot")
    c.add_argument("--account-type", default="PREPAID", choices=ACCOUNT_TYPES, help="how the wallet is paid for")
    c.set_defaults(fn=_tenant_create)

    policy = tenant.add_parser("policy", help="a tenant's scheduling policy").add_subparsers(
        dest="policy_command", required=True)
    show = add_common(policy.add_parser("show", help="the policy in force, every column, with its policy_version"))
    show.add_argument("--tenant-id", required=True)
    show.set_defaults(fn=_policy_show)
    s = add_common(policy.add_parser("set", help="change columns of the policy: the whole result is validated, "
                                                 "policy_version moves on, and the policy in force is printed"))
    s.add_argument("--tenant-id", required=True)
    s.add_argument("--reason", default=None, help="why (kept in the audit log and the policy history)")
    for col in tenant_policy.COLUMNS:
        s.add_argument(col.flag, dest=col.name, default=None, metavar=col.metavar, help=col.help)
    s.set_defaults(fn=_policy_set)

    user = admin.add_parser("user", help="users of a tenant").add_subparsers(dest="user_command", required=True)
    u = add_common(user.add_parser("create", help="another user of a tenant, with its own API key (shown once) and its "
                                                  "own per-user limits"))
    u.add_argument("--tenant-id", required=True, type=UUID)
    u.add_argument("--role", default="MEMBER", choices=["MEMBER", "OWNER"], help="the user's role in the tenant")
    u.add_argument("--name", default=None, help="the user's display name")
    u.set_defaults(fn=_user_create)

    key = admin.add_parser("api-key", help="API keys").add_subparsers(dest="api_key_command", required=True)
    k = add_common(key.add_parser("create", help="issue an existing tenant a key bound to a project (shown once)"))
    k.add_argument("--tenant-id", required=True, type=UUID)
    k.add_argument("--user-id", type=UUID, default=None, help="the key's user (default: the tenant's first OWNER)")
    k.add_argument("--project", required=True,
                   help="1 to 64 of A-Z a-z 0-9 _ . - ; its budgets use the scope id TENANT_ID:PROJECT")
    k.set_defaults(fn=_api_key_create)
