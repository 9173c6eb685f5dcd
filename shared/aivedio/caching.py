"""Per-process caches of figures that may be a second old: lane depths, the price version in
force, budgets, breaker states. Each process keeps its own, in the platform's extras, so nothing
here is shared or needs invalidating across processes; a change made in this process is seen here
at once when its writer calls `clear` (aivedio.policy.tenant_policy.invalidate_caches)."""
from __future__ import annotations

import threading
import time

CACHE_SECONDS = 1.0
EXTRAS_KEY = "admission_cache"  # platform.extras


class _TTLCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, tuple[float, object]] = {}

    def get(self, key: str, load):
        now = time.monotonic()
        with self._lock:
            hit = self._data.get(key)
            if hit and now - hit[0] < CACHE_SECONDS:
                return hit[1]
        value = load()
        with self._lock:
            self._data[key] = (now, value)
        return value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()


def _cache(platform) -> _TTLCache:
    return platform.extras.setdefault(EXTRAS_KEY, _TTLCache())


def cached(platform, key: str, load):
    """A per-process value reloaded at most every CACHE_SECONDS."""
    return _cache(platform).get(key, load)


def clear(platform) -> None:
    """Forget this process's cached figures: the next read loads each again."""
    _cache(platform).clear()
