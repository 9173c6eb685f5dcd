"""The `aivedio` command line: one module per command group, each adding its sub-commands with
`register(subparsers)`, and the helpers they share in `common` (the platform, the operator named
in the audit, the flags, the output). docs/cli.md is generated from these parsers
(`python -m aivedio_tools.docs`)."""
from __future__ import annotations

import argparse
import logging
import sys

from aivedio.config import ConfigError
from aivedio_tools.cli import admin, bench, chaos, db, demo, provider_sim, rebuild, reconcile, serve, simulate
from aivedio_tools.cli.common import describe_flags

# In the order `aivedio --help` lists them.
GROUPS = (serve, demo, db, admin, reconcile, rebuild, simulate, bench, chaos, provider_sim)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aivedio", description="AiVedio control plane: run it, operate it, measure it")
    sub = p.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    describe_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except ConfigError as e:
        sys.stderr.write(f"aivedio: {e}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
