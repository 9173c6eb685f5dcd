from __future__ import annotations

from pathlib import Path
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from aivedio.config import ConfigError

LUA_DIR = Path(__file__).parent / "lua"


class CacheUnavailable(Exception):
    """Redis cannot answer; callers fall back to PostgreSQL."""


class Cache:
    def __init__(self, url: str, prefix: str = "av"):
        self.url = url
        self.prefix = prefix
        self.r = redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5, decode_responses=True)
        self._scripts: dict[str, Any] = {}

    def key(self, *parts: object) -> str:
        return ":".join([self.prefix, *map(str, parts)])

    def script(self, name: str):
        if name not in self._scripts:
            self._scripts[name] = self.r.register_script((LUA_DIR / f"{name}.lua").read_text())
        return self._scripts[name]

    def run(self, fn, *args, **kwargs):
        """Call a redis operation, turning transport failures into CacheUnavailable."""
        try:
            return fn(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise CacheUnavailable(str(e)) from e
        except RedisError as e:
            if "LOADING" in str(e) or "READONLY" in str(e):
                raise CacheUnavailable(str(e)) from e
            raise

    def healthy(self) -> bool:
        try:
            return bool(self.r.ping())
        except (RedisError, OSError):
            return False

    def delete_prefix(self) -> int:
        """Drop every key under this prefix (tests, and `rebuild redis` before it rebuilds)."""
        n = 0
        for k in self.r.scan_iter(match=f"{self.prefix}:*", count=1000):
            n += self.r.delete(k)
        return n

    def close(self) -> None:
        self.r.close()


def connect_cache_or_fail(url: str, prefix: str) -> Cache:
    c = Cache(url, prefix)
    try:
        c.r.ping()
    except (RedisError, OSError) as e:
        raise ConfigError(f"redis {url}: unreachable: {e}") from None
    return c
