"""Token buckets for submit and cancel rates: one short Lua script in Redis, and a PostgreSQL
bucket when Redis is down, so a Redis outage never means admitting without limits."""
from __future__ import annotations

import math
from dataclasses import dataclass

from aivedio import degraded
from aivedio.cache.client import CacheUnavailable
from aivedio.observability import due, logger

WARN_EVERY_SECONDS = 60.0


@dataclass(frozen=True)
class RateDecision:
    allowed: bool
    retry_after_seconds: int = 0


def _refill_per_ms(per_minute: int, time_scale: float) -> float:
    return per_minute / 60_000.0 * time_scale


def _redis_key(cache, slot: str, bucket: str) -> str:
    return cache.key_in_slot("rate", slot, bucket)


def take(platform, bucket: str, per_minute: int, cost: int = 1, *, slot: str) -> RateDecision:
    """Take `cost` tokens from the bucket named `bucket` whose capacity and refill are per_minute
    (`slot`: as take_all's)."""
    if per_minute <= 0:
        return RateDecision(False, 60)
    rate = _refill_per_ms(per_minute, platform.clock.time_scale)
    if platform.cache is not None:
        cache = platform.cache
        try:
            allowed, retry_ms = cache.run(cache.script("token_bucket"), keys=[_redis_key(cache, slot, bucket)], args=[per_minute, rate, cost])
            return RateDecision(bool(allowed), math.ceil(int(retry_ms) / 1000))
        except CacheUnavailable as e:
            degraded.redis_down(platform, str(e))
            if due("rate-limit-redis-down", WARN_EVERY_SECONDS):  # once a minute, not once per request
                logger.warning("redis unavailable for rate limit; using PostgreSQL bucket", extra={"bucket": bucket, "error": str(e)})
    return _take_pg(platform, bucket, per_minute, rate, cost)


def take_all(platform, buckets: list[tuple[str, int]], cost: int = 1, *, slot: str) -> tuple[int, RateDecision] | None:
    """take() from each (bucket, per_minute) in order, in one Redis call (token_buckets.lua): the
    first bucket that refuses ends it, and the ones after it are not touched, exactly as calling
    take() for each in turn until one refuses. Returns (index, decision) of the refusal, or None
    when every bucket gave. Without Redis each bucket is taken from PostgreSQL in turn.

    `slot` is the hash tag every bucket's Redis key carries (admission: the tenant), so the one
    script touches one slot on a cluster; the buckets of one name under different slots are
    different buckets, so a name is always taken under the same slot."""
    for n, (_, per_minute) in enumerate(buckets):
        if per_minute <= 0:  # refuses without a call, after the buckets before it gave
            refused = take_all(platform, buckets[:n], cost, slot=slot) if n else None
            return refused or (n, RateDecision(False, 60))
    if not buckets:
        return None
    scale = platform.clock.time_scale
    if platform.cache is not None:
        cache = platform.cache
        args: list = [cost]
        for _, per_minute in buckets:
            args += [per_minute, _refill_per_ms(per_minute, scale)]
        try:
            index, retry_ms = cache.run(cache.script("token_buckets"), keys=[_redis_key(cache, slot, b) for b, _ in buckets], args=args)
            index = int(index)
            return None if index == 0 else (index - 1, RateDecision(False, math.ceil(int(retry_ms) / 1000)))
        except CacheUnavailable as e:
            degraded.redis_down(platform, str(e))
            if due("rate-limit-redis-down", WARN_EVERY_SECONDS):
                logger.warning("redis unavailable for rate limit; using PostgreSQL bucket", extra={"bucket": buckets[0][0], "error": str(e)})
    for n, (bucket, per_minute) in enumerate(buckets):
        d = _take_pg(platform, bucket, per_minute, _refill_per_ms(per_minute, scale), cost)
        if not d.allowed:
            return n, d
    return None


def give_back(platform, buckets: list[tuple[str, int]], cost: int = 1, *, slot: str) -> None:
    """Give `cost` tokens back to each of the buckets take_all took them from (a request that spent
    none after all: admission's replay): the same call with the cost negated, which adds them, up to
    each bucket's capacity."""
    take_all(platform, [(b, per_minute) for b, per_minute in buckets if per_minute > 0], cost=-cost, slot=slot)


def _take_pg(platform, bucket: str, capacity: int, rate_per_ms: float, cost: int) -> RateDecision:
    def fn(conn):
        conn.execute(
            "insert into rate_limit_bucket (bucket_key, tokens, updated_at) values (%s, %s, clock_timestamp()) on conflict do nothing",
            (bucket, capacity),
        )
        row = conn.execute(
            """select tokens::float8 as tokens, extract(epoch from clock_timestamp() - updated_at) * 1000 as elapsed_ms
                 from rate_limit_bucket where bucket_key = %s for update""",
            (bucket,),
        ).fetchone()
        tokens = min(float(capacity), row["tokens"] + max(0.0, float(row["elapsed_ms"])) * rate_per_ms)
        allowed = tokens >= cost
        if allowed:
            tokens = min(float(capacity), tokens - cost)  # a negative cost gives tokens back, up to the capacity
        conn.execute("update rate_limit_bucket set tokens = %s, updated_at = clock_timestamp() where bucket_key = %s",
                     (tokens, bucket))
        return RateDecision(allowed, 0 if allowed else math.ceil((cost - tokens) / rate_per_ms / 1000))

    return platform.db.transaction(fn)
