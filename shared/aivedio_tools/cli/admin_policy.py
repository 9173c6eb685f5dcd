"""`aivedio admin tenant policy show|set` (contracts/operations.md): one flag per column of
aivedio.policy.tenant_policy.COLUMNS. Like every admin command it runs with the database's credentials and
needs no token; a change is audited as --operator or cli:<os user>. Flag values are parsed here, not
by argparse, so a bad one is the same JSON error document (exit 1) as any other invalid change."""
from __future__ import annotations

import argparse

from aivedio.policy import tenant_policy as policy


def _show(args: argparse.Namespace) -> int:
    from aivedio_tools.cli.admin_billing import _run

    return _run(args, lambda p, c: policy.show_policy(c, args.tenant_id))


def changes_of(args: argparse.Namespace) -> tuple[dict, dict[str, str]]:
    """The flags given as typed column values, and the problem of each one that does not parse."""
    changes, bad = {}, {}
    for col in policy.COLUMNS:
        text = getattr(args, col.name, None)
        if text is None:
            continue
        try:
            changes[col.name] = col.parse(text)
        except ValueError as e:
            bad[col.name] = str(e)
    return changes, bad


def _set(args: argparse.Namespace) -> int:
    from aivedio_tools.cli.admin_billing import _operator, _run

    changes, unparsed = changes_of(args)

    def fn(p, conn):
        return policy.set_policy(conn, operator=_operator(args), tenant_id=args.tenant_id, changes=changes,
                                 reason=args.reason, config=p.config, now=p.clock.now(),
                                 problems=unparsed)

    return _run(args, fn)


def register(tenant_subparsers) -> None:
    from aivedio_tools.cli.admin_billing import _common

    sub = tenant_subparsers.add_parser("policy", help="a tenant's scheduling policy").add_subparsers(
        dest="policy_command", required=True)
    show = _common(sub.add_parser("show", help="the policy in force, every column, with its policy_version"))
    show.add_argument("--tenant-id", required=True)
    show.set_defaults(fn=_show)

    s = _common(sub.add_parser("set", help="change columns of the policy: the whole result is validated, "
                                           "policy_version moves on, and the policy in force is printed"))
    s.add_argument("--tenant-id", required=True)
    s.add_argument("--reason", default=None, help="why (kept in the audit log and the policy history)")
    for col in policy.COLUMNS:
        s.add_argument(col.flag, dest=col.name, default=None, metavar=col.metavar, help=col.help)
    s.set_defaults(fn=_set)
