"""`aivedio admin operator create|rotate|revoke|list` and `aivedio admin audit list|verify` (issue 16,
contracts/operations.md). The CLI runs with the database's credentials and needs no token (that is
how the first admin is made); its writes are audited as --operator or cli:<os user>. A token is
printed once, by create and rotate."""
from __future__ import annotations

import argparse
import sys
from uuid import UUID


def _operator_create(args: argparse.Namespace) -> int:
    from aivedio.admin.operators import create_operator
    from aivedio_tools.cli.admin_billing import _operator, _run

    return _run(args, lambda p, c: create_operator(c, actor=_operator(args), name=args.name, role=args.role).as_dict())


def _operator_rotate(args: argparse.Namespace) -> int:
    from aivedio.admin.operators import rotate_operator_token
    from aivedio_tools.cli.admin_billing import _operator, _run

    return _run(args, lambda p, c: rotate_operator_token(c, actor=_operator(args), operator_id=args.operator_id).as_dict())


def _operator_revoke(args: argparse.Namespace) -> int:
    from aivedio.admin.operators import revoke_operator
    from aivedio_tools.cli.admin_billing import _operator, _run

    return _run(args, lambda p, c: revoke_operator(c, actor=_operator(args), operator_id=args.operator_id))


def _operator_list(args: argparse.Namespace) -> int:
    from aivedio.admin.operators import list_operators
    from aivedio_tools.cli.admin_billing import _run

    return _run(args, lambda p, c: {"items": list_operators(c)})


def _audit_list(args: argparse.Namespace) -> int:
    from aivedio.audit import list_audit
    from aivedio_tools.cli.admin_billing import _run

    return _run(args, lambda p, c: list_audit(c, limit=args.limit, cursor=args.cursor))


def _audit_verify(args: argparse.Namespace) -> int:
    """Prints the verdict either way; exits 1 when the chain is broken."""
    from aivedio.audit import verify
    from aivedio_tools.cli import _emit, _platform

    platform = _platform(args)
    try:
        doc = platform.db.transaction(verify)
    finally:
        platform.close()
    _emit(doc, args.json)
    if not doc["ok"] and not args.json:
        sys.stderr.write(f"aivedio: audit chain broken: {doc['problem']}\n")
    return 0 if doc["ok"] else 1


def _limit(s: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None


def register_operator_commands(op) -> None:
    """Add create/rotate/revoke/list to `aivedio admin operator` (its `grant` stays in billing/cli.py)."""
    from aivedio.admin.operators import OPERATOR_ROLES
    from aivedio_tools.cli.admin_billing import _common

    c = _common(op.add_parser("create", help="an operator of the admin API and its token (shown once, stored hashed)"))
    c.add_argument("--name", required=True)
    c.add_argument("--role", required=True, choices=list(OPERATOR_ROLES))
    c.set_defaults(fn=_operator_create)
    r = _common(op.add_parser("rotate", help="a new token for an operator (shown once); the old one stops working"))
    r.add_argument("--operator-id", required=True, type=UUID)
    r.set_defaults(fn=_operator_rotate)
    v = _common(op.add_parser("revoke", help="revoke an operator and its token"))
    v.add_argument("--operator-id", required=True, type=UUID)
    v.set_defaults(fn=_operator_revoke)
    ls = _common(op.add_parser("list", help="operators, their roles and token prefixes (never a token)"))
    ls.set_defaults(fn=_operator_list)


def register(admin) -> None:
    """`aivedio admin audit list|verify`; the operator commands hang under `admin operator`, made by
    billing/cli.register_admin, which calls register_operator_commands."""
    from aivedio_tools.cli.admin_billing import _common

    audit = admin.add_parser("audit", help="the chained audit log").add_subparsers(dest="audit_command", required=True)
    ls = _common(audit.add_parser("list", help="the audit log, newest first"))
    ls.add_argument("--limit", type=_limit, default=50)
    ls.add_argument("--cursor", default=None, help="next_cursor of the previous page")
    ls.set_defaults(fn=_audit_list)
    v = _common(audit.add_parser("verify", help="recompute the chain; exit 1 when a row was edited or deleted"))
    v.set_defaults(fn=_audit_verify)

