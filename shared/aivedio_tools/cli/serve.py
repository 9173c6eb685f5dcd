"""`aivedio serve`: the whole platform in the foreground on one machine (aivedio_tools.local.runtime):
the API and the admin API, the scheduler, the workflows, the media workers, the reconcilers and the
outbox relay, with a simulator for each provider whose entry names no base_url. Ctrl-C stops it."""
from __future__ import annotations

import argparse
import os

from aivedio.config import ConfigError
from aivedio_tools.cli.common import settings
from aivedio_tools.local.runtime import serve


def _serve(args: argparse.Namespace) -> int:
    workers = args.api_workers if args.api_workers is not None else os.cpu_count() or 1
    if workers < 1:
        raise ConfigError(f"--api-workers: {workers} (at least 1)")
    return serve(settings(args), port=args.port, host=args.host, api_workers=workers)


def register(sub) -> None:
    s = sub.add_parser("serve", help="run the whole platform locally, in the foreground")
    s.add_argument("--config", default=None, help="the platform's config file (default: AIVEDIO_CONFIG)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--api-workers", type=int, default=None,
                   help="processes serving the API on one port, as Lambda runs several instances (default: the core count)")
    s.set_defaults(fn=_serve)
