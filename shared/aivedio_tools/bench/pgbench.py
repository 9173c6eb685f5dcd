"""The baseline: pgbench's built-in tpcb-like script on the same PostgreSQL server."""
from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

from aivedio_tools.bench.pgcpu import BackendCpu, Vacuuming


def find_pgbench() -> str | None:
    found = shutil.which("pgbench")
    if found:
        return found
    for pattern in ("/usr/lib/postgresql/*/bin/pgbench",):
        hits = sorted(Path("/").glob(pattern.lstrip("/")))
        if hits:
            return str(hits[-1])
    try:
        import pgserver

        p = Path(pgserver.__file__).parent / "pginstall" / "bin" / "pgbench"
        if p.exists():
            return str(p)
    except ImportError:
        pass
    return None


def with_database(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


DATABASE = "aivedio_bench_pgbench"  # the prefix of each run's database


@contextmanager
def pgbench_database(admin_url: str, *, scale: int = 10) -> Iterator[str | None]:
    """A pgbench database initialised once (pgbench -i), for several runs; its URL, or None when
    pgbench is not installed. Dropped afterwards."""
    exe = find_pgbench()
    if exe is None:
        yield None
        return
    name = f"{DATABASE}_{uuid.uuid4().hex[:8]}"  # its own: benches may run beside each other
    with psycopg.connect(admin_url, autocommit=True) as c:
        c.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    url = with_database(admin_url, name)
    try:
        subprocess.run([exe, "-i", "-q", "-s", str(scale), url], check=True, capture_output=True, text=True, timeout=300)
        yield url
    finally:
        with psycopg.connect(admin_url, autocommit=True) as c:
            c.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


def run_on(admin_url: str, url: str | None, *, clients: int, seconds: float, scale: int = 10) -> dict:
    """One tpcb-like run on a database of pgbench_database, with its backends' CPU per transaction."""
    exe = find_pgbench()
    if exe is None or url is None:
        return {"error": "pgbench not found"}
    with Vacuuming(url, ("pgbench_branches", "pgbench_tellers")) as vac, BackendCpu(admin_url, urlsplit(url).path.lstrip("/")) as cpu:
        out = subprocess.run([exe, "-b", "tpcb-like", "-n", "-c", str(clients), "-j", str(min(clients, 4)),
                              "-T", str(max(1, int(seconds))), url], check=True, capture_output=True, text=True,
                             timeout=seconds + 120).stdout
    tps = float(re.search(r"tps = ([0-9.]+)", out).group(1))
    lat = re.search(r"latency average = ([0-9.]+) ms", out)
    n = re.search(r"number of transactions actually processed: ([0-9]+)", out)
    txns = int(n.group(1)) if n else None
    return {"tps": round(tps, 1), "clients": clients, "seconds": int(max(1, int(seconds))), "scale": scale,
            "transactions": txns, "latency_avg_ms": float(lat.group(1)) if lat else None,
            "pg_cpu_ms_per_txn": cpu.ms_per(txns or 0), **({"pg_cpu_note": cpu.note} if cpu.note else {}), **vac.note()}


def run_pgbench(admin_url: str, *, clients: int, seconds: float, scale: int = 10) -> dict:
    """One run on a database of its own (initialised, run, dropped)."""
    with pgbench_database(admin_url, scale=scale) as url:
        if url is None:
            return {"error": "pgbench not found"}
        return run_on(admin_url, url, clients=clients, seconds=seconds, scale=scale)
