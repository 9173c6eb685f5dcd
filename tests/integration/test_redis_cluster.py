"""The platform on a Redis cluster (issue 29, part 3), as the dev stage's ElastiCache Serverless is:
three private redis-servers in cluster mode (aivedio_tools.chaos.redis_server.LocalRedisCluster).

- AIVEDIO_REDIS_URL naming any node is a cluster client, a single server a plain one, and an
  ElastiCache Serverless host name a cluster without asking;
- the keys a script, pipeline or transaction uses together share one hash slot: a tenant's submit
  buckets, a lane's ring; the keys the platform wrote before (rate:user:… beside rate:tenant:…)
  are refused by the cluster client, raised as the bug they are, never taken for an outage;
- an admission through the tenant API answers 202 on the cluster, with its tokens in one slot;
- a lane's ring rebuilt, repaired and walked on the cluster; a wake-up pushed and waited on;
- the cluster gone: CacheUnavailable, admission degrades to PostgreSQL's buckets and still admits,
  and the cluster is found again when it returns.

The other Redis suites marked `redis_cluster` run each of their tests on the cluster too."""
from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
from redis.cluster import RedisCluster
from redis.exceptions import ClusterCrossSlotError, ClusterDownError, ClusterError, RedisClusterException, SlotNotCoveredError

from aivedio import wakeups
from aivedio.admission.rate_limits import take_all
from aivedio.cache.client import Cache, CacheUnavailable, is_serverless_endpoint
from aivedio.context import set_platform
from aivedio.scheduling.ring import Ring
from aivedio_tools.chaos.redis_server import LocalRedisCluster, RedisServer
from aivedio_tools.local.apigw import to_event
from aivedio_tools.local.lambda_context import FakeLambdaContext
from tests.admission_support import BODY, new_tenant

