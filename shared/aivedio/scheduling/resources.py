"""Resource keys and their sharded counters (ch. 18.5, 18.9.3, 18.16.4).

A claim reserves every dimension it uses, each checked on its own by a conditional increment of one
resource_pool_shard row. Big pools are split over several shards so no single row is a hot spot;
per-tenant and per-user keys have one shard. Releases go ACTIVE -> RELEASED by CAS, and only the
transaction that wins that CAS decrements the counters."""
from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import psycopg

from aivedio.config import PlatformConfig
from aivedio.faults import safeguards
from aivedio.observability import logger
from aivedio.policy.capacity import Overrides, apply_overrides, load_overrides, overrides
from aivedio.tasks import TERMINAL


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
    # The media workers' slots, one pool per media resource class (aivedio.media.pipeline), one shard
    # each: a job takes up to 6 units, which must fit on one shard.
    for media_class, units in media_pool_units(config).items():
        pools[media_pool_key(media_class)] = (units, 1)
    pools["cost:platform"] = (config.limits.platform_cost_per_minute, n)
    return pools


def media_pool_key(media_class: str) -> str:
    """The pool of one media resource class's worker slots: worker:cpu-proxy, worker:gpu-render, ..."""
    return f"worker:{media_class}"


def media_pool_units(config: PlatformConfig) -> dict[str, int]:
    m = config.media
    return {"cpu-proxy": m.cpu_proxy_units, "gpu-render": m.gpu_render_units, "gpu-highmem": m.gpu_highmem_units}


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


def effective_pools(config: PlatformConfig, ov: Overrides) -> dict[str, tuple[int, int]]:
    """platform_pools of the effective config, with the POOL overrides: key -> (capacity, shards)."""
    pools = platform_pools(apply_overrides(config, ov))
    for key, s in ov.of_kind("POOL").items():
        if key in pools and "capacity_units" in s:
            pools[key] = (int(s["capacity_units"]), pools[key][1])
    return pools


def ensure_platform_pools(conn: psycopg.Connection, config: PlatformConfig) -> None:
    """Create or resize the config's pools. Only pools whose shards differ from the config are
    written: an upsert locks its row even when it changes nothing, so touching every shard made a
    process start wait for (and deadlock with) the claims and releases running, and it lifted the
    adaptive limits (AIMD) that a start must leave alone. An operator's overrides (migration 0170,
    aivedio.policy.capacity) apply on top of the config, so a start never undoes them, nor splits a
    pool whose lowered capacity is still draining (resize_pool, as the operator's change did)."""
    def unsettled(keys: list[str] | None) -> tuple[dict[str, tuple[int, int]], dict[str, list[int]], list[str]]:
        """The pools in force, the shard numbers each key has, and the keys (of `keys`, default
        all) whose shards are not the plain split of their capacity."""
        pools = effective_pools(config, load_overrides(conn))
        keys = list(pools) if keys is None else keys
        have: dict[str, dict[int, int]] = {}
        for r in conn.execute("select resource_key, shard_no, capacity_units from resource_pool_shard where resource_key = any(%s)",
                              (keys,)).fetchall():
            have.setdefault(r["resource_key"], {})[r["shard_no"]] = r["capacity_units"]
        shard_nos = {k: sorted(v) for k, v in have.items()}
        todo = [k for k in sorted(keys) if k in pools
                and [have.get(k, {}).get(i) for i in range(pools[k][1])] != split(*pools[k])]
        return pools, shard_nos, todo

    _, _, candidates = unsettled(None)
    if not candidates:
        return
    with conn.transaction():
        # As converge (below): the candidates' shards locked first (key, shard order, as
        # claims take them), then the overrides and shards read again, so an operator's change
        # committed meanwhile is applied, never undone by the overrides read above.
        conn.execute("""select 1 from resource_pool_shard where resource_key = any(%s) order by resource_key, shard_no
                        for update""", (candidates,))
        pools, shard_nos, todo = unsettled(candidates)
        # A pool without shards is created from the split; an existing one is moved by resize_pool,
        # from what runs on each shard: while a lowered capacity drains (more running on a shard
        # than its share), a plain split would give the other shards their full share as well. The
        # adaptive (AIMD) limits stay.
        missing = [(k, *pools[k]) for k in todo if k not in shard_nos]
        if missing:
            ensure_pools(conn, missing)
        for k in todo:
            if k not in shard_nos:
                continue
            cap, shards = pools[k]
            if gaps := [i for i in range(shards) if i not in shard_nos[k]]:  # more shards now: the new ones start empty
                with conn.cursor() as cur:
                    cur.executemany("""insert into resource_pool_shard (resource_key, shard_no, capacity_units, used_units, limit_units)
                                       values (%s, %s, 0, 0, null) on conflict do nothing""", [(k, i) for i in gaps])
            resize_pool(conn, k, cap, shards, keep_adaptive=True)


