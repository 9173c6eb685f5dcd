"""Ordered SQL migrations, tracked in schema_migration, applied under an advisory lock so that
several processes may run `aivedio db migrate` at once and leave one schema."""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import psycopg

log = logging.getLogger(__name__)
MIGRATIONS_DIR = Path(__file__).parent / "migrations"
# Any constant shared by every migrator; it serialises them.
MIGRATION_LOCK_KEY = 0x41_56_4D_49_47  # "AVMIG"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def discover(directory: Path = MIGRATIONS_DIR) -> list[Migration]:
    found = []
    for p in sorted(directory.glob("[0-9][0-9][0-9][0-9]_*.sql")):
        found.append(Migration(int(p.name[:4]), p.stem[5:], p.read_text()))
    versions = [m.version for m in found]
    if len(versions) != len(set(versions)):
        raise RuntimeError("two migrations share a version number")
    return found


def schema_fingerprint(directory: Path = MIGRATIONS_DIR) -> str:
    h = hashlib.sha256()
    for m in discover(directory):
        h.update(f"{m.version}:{m.checksum}".encode())
    return h.hexdigest()[:12]


def migrate(url: str, directory: Path = MIGRATIONS_DIR) -> list[int]:
    """Apply every migration not yet applied. Returns the versions applied by this call."""
    applied_now: list[int] = []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("select pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        try:
            conn.execute(
                """create table if not exists schema_migration (
                       version integer primary key,
                       name text not null,
                       checksum text not null,
                       applied_at timestamptz not null default now())"""
            )
            done = {r[0]: r[1] for r in conn.execute("select version, checksum from schema_migration")}
            for m in discover(directory):
                if m.version in done:
                    if done[m.version] != m.checksum:
                        raise RuntimeError(f"migration {m.version:04d}_{m.name} was edited after it was applied")
                    continue
                with conn.transaction():
                    conn.execute(m.sql)
                    conn.execute(
                        "insert into schema_migration (version, name, checksum) values (%s, %s, %s)",
                        (m.version, m.name, m.checksum),
                    )
                log.info("applied migration %04d_%s", m.version, m.name)
                applied_now.append(m.version)
        finally:
            conn.execute("select pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
    return applied_now