@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory):
    """A cluster this module may kill and restart."""
    cluster = LocalRedisCluster(tmp_path_factory.mktemp("own-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_platform(make_platform, own_cluster):
    return make_platform(redis_url=own_cluster.url)


def _slot(cache: Cache, key: str) -> int:
    return cache.r.keyslot(key)


def test_any_node_of_a_cluster_is_a_cluster_client_and_a_single_server_a_plain_one(own_cluster, redis_url):
    for server in own_cluster.servers:
        c = Cache(server.url, "t-detect")
        assert c.run(c.r.ping) and c.clustered is True and isinstance(c.r, RedisCluster)
        c.close()
    single = Cache("redis://127.0.0.1:6379/0" if "6379" in redis_url else redis_url, "t-detect")
    if single.run(single.r.ping):
        assert single.clustered is False and not isinstance(single.r, RedisCluster)
    single.close()


def test_an_elasticache_serverless_host_is_a_cluster_without_asking():
    assert is_serverless_endpoint("rediss://dev-redis-abc123.serverless.use1.cache.amazonaws.com:6379/0")
    assert not is_serverless_endpoint("rediss://master.dev-redis.abc123.use1.cache.amazonaws.com:6379/0")
    assert not is_serverless_endpoint("redis://127.0.0.1:6379/0")


def test_a_read_only_replica_is_an_outage_not_a_bug(tmp_path):
    """A failover leaves a client on a node that became a replica: its READONLY reply reaches us as
    redis-py's ReadOnlyError, whose text lacks the word, so it is told by its class."""
    replica = RedisServer(tmp_path / "replica", extra_args=("--replicaof", "127.0.0.1", "1")).start()
    c = Cache(replica.url, "t-ro")
    try:
        with pytest.raises(CacheUnavailable):
            c.run(lambda: c.r.set(c.key("k"), 1))
    finally:
        c.close()
        replica.stop()


@pytest.mark.parametrize("raised", [ClusterError("TTL exhausted."), SlotNotCoveredError("slot 7 is not covered"),
                                    ClusterDownError("CLUSTERDOWN The cluster is down")])
def test_what_redis_py_raises_when_a_cluster_is_failing_over_is_an_outage(raised):
    """What redis-py raises once its own retries of TRYAGAIN or MOVED run out, or while slots are
    not covered: the cluster is moving, not the code wrong."""
    c = Cache("redis://127.0.0.1:1/0", "t-classes")

    def fail():
        raise raised

    with pytest.raises(CacheUnavailable):
        c.run(fail)


def test_a_slot_mistake_stays_the_bug_it_is():
    c = Cache("redis://127.0.0.1:1/0", "t-classes")

    def fail():
        raise ClusterCrossSlotError("Keys in request don't hash to the same slot")

    with pytest.raises(ClusterCrossSlotError):
        c.run(fail)


def test_a_cluster_that_does_not_answer_is_unavailable_until_it_does(tmp_path):
    cluster = LocalRedisCluster(tmp_path / "late")
    c = Cache(cluster.url, "t-late")  # nothing listens yet
    with pytest.raises(CacheUnavailable):
        c.r
    assert c.clustered is None and not c.healthy()
    cluster.start()
    try:
        assert c.healthy() and c.clustered is True
    finally:
        c.close()
        cluster.stop()


def test_the_keys_used_together_share_a_slot_and_the_old_ones_are_refused_as_a_bug(cluster_platform):
    cache = cluster_platform.cache
    tenant, user = uuid.uuid4(), uuid.uuid4()
    # What admission wrote before: two buckets in two slots, in one script. On a cluster that is
    # refused by the client's slot check; it must surface (a 500 and a log), not read as an outage.
    old = [cache.key("rate", f"user:{user}:submit"), cache.key("rate", f"tenant:{tenant}:submit")]
    assert _slot(cache, old[0]) != _slot(cache, old[1])
    with pytest.raises(RedisClusterException, match="same key slot"):
        cache.run(cache.script("token_buckets"), keys=old, args=[1, 5, 0.1, 5, 0.1])
    assert take_all(cluster_platform, [(f"user:{user}:submit", 5), (f"tenant:{tenant}:submit", 5)], slot=str(tenant)) is None
    keys = [k for k in cache.r.scan_iter(match=f"{cache.prefix}:rate:*")]
    assert len(keys) == 2 and len({_slot(cache, k) for k in keys}) == 1
    ring_keys = [cache.key_in_slot("queue", "STANDARD", "active_tenants"), cache.key_in_slot("queue", "STANDARD", "active_set")]
    assert _slot(cache, ring_keys[0]) == _slot(cache, ring_keys[1])


def test_admission_through_the_api_answers_202_on_a_cluster(cluster_platform):
    from functions.api.handler import lambda_handler

    set_platform(cluster_platform)
    try:
        t = new_tenant(cluster_platform)
        for n in range(3):
            event = to_event("POST", "/v1/generations", "", [("Authorization", f"Bearer {t.api_key}"), ("Idempotency-Key", f"k-{n}"),
                                                             ("Content-Type", "application/json")],
                             json.dumps(dict(BODY, prompt=f"on a cluster {n}")).encode())
            resp = lambda_handler(event, FakeLambdaContext("aivedio-api"))
            assert resp["statusCode"] == 202, resp["body"]
        assert cluster_platform.cache.clustered is True
        buckets = list(cluster_platform.cache.r.scan_iter(match=f"{cluster_platform.cache.prefix}:rate:*"))
        assert len(buckets) == 2 and all(f"{{{t.tenant_id}}}" in k for k in buckets)
    finally:
        set_platform(None)


def test_a_lanes_ring_is_built_repaired_and_walked_on_a_cluster(cluster_platform, conn):
    ring = Ring(cluster_platform)
    tenants = [uuid.uuid4() for _ in range(5)]
    for t in tenants:
        ring.add("STANDARD", t)
    ring.add("STANDARD", tenants[0])  # once only
    members, listed = ring.members("STANDARD")
    assert members == {str(t) for t in tenants} and sorted(listed) == sorted(members)
    ring.drop("STANDARD", tenants[1])
    members, listed = ring.members("STANDARD")
    assert str(tenants[1]) not in members and str(tenants[1]) not in listed and len(listed) == 4
    seen = {ring.next(conn, "STANDARD", use_redis=True) for _ in range(4)}
    assert seen == set(tenants) - {tenants[1]}


def test_a_wake_up_pushed_on_a_cluster_ends_the_wait(cluster_platform):
    woken: list = []
    waiter = threading.Thread(target=lambda: woken.append(wakeups.wait(cluster_platform, "scheduler-tick", 20)))
    waiter.start()
    time.sleep(0.5)
    wakeups.push(cluster_platform.cache, "scheduler-tick")
    waiter.join(30)
    assert woken == [True]


def test_the_cluster_gone_admission_still_admits_from_postgresql_and_finds_it_again(make_platform, conn, tmp_path):
    cluster = LocalRedisCluster(tmp_path / "gone").start()
    p = make_platform(redis_url=cluster.url)
    tenant, user = uuid.uuid4(), uuid.uuid4()
    buckets = [(f"user:{user}:submit", 5), (f"tenant:{tenant}:submit", 5)]
    try:
        assert take_all(p, buckets, slot=str(tenant)) is None
        for s in cluster.servers:
            s.kill()
        assert take_all(p, buckets, slot=str(tenant)) is None  # PostgreSQL's bucket answered
        assert conn.execute("select count(*) as n from rate_limit_bucket where bucket_key = any(%s)",
                            ([b for b, _ in buckets],)).fetchone()["n"] == 2
        assert not p.cache.healthy()
        cluster.start()
        deadline = time.monotonic() + 30
        while not p.cache.healthy() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert take_all(p, buckets, slot=str(tenant)) is None and p.cache.healthy()
    finally:
        p.close()
        cluster.stop()