def shard_allocation(total: int, used: list[int]) -> list[tuple[int, int | None]]:
    """(capacity, limit) per shard that moves a pool to `total` units while `used` units run on its
    shards, such that no claim ever takes the pool's units in use past `total`, however the running
    work is spread over the shards (split() alone would let an under-used shard fill while another
    still holds more than its share). Running work is never cut: capacity stays >= used.
    - every shard within its share: the plain split, no limit;
    - the pool within total but some shard over its share: each shard keeps what runs, and the room
      left goes to the shards under their share (the capacities add up to total);
    - more running than total: no shard takes new work until the excess has drained; a shard's limit
      is what it would still hold if the whole excess left it (sum(limits) <= total). That holds
      back more than needed meanwhile, so a later resize (converge, below) re-splits."""
    target = split(total, len(used))
    if all(u <= t for u, t in zip(used, target)):
        return [(t, None) for t in target]
    over = sum(used) - total
    if over > 0:
        return [(u, lim if (lim := max(0, u - over)) < u else None) for u in used]
    room, out = -over, []
    for u, t in zip(used, target):
        give = min(room, max(0, t - u))
        room -= give
        out.append((u + give, None))
    return out


def resize_pool(conn: psycopg.Connection, key: str, total: int, shards: int, *, keep_adaptive: bool = False) -> bool:
    """Move an existing pool to `total` units now, under its shards' row locks (key order, as claims
    take them), by shard_allocation(); a pool without shards is created. `keep_adaptive` keeps an
    adaptive (AIMD) limit below the new capacity; otherwise an operator's resize lifts it (the next
    429 sets it again). Returns whether any shard changed."""
    rows = conn.execute("""select shard_no, capacity_units, used_units, limit_units from resource_pool_shard
                            where resource_key = %s order by shard_no for update""", (key,)).fetchall()
    if not rows:
        ensure_pools(conn, [(key, total, shards)])
        return True
    alloc = shard_allocation(total, [int(r["used_units"]) for r in rows])
    # A drain (capacities above the total) set its own limits; otherwise a limit is the adaptive one.
    adaptive = keep_adaptive and sum(int(r["capacity_units"]) for r in rows) <= total
    changes = []
    for r, (cap, lim) in zip(rows, alloc):
        if adaptive and lim is None and r["limit_units"] is not None and r["limit_units"] < cap:
            lim = r["limit_units"]
        if (r["capacity_units"], r["limit_units"]) != (cap, lim):
            changes.append({"k": key, "s": r["shard_no"], "c": cap, "l": lim})
    if changes:
        with conn.cursor() as cur:
            cur.executemany("""update resource_pool_shard set capacity_units = %(c)s, limit_units = %(l)s,
                                      version = version + 1, updated_at = now()
                                where resource_key = %(k)s and shard_no = %(s)s""", changes)
    return bool(changes)


def pool_settled(capacities: list[int], total: int) -> bool:
    """Whether a pool's shard capacities are the plain split of `total`: nothing left for a resize
    to converge (a limit left then is the adaptive one's)."""
    return bool(capacities) and capacities == split(total, len(capacities))


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


# Whether an attempt's task is terminal: read only with release-on-terminal broken.
TASK_TERMINAL = """select 1 from task_attempt a join generation_task t on t.task_id = a.task_id
                    where a.attempt_id = %s and t.state = any(%s)"""


