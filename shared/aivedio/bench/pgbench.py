"""The baseline: pgbench's built-in tpcb-like script on the same PostgreSQL server."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql


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


def run_pgbench(admin_url: str, *, clients: int, seconds: float, scale: int = 10) -> dict:
    exe = find_pgbench()
    if exe is None:
        return {"error": "pgbench not found"}
    name = "aivedio_bench_pgbench"
    with psycopg.connect(admin_url, autocommit=True) as c:
        c.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))
        c.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    url = with_database(admin_url, name)
    try:
        subprocess.run([exe, "-i", "-q", "-s", str(scale), url], check=True, capture_output=True, text=True, timeout=300)
        out = subprocess.run([exe, "-b", "tpcb-like", "-n", "-c", str(clients), "-j", str(min(clients, 4)),
                              "-T", str(max(1, int(seconds))), url], check=True, capture_output=True, text=True,
                             timeout=seconds + 120).stdout
    finally:
        with psycopg.connect(admin_url, autocommit=True) as c:
            c.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))
    tps = float(re.search(r"tps = ([0-9.]+)", out).group(1))
    lat = re.search(r"latency average = ([0-9.]+) ms", out)
    return {"tps": round(tps, 1), "clients": clients, "seconds": int(seconds), "scale": scale,
            "latency_avg_ms": float(lat.group(1)) if lat else None}
