"""Redis faults the chaos injector inflicts on the run's private Redis (issue 18, "Faults"). Redis is
a cache and an index here, never the truth: after each of these the platform must rebuild what it
lost from PostgreSQL, and go on (degraded) while Redis is away. Each returns a small dict of what it
did, for faults.jsonl. Only ever against a private server (RedisServer): never the shared one."""
from __future__ import annotations

import redis

from aivedio_tools.chaos.redis_server import RedisServer


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)


def flushall(url: str) -> dict:
    """FLUSHALL: every key gone at once (queue index, rate buckets, counters, caches), as a node
    that failed over to an empty replica."""
    c = _client(url)
    try:
        keys = c.dbsize()
        c.flushall()
    finally:
        c.close()
    return {"kind": "redis_flushall", "keys_before": keys}


def client_pause(url: str, ms: int, all_commands: bool = True) -> dict:
    """CLIENT PAUSE for `ms`: the server stays up and connected but answers nothing (or, with
    all_commands False, no writes), as under a long fork or a failover; the platform's calls time
    out. The pause ends by itself."""
    c = _client(url)
    try:
        c.client_pause(int(ms), all=all_commands)
    finally:
        c.close()
    return {"kind": "redis_client_pause", "ms": int(ms), "mode": "ALL" if all_commands else "WRITE"}


def kill(server: RedisServer) -> dict:
    """SIGKILL the server: connections refused until `restart`."""
    pid = server.proc.pid if server.proc else None
    server.kill()
    return {"kind": "redis_kill", "port": server.port, "pid": pid}


def restart(server: RedisServer) -> dict:
    """Start it again on the same port, empty (no persistence), as a node that came back blank."""
    server.restart()
    return {"kind": "redis_restart", "port": server.port, "pid": server.proc.pid}