def release_attempt(conn: psycopg.Connection, attempt_id: UUID, now: datetime) -> list[dict]:
    """Release every ACTIVE reservation of an attempt. The CAS to RELEASED decides who decrements:
    a second release finds nothing ACTIVE and changes nothing."""
    if safeguards.broken("release-on-terminal") and conn.execute(TASK_TERMINAL, (attempt_id, list(TERMINAL))).fetchone() is not None:
        return []  # a chaos run only: a terminal task keeps its reservations ACTIVE (a requeue still releases)
    released = conn.execute(
        """update resource_reservation set state = 'RELEASED', released_at = %s
            where attempt_id = %s and state = 'ACTIVE'
            returning resource_key, shard_no, reserved_units""",
        (now, attempt_id),
    ).fetchall()
    _give_back(conn, released)
    return released


def reserve_key(conn: psycopg.Connection, *, task_id: UUID, tenant_id: UUID, attempt_id: UUID, key: str, units: int,
                fencing_token: int, lease_until: datetime, now: datetime, prefer: int, shards: int = 1) -> int | None:
    """Reserve `units` of one key for work of an attempt outside the claim (a media job's worker
    slots): the claim's conditional increment, then the reservation row, ACTIVE. The row's key is
    (attempt_id, resource_key), so work that runs again under the same attempt (a media retry)
    takes its RELEASED row back. Returns the shard, or None when the key has no room (nothing was
    written). Run under a savepoint: a row still ACTIVE means the caller holds the units already,
    and raises."""
    shard = try_increment(conn, key, units, prefer, shards)
    if shard is None:
        return None
    written = conn.execute(
        """insert into resource_reservation (task_id, attempt_id, tenant_id, resource_key, shard_no, reserved_units, state,
                                             lease_until, fencing_token, capacity_mode, created_at)
           values (%(task)s, %(attempt)s, %(tenant)s, %(key)s, %(shard)s, %(units)s, 'ACTIVE', %(lease)s, %(fencing)s, 'NORMAL', %(now)s)
           on conflict (attempt_id, resource_key) do update
              set shard_no = excluded.shard_no, reserved_units = excluded.reserved_units, state = 'ACTIVE',
                  lease_until = excluded.lease_until, fencing_token = excluded.fencing_token, created_at = excluded.created_at,
                  released_at = null
            where resource_reservation.state = 'RELEASED'""",
        {"task": task_id, "attempt": attempt_id, "tenant": tenant_id, "key": key, "shard": shard, "units": units,
         "lease": lease_until, "fencing": fencing_token, "now": now}).rowcount
    if not written:
        raise RuntimeError(f"attempt {attempt_id} already holds {key}")
    return shard


def _give_back(conn: psycopg.Connection, released: list[dict]) -> None:
    """Decrement the counters of the rows this transaction's CAS just moved to RELEASED, in key order."""
    if released:
        with conn.cursor() as cur:
            cur.executemany(
                """update resource_pool_shard set used_units = used_units - %(reserved_units)s, version = version + 1
                    where resource_key = %(resource_key)s and shard_no = %(shard_no)s""",
                sorted(released, key=lambda r: (r["resource_key"], r["shard_no"])),
            )


def release_keys(conn: psycopg.Connection, attempt_id: UUID, keys: list[str], now: datetime) -> list[dict]:
    """release_attempt for some keys of an attempt only (a media job's worker slots, while the rest
    of the attempt's rows are its own business). The same CAS: a second release changes nothing."""
    released = conn.execute(
        """update resource_reservation set state = 'RELEASED', released_at = %s
            where attempt_id = %s and resource_key = any(%s) and state = 'ACTIVE'
            returning resource_key, shard_no, reserved_units""",
        (now, attempt_id, list(keys)),
    ).fetchall()
    _give_back(conn, released)
    return released


def free_units(conn: psycopg.Connection, key: str) -> int:
    row = conn.execute(
        """select coalesce(sum(greatest(0, least(capacity_units, coalesce(limit_units, capacity_units)) - used_units)), 0)::bigint as free
             from resource_pool_shard where resource_key = %s""",
        (key,),
    ).fetchone()
    return int(row["free"])


# Per key, what the claim's conditional increment (used + units <= least(capacity, limit) on one
# shard: aivedio_claim, try_increment) would allow, read without a lock.
ROOM = """select resource_key,
                 max(least(capacity_units, coalesce(limit_units, capacity_units)) - used_units)::bigint as room,
                 sum(used_units)::bigint as used,
                 sum(least(capacity_units, coalesce(limit_units, capacity_units)))::bigint as capacity
            from resource_pool_shard where resource_key = any(%s) group by resource_key"""


