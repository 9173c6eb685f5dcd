"""The CPU time PostgreSQL's backends spend on one database during a measurement, read from
/proc/<pid>/stat (utime + stime) of the backends pg_stat_activity lists for that database.

The backends are sampled every `interval` seconds from a thread, so a backend that connects or
exits inside the window is counted too (a new one from zero, an exiting one up to its last sample:
at most `interval` of its CPU is missed, which is why pgbench's short-lived backends are sampled
rather than read once before and after). Only works when the server runs on this machine: a pid
that is not a postgres process here makes the figure unreadable, and `note` says why."""
from __future__ import annotations

import os
import threading

import psycopg

VACUUM_APPLICATION = "aivedio-bench-vacuum"  # Vacuuming's connection: autovacuum's stand-in, not the bench's work
BACKENDS = """select pid from pg_stat_activity
               where datname = %s and backend_type = 'client backend' and pid <> pg_backend_pid()
                 and application_name <> '""" + VACUUM_APPLICATION + "'"


def _cpu_seconds(pid: int) -> float | None:
    """utime + stime of a postgres process, in seconds; None when it is gone. Raises
    PermissionError or ValueError when the pid is not a readable postgres process here."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    if not comm.startswith("postgres"):
        raise ValueError(f"pid {pid} is {comm!r} here, not a postgres backend: the server is not on this machine")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class BackendCpu:
    """with BackendCpu(admin_url, dbname) as cpu: ...; then cpu.seconds (None, and cpu.note, when
    it could not be read)."""

    def __init__(self, admin_url: str, dbname: str, interval: float = 0.05):
        self.admin_url, self.dbname, self.interval = admin_url, dbname, interval
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.note: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection | None = None

    def _sample(self, initial: bool = False) -> None:
        if self.note is not None:
            return
        try:
            pids = [r[0] for r in self._conn.execute(BACKENDS, (self.dbname,)).fetchall()]
            for pid in pids:
                v = _cpu_seconds(pid)
                if v is None:
                    continue
                # A backend seen at the start counts from there; one born later from zero.
                self.first.setdefault(pid, v if initial else 0.0)
                self.last[pid] = v
        except (OSError, ValueError) as e:
            self.note = f"backend CPU not readable: {e}"
        except psycopg.Error as e:
            self.note = f"backend CPU not readable: pg_stat_activity: {e}"

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "BackendCpu":
        try:
            self._conn = psycopg.connect(self.admin_url, autocommit=True)
        except psycopg.Error as e:
            self.note = f"backend CPU not readable: {e}"
            return self
        self._sample(initial=True)
        self._thread = threading.Thread(target=self._run, name="pg-backend-cpu", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._conn is not None:
            self._sample()
            self._conn.close()

    @property
    def seconds(self) -> float | None:
        if self.note is not None:
            return None
        if not self.last:
            self.note = "backend CPU not readable: no backend of the database was seen"
            return None
        return sum(v - self.first.get(pid, 0.0) for pid, v in self.last.items())

    def ms_per(self, n: int) -> float | None:
        s = self.seconds
        return round(1000 * s / n, 3) if s is not None and n else None


class Vacuuming:
    """Autovacuum's work on the few rows a benchmark updates over and over (a wallet, its lot, the
    cost windows; pgbench's branches and tellers), when the server runs without autovacuum (a test
    server may): `VACUUM (ANALYZE)` of `tables` every `every` seconds on the bench database, so a
    run measures what a production server would see, not a heap and its indexes bloating for the
    lack of it. Does nothing when autovacuum is on. `runs` says how many it made."""

    def __init__(self, url: str, tables: tuple[str, ...], every: float = 1.0):
        self.url, self.tables, self.every = url, tables, every
        self.runs = 0
        self.active = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True, application_name=VACUUM_APPLICATION) as c:
                while not self._stop.wait(self.every):
                    c.execute("vacuum (analyze) " + ", ".join(self.tables))
                    self.runs += 1
        except psycopg.Error:
            return  # the database went away with its run

    def __enter__(self) -> "Vacuuming":
        with psycopg.connect(self.url, autocommit=True) as c:
            self.active = c.execute("show autovacuum").fetchone()[0] == "off"
        if self.active:
            self._thread = threading.Thread(target=self._run, name="bench-vacuum", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def note(self) -> dict:
        return {"autovacuum_off_so_vacuumed": list(self.tables), "vacuum_runs": self.runs} if self.active else {}
