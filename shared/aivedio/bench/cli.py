"""`aivedio bench [--json]`: each benchmark beside its baseline from the same run."""
from __future__ import annotations

import argparse
import os


def _bench(args: argparse.Namespace) -> int:
    from aivedio.bench.admission import bench_admission
    from aivedio.bench.pgbench import run_pgbench
    from aivedio.bench.scheduler import bench_scheduler
    from aivedio.cli import _emit
    from aivedio.config import settings_from_env
    from aivedio.context import resolve_urls
    from aivedio.local.embedded import with_embedded_servers

    db_url, redis_url = resolve_urls(with_embedded_servers(settings_from_env()))
    cpus = os.cpu_count() or 2
    workers = args.workers or max(2, cpus + 1)
    clients = args.clients or 2 * workers
    report: dict = {"machine": {"cpus": cpus}, "seconds": args.seconds}
    if args.only in (None, "admission"):
        pg = run_pgbench(db_url, clients=clients, seconds=args.seconds)
        adm = bench_admission(db_url, redis_url, workers=workers, clients=clients, seconds=args.seconds)
        ratio = round(adm["sustained"]["accepted_per_second"] / pg["tps"], 3) if pg.get("tps") else None
        report["admission"] = {**adm, "baseline_pgbench_tpcb_like": pg, "ratio_vs_pgbench": ratio, "target_ratio": 0.5}
    if args.only in (None, "scheduler"):
        schedulers = args.schedulers or max(2, cpus + 1)
        report["scheduler"] = bench_scheduler(db_url, redis_url, workers=schedulers, seconds=args.seconds)
    if args.only in (None, "settlement"):
        from aivedio.bench.settlement import bench_settlement

        settlers = args.settlers or max(2, cpus + 1)
        pg = run_pgbench(db_url, clients=settlers, seconds=args.seconds)
        st = bench_settlement(db_url, workers=settlers, seconds=args.seconds)
        ratio = round(st["settlements_per_second"] / pg["tps"], 3) if pg.get("tps") and st["settlements_per_second"] else None
        report["settlement"] = {**st, "baseline_pgbench_tpcb_like": pg, "ratio_vs_pgbench": ratio, "target_ratio": 0.5}
    _emit(report, args.json)
    return 0


def register(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks, each against a baseline measured in the same run")
    b.add_argument("--json", action="store_true")
    b.add_argument("--seconds", type=float, default=10.0)
    b.add_argument("--workers", type=int, default=None, help="API processes (Lambda instances)")
    b.add_argument("--clients", type=int, default=None, help="concurrent load clients, and pgbench clients")
    b.add_argument("--schedulers", type=int, default=None, help="scheduler processes (tick replicas), and their pgbench clients")
    b.add_argument("--settlers", type=int, default=None, help="settlement processes (Lambda instances), and their pgbench clients")
    b.add_argument("--only", choices=["admission", "scheduler", "settlement"], default=None)
    b.set_defaults(fn=_bench)
