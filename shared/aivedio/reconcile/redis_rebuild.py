"""`aivedio rebuild redis`: every Redis structure, rebuilt from PostgreSQL (ch. 18.16.6).

Redis holds speed, never facts. What lives under the platform's prefix, and how each comes back:

| keys                              | what                                  | after a rebuild (or a flush)            |
|-----------------------------------|---------------------------------------|-----------------------------------------|
| queue:{LANE}:active_tenants/_set, | each lane's ring of tenants with      | rebuilt here from PostgreSQL's QUEUED   |
| queue:index_built:LANE            | queued work, and its built marker     | tasks (Ring.rebuild); without a marker  |
|                                   |                                       | the tick runs conservatively and        |
|                                   |                                       | rebuilds the lane itself                |
| rate:{TENANT}:*                   | submit and cancel token buckets       | start full: nothing in PostgreSQL says  |
|                                   |                                       | how full they were; a client may get at |
|                                   |                                       | most one bucket's burst once            |
| budget-burn:*                     | burn-rate mirror of the budgets       | an accelerator with a 5 s TTL: refilled |
|                                   | (aivedio.spend.budgets)             | by the next admission; PostgreSQL's     |
|                                   |                                       | budget check decides meanwhile          |
| wake:*                            | wake-up hints between loops           | hints only: every loop also polls       |

Capacity counters live in PostgreSQL (resource_pool_shard), not in Redis: their repair is the
capacity-counters service. The rebuild drops the prefix first, so nothing stale survives it; a
tick meanwhile finds a lane's marker missing and serves that lane from PostgreSQL for one tick."""
from __future__ import annotations

from typing import Any

import psycopg

from aivedio.cache.client import CacheUnavailable
from aivedio.errors import DomainError
from aivedio.scheduling.ring import Ring

NOT_REBUILT = {
    "rate": "token buckets start full (no fact in PostgreSQL says how full they were)",
    "budget-burn": "accelerator with a 5 s TTL, refilled by the next admission; PostgreSQL decides meanwhile",
    "wake": "wake-up hints; every loop also polls at its interval",
}


class RedisUnavailable(DomainError):
    code = "REDIS_UNAVAILABLE"


def rebuild_redis(platform, conn: psycopg.Connection) -> dict[str, Any]:
    """Drop every key under the platform's prefix, then rebuild each lane's ring from QUEUED tasks.
    Raises RedisUnavailable when Redis is disabled or does not answer (nothing is rebuilt)."""
    cache = platform.cache
    if cache is None:
        raise RedisUnavailable("this platform runs without Redis (AIVEDIO_REDIS_URL=none): nothing to rebuild")
    try:
        dropped = cache.run(cache.delete_prefix)
    except CacheUnavailable as e:
        raise RedisUnavailable(f"redis does not answer: {e}") from None
    ring = Ring(platform)
    lanes: dict[str, dict[str, Any]] = {}
    for lane in platform.config.lanes:
        ring.rebuild(conn, lane)
        if not ring.redis_ready(lane):  # the rebuild could not write (Redis went away meanwhile)
            raise RedisUnavailable(f"redis stopped answering while lane {lane} was rebuilt; run it again")
        members, listed = ring.members(lane)
        lanes[lane] = {"tenants": len(members), "ring_length": len(listed)}
    return {"prefix": cache.prefix, "keys_dropped": dropped, "lanes": lanes,
            "tenants_indexed": sum(v["tenants"] for v in lanes.values()), "not_rebuilt": NOT_REBUILT}
