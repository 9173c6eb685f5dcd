"""`aivedio rebuild redis [--json]` (contracts/operations.md): rebuilds every Redis structure from
PostgreSQL (aivedio.cache.rebuild). Needs redis.rebuild; the operator, and what was rebuilt, go
to the audit log in the transaction that read PostgreSQL for the rebuild."""
from __future__ import annotations

import argparse


def _rebuild_redis(args: argparse.Namespace) -> int:
    from aivedio.admin import rbac
    from aivedio.billing.cli import _operator, _run
    from aivedio.cache.rebuild import rebuild_redis

    operator = _operator(args)

    def run(platform, conn) -> dict:
        rbac.require(conn, operator, "redis.rebuild")
        done = rebuild_redis(platform, conn)
        rbac.audit(conn, operator=operator, action="redis.rebuild", target=f"redis:{done['prefix']}",
                   new={"keys_dropped": done["keys_dropped"], "lanes": done["lanes"]})
        return done

    return _run(args, run)


def register(sub) -> None:
    from aivedio.billing.cli import _common

    rebuild = sub.add_parser("rebuild", help="rebuild derived state from PostgreSQL").add_subparsers(
        dest="rebuild_command", required=True)
    r = _common(rebuild.add_parser("redis", help="drop the platform's Redis keys and rebuild every queue index from "
                                                 "PostgreSQL (needs redis.rebuild)"))
    r.set_defaults(fn=_rebuild_redis)
