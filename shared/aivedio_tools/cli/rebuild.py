"""`aivedio rebuild redis [--json]` (contracts/operations.md): rebuilds every Redis structure from
PostgreSQL (aivedio.reconcile.redis_rebuild). Needs redis.rebuild; the operator, and what was rebuilt, go
to the audit log in the transaction that read PostgreSQL for the rebuild."""
from __future__ import annotations

import argparse


def _rebuild_redis(args: argparse.Namespace) -> int:
    from aivedio.policy import roles as rbac
    from aivedio_tools.cli.admin_billing import _operator, _run
    from aivedio.reconcile.redis_rebuild import rebuild_redis

    operator = _operator(args)

    def run(platform, conn) -> dict:
        rbac.require(conn, operator, "redis.rebuild")
        done = rebuild_redis(platform, conn)
        rbac.audit(conn, operator=operator, action="redis.rebuild", target=f"redis:{done['prefix']}",
                   new={"keys_dropped": done["keys_dropped"], "lanes": done["lanes"]})
        return done

    return _run(args, run)


def register(sub) -> None:
    from aivedio_tools.cli.admin_billing import _common

    rebuild = sub.add_parser("rebuild", help="rebuild derived state from PostgreSQL").add_subparsers(
        dest="rebuild_command", required=True)
    r = _common(rebuild.add_parser("redis", help="drop the platform's Redis keys and rebuild every queue index from "
                                                 "PostgreSQL (needs redis.rebuild)"))
    r.set_defaults(fn=_rebuild_redis)
