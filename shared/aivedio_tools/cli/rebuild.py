"""`aivedio rebuild redis`: every Redis structure rebuilt from PostgreSQL
(aivedio.reconcile.redis_rebuild); the operator, and what was rebuilt, go to the audit log in the
transaction that read PostgreSQL for the rebuild."""
from __future__ import annotations

import argparse

from aivedio import audit
from aivedio.reconcile.redis_rebuild import rebuild_redis
from aivedio_tools.cli.common import add_common, operator, run


def _rebuild_redis(args: argparse.Namespace) -> int:
    def fn(platform, conn) -> dict:
        done = rebuild_redis(platform, conn)
        audit.append(conn, operator=operator(args), action="redis.rebuild", target=f"redis:{done['prefix']}",
                     new={"keys_dropped": done["keys_dropped"], "lanes": done["lanes"]})
        return done

    return run(args, fn)


def register(sub) -> None:
    rebuild = sub.add_parser("rebuild", help="rebuild derived state from PostgreSQL").add_subparsers(
        dest="rebuild_command", required=True)
    add_common(rebuild.add_parser("redis", help="drop the platform's Redis keys and rebuild every queue index from "
                                                "PostgreSQL")).set_defaults(fn=_rebuild_redis)
