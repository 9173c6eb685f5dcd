"""Resource keys and their sharded counters (ch. 18.5, 18.9.3, 18.16.4).

A claim reserves every dimension it uses, each checked on its own by a conditional increment of one
resource_pool_shard row. Big pools are split over several shards so no single row is a hot spot;
per-tenant and per-user keys have one shard. Releases go ACTIVE -> RELEASED by CAS, and only the
transaction that wins that CAS decrements the counters."""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import psycopg

from aivedio.config import PlatformConfig


@dataclass(frozen=True)
class Demand:
    key: str
    units: int
    shards: int = 1  # how many shards the key is split over


def split(total: int, shards: int) -> list[int]:
    """Capacity per shard, summing to total."""
    base, extra = divmod(total, shards)
    return [base + (1 if i < extra else 0) for i in range(shards)]


def provider_key(provider: str, account: str, region: str, model: str) -> str:
    return f"provider:{provider}:{account}:{region}:{model}"


def account_key(provider: str, account: str) -> str:
    return f"provider-account:{provider}:{account}"


def platform_pools(config: PlatformConfig) -> dict[str, tuple[int, int]]:
    """Every pool the config defines: key -> (capacity, shards)."""
    n = config.limits.pool_shards
    pools: dict[str, tuple[int, int]] = {}
    for lane, lc in config.lanes.items():
        pools[f"lane:{lane}"] = (lc.capacity_units, n)
        if lc.borrowable_units:
            pools[f"lane:{lane}:lent"] = (lc.borrowable_units, 1)
    for p in config.providers:
        for a in p.accounts:
            pools[account_key(p.name, a.account_id)] = (a.max_concurrency, n)
            for m in p.models:
                pools[provider_key(p.name, a.account_id, a.region, m)] = (a.max_concurrency, n)
    for m in config.models:
        pools[f"model:{m}"] = (config.limits.model_global_running_cap, n)
    pools["worker:cpu"] = (config.pools.worker_cpu_units, n)
    pools["worker:gpu"] = (config.pools.worker_gpu_units, n)
    pools["cost:platform"] = (config.limits.platform_cost_per_minute, n)
    return pools


def ensure_pool(conn: psycopg.Connection, key: str, capacity: int, shards: int = 1) -> None:
    """Create a pool's shards, or move their capacity to the configured total. Lowering below what
    runs keeps capacity at `used` and sets the limit, so running work drains and is never cut."""
    ensure_pools(conn, [(key, capacity, shards)])


def ensure_pools(conn: psycopg.Connection, pools: list[tuple[str, int, int]]) -> None:
    """ensure_pool for several (key, capacity, shards) at once: one pipelined round trip."""
    rows = [{"k": key, "s": i, "c": c} for key, capacity, shards in pools for i, c in enumerate(split(capacity, shards))]
    with conn.cursor() as cur:
        cur.executemany(
            """insert into resource_pool_shard (resource_key, shard_no, capacity_units, used_units, limit_units)
               values (%(k)s, %(s)s, %(c)s, 0, null)
               on conflict (resource_key, shard_no) do update
                  set capacity_units = greatest(excluded.capacity_units, resource_pool_shard.used_units),
                      limit_units = case when excluded.capacity_units < resource_pool_shard.used_units
                                         then excluded.capacity_units else null end,
                      version = resource_pool_shard.version + 1, updated_at = now()
                where resource_pool_shard.capacity_units is distinct from excluded.capacity_units
                   or resource_pool_shard.limit_units is not null""",
            rows,
        )


def ensure_platform_pools(conn: psycopg.Connection, config: PlatformConfig) -> None:
    """Create or resize the config's pools. Only pools whose shards differ from the config are
    written: an upsert locks its row even when it changes nothing, so touching every shard made a
    process start wait for (and deadlock with) the claims and releases running, and it lifted the
    adaptive limits (AIMD) that a start must leave alone."""
    pools = platform_pools(config)
    have = {(r["resource_key"], r["shard_no"]): r["capacity_units"]
            for r in conn.execute("select resource_key, shard_no, capacity_units from resource_pool_shard where resource_key = any(%s)",
                                  (list(pools),)).fetchall()}
    todo = [(key, cap, shards) for key, (cap, shards) in sorted(pools.items())
            if [have.get((key, i)) for i in range(shards)] != split(cap, shards)]
    if todo:
        ensure_pools(conn, todo)


