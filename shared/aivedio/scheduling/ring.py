"""The ring of active tenants per lane (ch. 18.9.6), so a pick never scans all tenants.

In Redis: a list rotated with LMOVE (O(1) per pick) beside a set for membership. PostgreSQL is the
fact: with Redis down or flushed, the PostgreSQL ring walks tenants with queued work in tenant_id
order from a per-lane cursor, one index probe per pick, until the Redis ring is rebuilt."""
from __future__ import annotations

from uuid import UUID

import psycopg
from psycopg import sql

from aivedio.cache.client import CacheUnavailable
from aivedio.observability import logger


def _keys(cache, lane: str) -> list[str]:
    # One hash tag per lane, so the ring scripts stay in one slot on a clustered Redis.
    return [cache.key("queue", f"{{{lane}}}", "active_tenants"), cache.key("queue", f"{{{lane}}}", "active_set")]


def built_key(cache, lane: str) -> str:
    return cache.key("queue", "index_built", lane)


def _lane(lane: str) -> sql.Literal:
    """A lane inlined into a query. Lanes are few and very unequal in size, so PostgreSQL's generic
    plan for `queue_class = $1` (used once psycopg has prepared a statement) is a scan; with the
    lane as a constant each lane gets its own statement and an index plan."""
    return sql.Literal(lane)


def next_tenant_pg(conn: psycopg.Connection, lane: str) -> UUID | None:
    """Round robin in tenant_id order over tenants with queued work in the lane."""
    cur = conn.execute("select last_tenant_id from drr_lane_cursor where lane = %s", (lane,)).fetchone()
    last = cur["last_tenant_id"] if cur else None
    q = sql.SQL("""select tenant_id from generation_task where state = 'QUEUED' and queue_class = {lane} {cond}
                    order by queue_class, tenant_id limit 1""")
    row = None
    if last is not None:
        row = conn.execute(q.format(lane=_lane(lane), cond=sql.SQL("and tenant_id > %s")), (last,)).fetchone()
    if row is None:
        row = conn.execute(q.format(lane=_lane(lane), cond=sql.SQL("")), ()).fetchone()
    if row is None:
        return None
    conn.execute(
        """insert into drr_lane_cursor (lane, last_tenant_id) values (%s, %s)
           on conflict (lane) do update set last_tenant_id = excluded.last_tenant_id, updated_at = now()""",
        (lane, row["tenant_id"]),
    )
    return row["tenant_id"]


def active_tenants_pg(conn: psycopg.Connection, lane: str) -> list[UUID]:
    """Distinct tenants with queued work, by a loose index scan (one probe per tenant, not per task)."""
    rows = conn.execute(
        sql.SQL("""with recursive t as (
               (select tenant_id from generation_task where state = 'QUEUED' and queue_class = {l}
                 order by queue_class, tenant_id limit 1)
               union all
               select (select g.tenant_id from generation_task g
                        where g.state = 'QUEUED' and g.queue_class = {l} and g.tenant_id > t.tenant_id
                        order by g.queue_class, g.tenant_id limit 1)
                 from t where t.tenant_id is not null)
           select tenant_id from t where tenant_id is not null""").format(l=_lane(lane)),
    ).fetchall()
    return [r["tenant_id"] for r in rows]


class Ring:
    """Active tenants of each lane. `redis_ok` turns False when Redis fails or the lane's index is
    missing (flushed); callers then run in conservative mode on the PostgreSQL ring."""

    def __init__(self, platform):
        self.platform = platform
        self.cache = platform.cache

    def redis_ready(self, lane: str) -> bool:
        if self.cache is None:
            return False
        try:
            return bool(self.cache.run(self.cache.r.exists, built_key(self.cache, lane)))
        except CacheUnavailable:
            return False

    def next(self, conn: psycopg.Connection, lane: str, use_redis: bool) -> UUID | None:
        if use_redis:
            try:
                ring, _ = _keys(self.cache, lane)
                v = self.cache.run(self.cache.r.lmove, ring, ring, "LEFT", "RIGHT")
                return UUID(v) if v else None
            except CacheUnavailable as e:
                logger.warning("redis ring unavailable; PostgreSQL ring", extra={"lane": lane, "error": str(e)})
        return next_tenant_pg(conn, lane)

    def size(self, lane: str, use_redis: bool) -> int | None:
        if not use_redis:
            return None
        try:
            return int(self.cache.run(self.cache.r.llen, _keys(self.cache, lane)[0]))
        except CacheUnavailable:
            return None

    def add(self, lane: str, tenant_id: UUID) -> None:
        if self.cache is None:
            return
        try:
            self.cache.run(self.cache.script("ring_add"), keys=_keys(self.cache, lane), args=[str(tenant_id)])
        except CacheUnavailable:
            pass  # the rebuilder re-adds it; PostgreSQL still has the task

    def remove(self, lane: str, tenant_id: UUID) -> None:
        if self.cache is None:
            return
        try:
            self.cache.run(self.cache.script("ring_remove"), keys=_keys(self.cache, lane), args=[str(tenant_id)])
        except CacheUnavailable:
            pass

    def rebuild(self, conn: psycopg.Connection, lane: str) -> int:
        """QueueIndexRebuilder: re-add every tenant with queued work; mark the lane's index built."""
        if self.cache is None:
            return 0
        tenants = active_tenants_pg(conn, lane)
        added = 0
        try:
            script = self.cache.script("ring_add")
            pipe = self.cache.r.pipeline(transaction=False)
            for t in tenants:
                script(keys=_keys(self.cache, lane), args=[str(t)], client=pipe)
            results = self.cache.run(pipe.execute) if tenants else []
            added = sum(int(x) for x in results)
            self.cache.run(self.cache.r.set, built_key(self.cache, lane), "1")
        except CacheUnavailable:
            return 0
        if added:
            logger.info("queue index rebuilt", extra={"lane": lane, "tenants_added": added, "active": len(tenants)})
        return added
