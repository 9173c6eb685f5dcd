"""The `aivedio` command line of contracts/operations.md. Reports print one JSON document on
stdout with --json; logs go to stderr."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Callable

from aivedio.config import ConfigError, load_config, settings_from_env

Command = Callable[[argparse.Namespace], int]


def _emit(doc: Any, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(doc, default=str, sort_keys=True) + "\n")
    else:
        for k, v in (doc.items() if isinstance(doc, dict) else enumerate(doc)):
            sys.stdout.write(f"{k}: {v}\n")


def _platform(args: argparse.Namespace, migrate: bool = True, **kw):
    from aivedio.context import build_platform
    from aivedio_tools.local.embedded import with_embedded_servers

    settings = settings_from_env()
    if getattr(args, "config", None):
        settings = settings.model_copy(update={"config_file": args.config})
    config = load_config(settings.config_file)
    return build_platform(with_embedded_servers(settings), config, migrate=migrate, **kw)


def cmd_db_migrate(args: argparse.Namespace) -> int:
    from aivedio.context import resolve_urls
    from aivedio.db.migrate import migrate
    from aivedio.db.pool import connect_or_fail
    from aivedio_tools.local.embedded import with_embedded_servers

    settings = with_embedded_servers(settings_from_env().model_copy(update={"redis_url": "none"}))
    db_url, _ = resolve_urls(settings)
    connect_or_fail(db_url)
    applied = migrate(db_url)
    _emit({"applied": applied}, args.json)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from aivedio_tools.local.runtime import serve

    settings = settings_from_env()
    if args.config:
        settings = settings.model_copy(update={"config_file": args.config})
    if args.api_workers < 1:
        raise ConfigError(f"--api-workers: {args.api_workers} (at least 1)")
    return serve(settings, port=args.port, host=args.host, api_workers=args.api_workers)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aivedio", description="AiVedio control plane")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the whole platform locally")
    s.add_argument("--config", default=None)
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--api-workers", type=int, default=os.cpu_count() or 1,
                   help="processes serving the API on one port, as Lambda runs several instances (default: the core count)")
    s.set_defaults(fn=cmd_serve)

    db = sub.add_parser("db", help="database operations").add_subparsers(dest="db_command", required=True)
    m = db.add_parser("migrate", help="apply schema migrations")
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=cmd_db_migrate)

    for register in _EXTENSIONS:
        register(sub)
    return p


# Capabilities add their own sub-commands here (admin, bench, simulate, reconcile, rebuild, chaos).
_EXTENSIONS: list[Callable[[Any], None]] = []


def _load_extensions() -> None:
    import importlib

    for mod in ("aivedio_tools.cli.admin", "aivedio_tools.cli.reconcile", "aivedio_tools.cli.rebuild", "aivedio_tools.cli.bench",
                "aivedio_tools.cli.simulate", "aivedio_tools.cli.provider_sim", "aivedio_tools.demo.run", "aivedio_tools.cli.chaos"):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and mod.startswith(e.name):  # that capability is not in this build
                continue
            raise
        _EXTENSIONS.append(m.register)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    _load_extensions()
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except ConfigError as e:
        sys.stderr.write(f"aivedio: {e}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
