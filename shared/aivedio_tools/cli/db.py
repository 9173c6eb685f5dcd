"""`aivedio db migrate`: the schema migrations of aivedio.db.migrations, applied in order under an
advisory lock; running it twice changes nothing. It needs only PostgreSQL (an embedded one when
AIVEDIO_DATABASE_URL is unset)."""
from __future__ import annotations

import argparse

from aivedio.config import settings_from_env
from aivedio.context import resolve_urls
from aivedio.db.migrate import migrate
from aivedio.db.pool import connect_or_fail
from aivedio_tools.cli.common import emit
from aivedio_tools.local.embedded import with_embedded_servers


def _migrate(args: argparse.Namespace) -> int:
    s = with_embedded_servers(settings_from_env().model_copy(update={"redis_url": "none"}))
    db_url, _ = resolve_urls(s)
    connect_or_fail(db_url)
    emit({"applied": migrate(db_url)}, args.json)
    return 0


def register(sub) -> None:
    db = sub.add_parser("db", help="database operations").add_subparsers(dest="db_command", required=True)
    m = db.add_parser("migrate", help="apply the schema migrations (idempotent)")
    m.add_argument("--json", action="store_true", help="one JSON document on stdout")
    m.set_defaults(fn=_migrate)
