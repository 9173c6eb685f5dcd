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
    # One hash tag per lane, so the ring scripts and the repair's transaction stay in one slot on a cluster.
    return [cache.key_in_slot("queue", lane, "active_tenants"), cache.key_in_slot("queue", lane, "active_set")]


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


READY, MISSING, DOWN, DISABLED = "ready", "missing", "down", "disabled"
REBUILD_BATCH = 1000  # tenants per ring_add_many call: Redis is not held by one script for long


class Ring:
    """Active tenants of each lane. `redis_ready` turns False when Redis fails or the lane's index is
    missing (flushed, or Redis restarted empty); callers then run in conservative mode on the
    PostgreSQL ring, and a missing index is rebuilt as soon as Redis answers.

    Redis can also come back with its data but without what was written while it was away (a
    network partition, a failover to a stale replica): an add or remove this process could not make
    marks the lane stale, and the next look at it, once Redis answers, drops the lane's index_built
    marker, so every process rebuilds the lane (the redis-index service catches what other processes
    missed, comparing each ring with PostgreSQL)."""

    def __init__(self, platform):
        self.platform = platform
        self.cache = platform.cache

    def _stale(self) -> set[str]:
        return self.platform.extras.setdefault("ring_stale_lanes", set())

    def index_state(self, lane: str) -> str:
        """READY (use the Redis ring), MISSING (Redis answers but the lane must be rebuilt), DOWN
        (Redis does not answer) or DISABLED (configured without Redis)."""
        if self.cache is None:
            return DISABLED
        try:
            if lane in self._stale():
                self.cache.run(self.cache.r.delete, built_key(self.cache, lane))
                self._stale().discard(lane)
                return MISSING
            return READY if self.cache.run(self.cache.r.exists, built_key(self.cache, lane)) else MISSING
        except CacheUnavailable:
            return DOWN

    def redis_ready(self, lane: str) -> bool:
        return self.index_state(lane) == READY

    def members(self, lane: str) -> tuple[set[str], list[str]]:
        """The lane's membership set and its ring list, as Redis holds them (raises CacheUnavailable)."""
        ring, members = _keys(self.cache, lane)
        pipe = self.cache.r.pipeline(transaction=False)
        pipe.smembers(members)
        pipe.lrange(ring, 0, -1)
        got_set, got_list = self.cache.run(pipe.execute)
        return set(got_set), list(got_list)

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
            self._stale().add(lane)  # rebuilt from PostgreSQL once Redis answers; PostgreSQL still has the task

    def remove(self, lane: str, tenant_id: UUID) -> None:
        if self.cache is None:
            return
        try:
            self.cache.run(self.cache.script("ring_remove"), keys=_keys(self.cache, lane), args=[str(tenant_id)])
        except CacheUnavailable:
            self._stale().add(lane)

    def drop(self, lane: str, tenant_id: UUID | str) -> None:
        """Take a tenant out of both the set and every place in the list (a repair: remove() only
        touches the list when the set had the tenant). Raises CacheUnavailable."""
        self.cache.run(self.cache.script("ring_drop"), keys=_keys(self.cache, lane), args=[str(tenant_id)])

    def rebuild(self, conn: psycopg.Connection, lane: str) -> int:
        """QueueIndexRebuilder: mark the lane's index built, then re-add every tenant with queued work.

        The marker comes first and PostgreSQL is read after it: a tenant queued before the marker
        was set is in what the read returns, one queued after it is added by its queue indexer, and
        a flush at any moment takes the marker with it, so the lane is rebuilt again. (Marking last
        let a FLUSHALL between the adds and the marker leave a marked, empty ring.) Should the adds
        fail, the marker may stand over a partial ring: the lane is marked stale, so this process
        drops the marker once Redis answers, and the redis-index service repairs it for others."""
        if self.cache is None:
            return 0
        try:
            self.cache.run(self.cache.r.set, built_key(self.cache, lane), "1")
        except CacheUnavailable:
            return 0
        tenants = active_tenants_pg(conn, lane)
        added = 0
        try:
            script = self.cache.script("ring_add_many")
            for start in range(0, len(tenants), REBUILD_BATCH):
                batch = [str(t) for t in tenants[start:start + REBUILD_BATCH]]
                added += int(self.cache.run(script, keys=_keys(self.cache, lane), args=batch))
        except CacheUnavailable:
            self._stale().add(lane)
            return 0
        if added:
            logger.info("queue index rebuilt", extra={"lane": lane, "tenants_added": added, "active": len(tenants)})
        return added
