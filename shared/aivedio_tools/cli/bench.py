"""`aivedio bench [--json] [--rounds N]`: each benchmark beside its baseline from the same run, every
ratio the median of N alternating rounds (the bench, then its baseline) with its spread, the machine
it ran on, and a summary of every figure beside its target (aivedio_tools.bench.summary)."""
from __future__ import annotations

import argparse
import os

from aivedio.config import ConfigError, settings_from_env
from aivedio.context import resolve_urls
from aivedio_tools.bench.admission import bench_admission
from aivedio_tools.bench.layers import LayersNotBuilt, bench_layers
from aivedio_tools.bench.media import bench_media
from aivedio_tools.bench.rounds import DEFAULT_ROUNDS
from aivedio_tools.bench.scheduler import bench_scheduler
from aivedio_tools.bench.settlement import bench_settlement_rounds
from aivedio_tools.bench.summary import summarise
from aivedio_tools.cli.common import emit
from aivedio_tools.local.embedded import with_embedded_servers


def _bench(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise ConfigError(f"--rounds: {args.rounds} (at least 1)")
    if args.only == "layers":  # needs no database: the built layers and a python of their version
        try:
            emit({"layers": bench_layers(rounds=args.rounds)}, args.json)
        except LayersNotBuilt as e:
            raise ConfigError(f"bench --only layers: {e}") from None
        return 0
    db_url, redis_url = resolve_urls(with_embedded_servers(settings_from_env()))
    cpus = os.cpu_count() or 2
    workers = args.workers or max(2, cpus + 1)
    clients = args.clients or 2 * workers
    report: dict = {"machine": {"cpus": cpus, "load_average_1m_at_start": round(os.getloadavg()[0], 2)},
                    "seconds": args.seconds, "rounds": args.rounds}
    if args.only in (None, "admission"):
        report["admission"] = bench_admission(db_url, redis_url, workers=workers, clients=clients, seconds=args.seconds,
                                              rounds=args.rounds)
    if args.only in (None, "scheduler"):
        schedulers = args.schedulers or max(2, cpus + 1)
        report["scheduler"] = bench_scheduler(db_url, redis_url, workers=schedulers, seconds=args.seconds, rounds=args.rounds)
    if args.only in (None, "settlement"):
        settlers = args.settlers or max(2, cpus + 1)
        report["settlement"] = bench_settlement_rounds(db_url, workers=settlers, seconds=args.seconds, rounds=args.rounds)
    if args.only in (None, "media"):
        try:
            report["media"] = bench_media(seconds=args.seconds, rounds=args.rounds, workers=args.media_workers or 1)
        except ImportError as e:  # no FFmpeg binary: imageio-ffmpeg is the dev extra, or ffmpeg on PATH
            report["media"] = {"skipped": str(e)}

    report["summary"] = summarise(report)  # every figure with a target, beside it
    emit(report, args.json)
    return 0


def register(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks, each against a baseline measured in the same run")
    b.add_argument("--json", action="store_true")
    b.add_argument("--seconds", type=float, default=10.0, help="how long each timed benchmark runs")
    b.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                   help="alternating rounds of each benchmark and its baseline; each ratio is their median")
    b.add_argument("--workers", type=int, default=None, help="API processes (Lambda instances), and in-process admitters")
    b.add_argument("--clients", type=int, default=None, help="concurrent HTTP load clients, and their pgbench clients")
    b.add_argument("--schedulers", type=int, default=None, help="scheduler processes (tick replicas), and their pgbench clients")
    b.add_argument("--settlers", type=int, default=None, help="settlement processes (Lambda instances), and their pgbench clients")
    b.add_argument("--media-workers", type=int, default=None, help="concurrent media jobs (one CPU unit each)")
    b.add_argument("--only", choices=["admission", "scheduler", "settlement", "media", "layers"], default=None,
                   help="one benchmark (default: all but layers, which needs `make layer` and a python of the layers' version)")
    b.set_defaults(fn=_bench)
