"""The chaos suite's Redis faults, against a private redis-server (never the shared one)."""
from __future__ import annotations

import threading
import time

import pytest
import redis

from aivedio_tools.chaos import redis_faults
from tests.redis_server import RedisServer, redis_server_binary

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server binary")]


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path / "redis").start()
    yield s
    s.stop()


def test_flushall_empties_it(server):
    c = server.client()
    c.mset({"a": 1, "b": 2, "c": 3})
    assert redis_faults.flushall(server.url) == {"kind": "redis_flushall", "keys_before": 3}
    assert c.dbsize() == 0


def test_client_pause_holds_other_clients_then_lets_go(server):
    c = server.client()
    assert redis_faults.client_pause(server.url, 400)["mode"] == "ALL"
    t0 = time.monotonic()
    assert c.set("k", "v")  # waits out the pause, then goes through
    assert 0.3 <= time.monotonic() - t0 < 2

    impatient = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=0.2, retry=None)
    redis_faults.client_pause(server.url, 1000)
    with pytest.raises(redis.TimeoutError):
        impatient.get("k")
    impatient.close()


def test_kill_refuses_connections_and_restart_comes_back_empty_on_the_same_port(server):
    c = server.client()
    c.set("k", "v")
    port, pid = server.port, server.proc.pid
    assert redis_faults.kill(server) == {"kind": "redis_kill", "port": port, "pid": pid}
    assert not server.running
    with pytest.raises(redis.ConnectionError):
        redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, retry=None).ping()
    back = redis_faults.restart(server)
    assert back["port"] == port and back["pid"] != pid and server.running
    assert c.ping() and c.get("k") is None  # the same client reconnects; the data is gone


def test_restart_of_a_paused_server_and_kill_when_down_are_fine(server):
    server.pause()  # SIGSTOPped: the kill inside restart still ends it
    done = threading.Event()
    threading.Thread(target=lambda: (server.restart(), done.set()), daemon=True).start()
    assert done.wait(10) and server.client().ping()
    server.kill()
    server.kill()  # no-op when not running
    assert not server.running
