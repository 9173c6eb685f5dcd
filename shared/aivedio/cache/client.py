"""The platform's Redis: one client, standalone or clustered, found from the URL alone.

AIVEDIO_REDIS_URL may name a single server or any node of a cluster (an ElastiCache Serverless
endpoint is a cluster): the first command asks the server (CLUSTER INFO, which a non-cluster server
refuses) and the client is a cluster client when it answers, so keys on other nodes are followed
instead of answering MOVED. An ElastiCache Serverless host name is known to be a cluster without
asking. Every multi-key script, pipeline and transaction the platform sends keeps its keys in one
hash slot (one `{tag}` in each key, `Cache.key_in_slot`): a CROSSSLOT error, or a slot check the
cluster client refuses, is a bug and is raised, never taken for an outage."""
from __future__ import annotations

import hashlib
from pathlib import Path
from urllib.parse import urlsplit

import redis
from redis.cluster import RedisCluster
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    MasterDownError,
    NoScriptError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from aivedio.config import ConfigError

LUA_DIR = Path(__file__).parent / "lua"
SOCKET_TIMEOUT_SECONDS = 0.5  # a Redis that answers slower than this is treated as down (PostgreSQL decides)
SERVERLESS_HOST_SUFFIX = ".cache.amazonaws.com"  # with ".serverless." in the name: ElastiCache Serverless
UNREACHABLE_CLUSTER = "cannot be connected"  # redis-py's RedisClusterException when no node answers
# A cluster that answers but cannot serve now (no quorum, a failover under way): an outage, not a bug.
# Outages by class, not by message (redis-py strips the reply's prefix: a READONLY reply is a
# ReadOnlyError whose text lacks the word). ClusterError is also what redis-py raises once its
# retries of TRYAGAIN or MOVED run out ("TTL exhausted"); a slot mistake (CROSSSLOT) is a
# ResponseError, not one of these, and stays the bug it is.
CLUSTER_OUTAGES = (ClusterDownError, TryAgainError, MasterDownError, ClusterError, ReadOnlyError, SlotNotCoveredError)


class CacheUnavailable(Exception):
    """Redis cannot answer; callers fall back to PostgreSQL."""


def is_serverless_endpoint(url: str) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    return host.endswith(SERVERLESS_HOST_SUFFIX) and ".serverless." in host


def _is_cluster(url: str) -> bool:
    """Whether the server `url` names is a cluster node (raises CacheUnavailable when it cannot tell)."""
    if is_serverless_endpoint(url):
        return True
    probe = redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_SECONDS, socket_connect_timeout=SOCKET_TIMEOUT_SECONDS)
    try:
        probe.execute_command("CLUSTER", "INFO")
        return True
    except redis.ResponseError as e:
        if "cluster support disabled" in str(e):
            return False
        raise CacheUnavailable(f"redis {urlsplit(url).hostname}: CLUSTER INFO answered {e}") from e
    except (RedisError, OSError) as e:
        raise CacheUnavailable(str(e)) from e
    finally:
        probe.close()


def make_client(url: str, *, clustered: bool, socket_timeout: float = SOCKET_TIMEOUT_SECONDS):
    """A client of the kind the server is (raises CacheUnavailable when a cluster has no node answering)."""
    if not clustered:
        return redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=SOCKET_TIMEOUT_SECONDS,
                                    decode_responses=True)
    try:
        return RedisCluster.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=SOCKET_TIMEOUT_SECONDS,
                                     decode_responses=True)
    except RedisClusterException as e:
        raise CacheUnavailable(str(e)) from e
    except (RedisError, OSError) as e:
        raise CacheUnavailable(str(e)) from e


class Script:
    """A Lua script of cache/lua, called by its SHA and sent whole when the server lacks it (EVAL
    caches it there). Not redis-py's Script, whose reload broadcasts SCRIPT LOAD to the primaries
    the cluster client knows: after a node returns that list can miss the very node a key lives on,
    and the reload then fails again on it; EVAL goes where the key goes."""

    def __init__(self, cache: "Cache", text: str):
        self.cache, self.text = cache, text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def __call__(self, keys: list | None = None, args: list | None = None):
        keys, args = list(keys or []), list(args or [])
        r = self.cache.r
        try:
            return r.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return r.eval(self.text, len(keys), *keys, *args)


class Cache:
    def __init__(self, url: str, prefix: str = "av"):
        self.url = url
        self.prefix = prefix
        self.clustered: bool | None = None  # known after the first command that reached the server
        self._client = None
        self._scripts: dict[str, Script] = {}

    @property
    def r(self):
        """The client, made at first use: until the server has answered once, each use asks it again
        whether it is a cluster, and raises CacheUnavailable while it does not answer."""
        if self._client is None:
            clustered = _is_cluster(self.url)
            self._client = make_client(self.url, clustered=clustered)
            self.clustered = clustered
        return self._client

    def key(self, *parts: object) -> str:
        return ":".join([self.prefix, *map(str, parts)])

    def key_in_slot(self, kind: str, tag: object, *parts: object) -> str:
        """A key whose hash slot is `tag`'s alone (prefix:kind:{tag}:parts): the keys one script,
        pipeline or transaction uses together share their tag, so a cluster keeps them on one node."""
        return self.key(kind, f"{{{tag}}}", *parts)

    def script(self, name: str) -> Script:
        if name not in self._scripts:
            self._scripts[name] = Script(self, (LUA_DIR / f"{name}.lua").read_text())
        return self._scripts[name]

    def run(self, fn, *args, **kwargs):
        """Call a redis operation, turning transport failures into CacheUnavailable."""
        try:
            return fn(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError, OSError, *CLUSTER_OUTAGES) as e:
            raise CacheUnavailable(str(e)) from e
        except RedisClusterException as e:  # not a RedisError: a slot check refused (a bug) or no node answers
            if UNREACHABLE_CLUSTER in str(e):
                raise CacheUnavailable(str(e)) from e
            raise
        except RedisError as e:
            if "LOADING" in str(e) or "READONLY" in str(e):
                raise CacheUnavailable(str(e)) from e
            raise

    def blocking_client(self, socket_timeout: float):
        """A client of its own, of the same kind, whose socket timeout outlasts a blocking command
        (BLPOP); the caller closes it. Raises CacheUnavailable as `r` does."""
        clustered = self.clustered if self.clustered is not None else _is_cluster(self.url)
        return make_client(self.url, clustered=clustered, socket_timeout=socket_timeout)

    def healthy(self) -> bool:
        try:
            return bool(self.run(lambda: self.r.ping()))
        except (CacheUnavailable, RedisError, RedisClusterException, OSError):
            return False

    def delete_prefix(self) -> int:
        """Drop every key under this prefix (tests, and `rebuild redis` before it rebuilds); on a
        cluster, SCAN visits every primary."""
        n = 0
        for k in self.r.scan_iter(match=f"{self.prefix}:*", count=1000):
            n += self.r.delete(k)
        return n

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def connect_cache_or_fail(url: str, prefix: str) -> Cache:
    c = Cache(url, prefix)
    try:
        c.run(lambda: c.r.ping())
    except (CacheUnavailable, RedisError, OSError) as e:
        raise ConfigError(f"redis {url}: unreachable: {e}") from None
    return c
