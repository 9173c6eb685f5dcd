"""The platform's wiring for one process: settings, config, clock, database and cache.

Lambda handlers call get_platform() once per cold start; the local runtime and tests build their
own Platform and install it with set_platform(), so the same handler code runs everywhere."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from aivedio import wakeups
from aivedio.cache.client import Cache, connect_cache_or_fail
from aivedio.cloud_config import load_platform_config
from aivedio.cloud_credentials import rds_iam_password, redis_url_with_secret
from aivedio.config import Clock, ConfigError, PlatformConfig, Settings, settings_from_env
from aivedio.db.migrate import migrate as run_migrations
from aivedio.db.pool import Database, connect_or_fail, with_password


@dataclass
class Platform:
    settings: Settings
    config: PlatformConfig
    clock: Clock
    db: Database
    cache: Cache | None
    extras: dict[str, Any] = field(default_factory=dict)  # wake-up events, simulator handles, ...

    def wake(self, name: str) -> None:
        """Run loop `name` now instead of at its next interval: the local loop of this process, else
        (in AWS) a continuous Lambda run waiting on Redis (aivedio.wakeups); a no-op without Redis."""
        event = self.extras.get("wake", {}).get(name)
        if event is not None:
            event.set()
        elif self.cache is not None:
            wakeups.push(self.cache, name)

    def close(self) -> None:
        held = self.extras.pop("wake_redis", None)
        if held is not None:
            held[1].close()
        if self.cache is not None:
            self.cache.close()
        self.db.close()


def resolve_urls(settings: Settings) -> tuple[str, str | None]:
    """The database and Redis URLs to use. Both must be given: the local tools fill them with the
    embedded servers first (aivedio_tools.local.embedded.with_embedded_servers), and a deployed function
    never starts a server. A Redis secret (AWS) supplies the credentials the URL leaves out."""
    if settings.database_url is None:
        raise ConfigError("AIVEDIO_DATABASE_URL: not set (a postgresql:// URL is required here)")
    if settings.redis_disabled:
        return settings.database_url, None
    if settings.redis_url is None:
        raise ConfigError("AIVEDIO_REDIS_URL: not set (a redis:// URL, or 'none' for conservative mode)")
    redis_url = settings.redis_url
    if settings.redis_secret_arn:
        redis_url = redis_url_with_secret(redis_url, settings.redis_secret_arn)
    return settings.database_url, redis_url


def database_password(settings: Settings, db_url: str):
    """None, or the provider of a fresh RDS IAM token per connection (AWS, through RDS Proxy)."""
    if not settings.database_iam_auth:
        return None

    return rds_iam_password(db_url)


def build_platform(
    settings: Settings | None = None,
    config: PlatformConfig | None = None,
    *,
    clock: Clock | None = None,
    pool_size: int = 10,
    migrate: bool = False,
) -> Platform:
    settings = settings or settings_from_env()
    config = config or load_platform_config(settings)
    db_url, redis_url = resolve_urls(settings)
    password = database_password(settings, db_url)
    connect_or_fail(db_url, password=password)
    if migrate:
        run_migrations(db_url if password is None else with_password(db_url, password()))
    cache = connect_cache_or_fail(redis_url, settings.redis_prefix) if redis_url else None
    db = Database(db_url, max_size=pool_size, password=password)
    return Platform(settings, config, clock or Clock(config.time_scale), db, cache)


_lock = threading.Lock()
_platform: Platform | None = None


def get_platform() -> Platform:
    global _platform
    with _lock:
        if _platform is None:
            _platform = build_platform()
        return _platform


def set_platform(p: Platform | None) -> None:
    global _platform
    with _lock:
        _platform = p
