"""`aivedio admin operator create|rotate|revoke|list` and `aivedio admin audit list|verify`: the
operators of the admin API, their tokens, and the chained audit log. The CLI needs no token (that
is how the first admin is made). A token is printed once, by create and rotate."""
from __future__ import annotations

import argparse
import sys
from uuid import UUID

from aivedio.admin.operators import create_operator, list_operators, revoke_operator, rotate_operator_token
from aivedio.audit import list_audit, verify
from aivedio.policy.roles import ROLES
from aivedio_tools.cli.common import add_common, emit, integer, operator, platform_for, run


def _create(args: argparse.Namespace) -> int:
    return run(args, lambda p, c: create_operator(c, actor=operator(args), name=args.name, role=args.role).as_dict())


def _rotate(args: argparse.Namespace) -> int:
    return run(args, lambda p, c: rotate_operator_token(c, actor=operator(args), operator_id=args.operator_id).as_dict())


def _revoke(args: argparse.Namespace) -> int:
    return run(args, lambda p, c: revoke_operator(c, actor=operator(args), operator_id=args.operator_id))


def _list(args: argparse.Namespace) -> int:
    return run(args, lambda p, c: {"items": list_operators(c)})


def _audit_list(args: argparse.Namespace) -> int:
    return run(args, lambda p, c: list_audit(c, limit=args.limit, cursor=args.cursor))


def _audit_verify(args: argparse.Namespace) -> int:
    """Prints the verdict either way; exits 1 when the chain is broken."""
    platform = platform_for(args)
    try:
        doc = platform.db.transaction(verify)
    finally:
        platform.close()
    emit(doc, args.json)
    if not doc["ok"] and not args.json:
        sys.stderr.write(f"aivedio: audit chain broken: {doc['problem']}\n")
    return 0 if doc["ok"] else 1


def register(admin) -> None:
    op = admin.add_parser("operator", help="operators of the admin API and their tokens").add_subparsers(
        dest="operator_command", required=True)
    c = add_common(op.add_parser("create", help="an operator of the admin API and its token (shown once, stored hashed)"))
    c.add_argument("--name", required=True, help="the operator's name, unique")
    c.add_argument("--role", required=True, choices=list(ROLES), help="what the operator may do on the admin API")
    c.set_defaults(fn=_create)
    r = add_common(op.add_parser("rotate", help="a new token for an operator (shown once); the old one stops working"))
    r.add_argument("--operator-id", required=True, type=UUID)
    r.set_defaults(fn=_rotate)
    v = add_common(op.add_parser("revoke", help="revoke an operator and its token"))
    v.add_argument("--operator-id", required=True, type=UUID)
    v.set_defaults(fn=_revoke)
    add_common(op.add_parser("list", help="operators, their roles and token prefixes (never a token)")).set_defaults(fn=_list)

    audit = admin.add_parser("audit", help="the chained audit log").add_subparsers(dest="audit_command", required=True)
    ls = add_common(audit.add_parser("list", help="the audit log, newest first"))
    ls.add_argument("--limit", type=integer, default=50)
    ls.add_argument("--cursor", default=None, help="next_cursor of the previous page")
    ls.set_defaults(fn=_audit_list)
    add_common(audit.add_parser("verify", help="recompute the chain; exit 1 when a row was edited or deleted")
               ).set_defaults(fn=_audit_verify)