@dataclass(frozen=True)
class Room:
    room: int  # the most units one claim can take: the free units of its emptiest shard
    used: int
    capacity: int  # the limit in force, summed over the shards


def rooms(conn: psycopg.Connection, keys: list[str]) -> dict[str, Room]:
    """A claim of u units on a key fits iff u <= rooms[key].room. A key without shards is absent:
    no claim fits there."""
    return {r["resource_key"]: Room(int(r["room"]), int(r["used"]), int(r["capacity"]))
            for r in conn.execute(ROOM, (list(keys),)).fetchall()}


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


# --- convergence: a pool resized below what ran, re-split as that work drains ---------------------------

# Platform seconds between two passes of `converge` in one process.
CONVERGE_SECONDS = 5.0
# The pools' shard rows, locked in the order claims lock them (key, then shard).
LOCK_SHARDS = """select 1 from resource_pool_shard where resource_key = any(%s) order by resource_key, shard_no
                  for update"""
# What claims obey now per pool: the capacity within each shard's limit, and the units in use.
POOL_STATE = """select resource_key, count(*)::int as shards, sum(used_units)::bigint as used,
                       sum(least(capacity_units, coalesce(limit_units, capacity_units)))::bigint as in_force,
                       bool_or(limit_units is not null) as limited,
                       array_agg(capacity_units order by shard_no) as capacities
                  from resource_pool_shard where resource_key = any(%s) group by resource_key"""

_CONVERGED = "capacity_converged_at"  # platform.extras: time.monotonic() of this process's last pass


def overridden_pool_keys(config: PlatformConfig, ov: Overrides) -> list[str]:
    """The pool keys that operator overrides set."""
    keys: list[str] = []
    for lane in ov.of_kind("LANE"):
        keys += [f"lane:{lane}", f"lane:{lane}:lent"]
    keys += list(ov.of_kind("POOL"))
    for okey in ov.of_kind("PROVIDER_ACCOUNT"):
        provider, _, account_id = okey.partition("/")
        p = config.provider(provider)
        a = next((a for a in p.accounts if a.account_id == account_id), None) if p else None
        if a is not None:
            keys += [account_key(p.name, a.account_id)] + [provider_key(p.name, a.account_id, a.region, m) for m in p.models]
    return keys


def converge(platform, *, force: bool = False) -> int:
    """Re-split each overridden pool that a resize left unsettled (lowered below what ran, the
    shards hold back more than needed as that work drains). At most once per CONVERGE_SECONDS per
    process; a read when nothing is overridden or every pool is settled. Returns pools resized."""
    now = time.monotonic()
    if not force and now - platform.extras.get(_CONVERGED, float("-inf")) < platform.clock.real_seconds(CONVERGE_SECONDS):
        return 0
    platform.extras[_CONVERGED] = now
    ov = overrides(platform)
    if not ov.rows:
        return 0
    pools = effective_pools(platform.config, ov)
    keys = [k for k in overridden_pool_keys(platform.config, ov) if k in pools]
    if not keys:
        return 0
    with platform.db.connection() as conn:
        todo = [r["resource_key"] for r in conn.execute(POOL_STATE, (keys,)).fetchall()
                if not pool_settled(list(r["capacities"]), pools[r["resource_key"]][0])]
    if not todo:
        return 0

    def tx(conn) -> int:
        # The cached overrides above only pick candidates: they may predate a change another process
        # just made, and re-splitting to them would put an old capacity back. Under the shards' locks
        # (which every set_* holds while it writes its override and resizes), the overrides read
        # now are the ones in force, and no change can commit between that read and the resize.
        conn.execute(LOCK_SHARDS, (sorted(todo),))
        fresh = effective_pools(platform.config, load_overrides(conn))
        state = {r["resource_key"]: r for r in conn.execute(POOL_STATE, (todo,)).fetchall()}
        return sum(resize_pool(conn, k, *fresh[k], keep_adaptive=True) for k in sorted(todo)
                   if k in fresh and k in state and not pool_settled(list(state[k]["capacities"]), fresh[k][0]))

    try:
        return platform.db.transaction(tx)
    except psycopg.Error as e:  # the next pass tries again
        logger.warning("capacity convergence failed", extra={"error": repr(e)[:200]})
        return 0