def set_limit(conn: psycopg.Connection, key: str, total_limit: int | None) -> None:
    """An adaptive limit across a key's shards (None lifts it)."""
    rows = conn.execute("select shard_no, capacity_units from resource_pool_shard where resource_key = %s order by shard_no",
                        (key,)).fetchall()
    if not rows:
        return
    limits = [None] * len(rows) if total_limit is None else split(total_limit, len(rows))
    with conn.cursor() as cur:
        cur.executemany("update resource_pool_shard set limit_units = %s, version = version + 1 where resource_key = %s and shard_no = %s",
                        [(lim, key, r["shard_no"]) for lim, r in zip(limits, rows)])


def try_increment(conn: psycopg.Connection, key: str, units: int, prefer: int, shards: int) -> int | None:
    """The conditional increment of ch. 18.9.3 on the preferred shard, then on any shard with room.
    Returns the shard used, or None when the key has no room (the caller rolls back)."""
    row = conn.execute(
        """update resource_pool_shard set used_units = used_units + %(u)s, version = version + 1
            where resource_key = %(k)s and shard_no = %(s)s
              and used_units + %(u)s <= least(capacity_units, coalesce(limit_units, capacity_units))
            returning shard_no""",
        {"k": key, "s": prefer % shards, "u": units},
    ).fetchone()
    if row is None and shards > 1:
        row = conn.execute(
            """update resource_pool_shard set used_units = used_units + %(u)s, version = version + 1
                where resource_key = %(k)s and shard_no = (
                      select shard_no from resource_pool_shard
                       where resource_key = %(k)s and shard_no <> %(s)s
                         and used_units + %(u)s <= least(capacity_units, coalesce(limit_units, capacity_units))
                       order by used_units limit 1 for update skip locked)
                  and used_units + %(u)s <= least(capacity_units, coalesce(limit_units, capacity_units))
                returning shard_no""",
            {"k": key, "s": prefer % shards, "u": units},
        ).fetchone()
    return None if row is None else row["shard_no"]


def preferred_shard(ident: UUID | str) -> int:
    return zlib.crc32(str(ident).encode())


def release_attempt(conn: psycopg.Connection, attempt_id: UUID, now: datetime) -> list[dict]:
    """Release every ACTIVE reservation of an attempt. The CAS to RELEASED decides who decrements:
    a second release finds nothing ACTIVE and changes nothing."""
    released = conn.execute(
        """update resource_reservation set state = 'RELEASED', released_at = %s
            where attempt_id = %s and state = 'ACTIVE'
            returning resource_key, shard_no, reserved_units""",
        (now, attempt_id),
    ).fetchall()
    if released:
        with conn.cursor() as cur:
            cur.executemany(
                """update resource_pool_shard set used_units = used_units - %(reserved_units)s, version = version + 1
                    where resource_key = %(resource_key)s and shard_no = %(shard_no)s""",
                sorted(released, key=lambda r: (r["resource_key"], r["shard_no"])),
            )
    return released


def free_units(conn: psycopg.Connection, key: str) -> int:
    row = conn.execute(
        """select coalesce(sum(greatest(0, least(capacity_units, coalesce(limit_units, capacity_units)) - used_units)), 0)::bigint as free
             from resource_pool_shard where resource_key = %s""",
        (key,),
    ).fetchone()
    return int(row["free"])


def rebuild_counters(conn: psycopg.Connection) -> int:
    """Reset every counter to the sum of its ACTIVE reservations (ch. 18.16.6: the reservations are
    the fact, never a cached count). Returns how many shards were corrected."""
    return conn.execute(
        """with truth as (
               select s.resource_key, s.shard_no, coalesce(sum(r.reserved_units), 0)::bigint as used
                 from resource_pool_shard s
                 left join resource_reservation r
                   on r.resource_key = s.resource_key and r.shard_no = s.shard_no and r.state = 'ACTIVE'
                group by s.resource_key, s.shard_no)
           update resource_pool_shard s set used_units = t.used, capacity_units = greatest(s.capacity_units, t.used),
                  version = s.version + 1, updated_at = now()
             from truth t
            where s.resource_key = t.resource_key and s.shard_no = t.shard_no and s.used_units <> t.used"""
    ).rowcount
