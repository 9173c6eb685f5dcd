"""The chaos suite's TCP fault proxy, in front of the real PostgreSQL and a private Redis: each mode
does to a real client what it says (a reset errors, a delay is measurable, a stall blocks and then
resumes), a cleared proxy serves new connections again, and stop() leaves no threads."""
from __future__ import annotations

import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import redis
from psycopg_pool import ConnectionPool

from aivedio_tools.chaos.proxy import FaultProxy
from tests.redis_server import RedisServer, redis_server_binary

pytestmark = pytest.mark.timeout(60)


def _through(url: str, port: int) -> str:
    parts = urlsplit(url)
    user = parts.username or "postgres"
    return urlunsplit(parts._replace(netloc=f"{user}@127.0.0.1:{port}"))


def _proxy_threads(proxy: FaultProxy) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"fault-proxy-{proxy.port}-")]


@pytest.fixture
def pg(db_url):
    parts = urlsplit(db_url)
    proxy = FaultProxy(parts.hostname, parts.port or 5432).start()
    yield proxy, _through(db_url, proxy.port)
    proxy.stop()
    assert not _proxy_threads(proxy)


def _connect(url: str) -> psycopg.Connection:
    return psycopg.connect(url, autocommit=True, connect_timeout=3)


def _round_trip_ms(c: psycopg.Connection, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        c.execute("select 1").fetchone()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def test_reset_breaks_open_and_new_connections_and_clear_heals(pg):
    proxy, url = pg
    c = _connect(url)
    assert c.execute("select 1").fetchone() == (1,)
    assert proxy.stats()["active"] == 1

    proxy.set_mode("reset")
    with pytest.raises(psycopg.OperationalError):
        c.execute("select 1")
    with pytest.raises(psycopg.OperationalError):
        _connect(url)

    proxy.clear()
    with _connect(url) as c2:
        assert c2.execute("select 2").fetchone() == (2,)
    s = proxy.stats()
    assert s["reset"] >= 2 and s["modes_set"] == {"reset": 1} and s["mode"] == "pass"
    assert s["connections"] == 3 and s["bytes_up"] > 0 and s["bytes_down"] > 0


def test_drop_closes_open_and_new_connections(pg):
    proxy, url = pg
    c = _connect(url)
    proxy.set_mode("drop")
    with pytest.raises(psycopg.OperationalError):
        c.execute("select 1")
    with pytest.raises(psycopg.OperationalError):
        _connect(url)
    proxy.clear()
    with _connect(url) as c2:
        assert c2.execute("select 1").fetchone() == (1,)
    assert proxy.stats()["dropped"] >= 2


def test_delay_adds_latency_to_each_round_trip(pg):
    proxy, url = pg
    with _connect(url) as c:
        base = _round_trip_ms(c)
        proxy.set_mode("delay", ms=40)
        delayed = _round_trip_ms(c)
        proxy.clear()
        after = _round_trip_ms(c)
    # a query and its answer each wait 40 ms
    assert delayed - base >= 70, (base, delayed)
    assert after < base + 30, (base, after)
    assert proxy.stats()["delayed_chunks"] >= 10


def test_stall_blocks_then_resumes_on_the_same_connection(pg):
    proxy, url = pg
    with _connect(url) as c:
        proxy.set_mode("stall", seconds=1.0)
        t0 = time.monotonic()
        assert c.execute("select 42").fetchone() == (42,)  # the same connection, after the stall
        took = time.monotonic() - t0
        assert 0.8 <= took < 3, took
        assert proxy.mode()[0] == "pass"  # the stall ended by itself
        assert _round_trip_ms(c) < 50
    assert proxy.stats()["stalls"] == 1


def test_a_stall_times_out_a_client_that_waits_less(pg):
    proxy, url = pg
    proxy.set_mode("stall", seconds=3.0)
    t0 = time.monotonic()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url, connect_timeout=1, sslmode="disable")  # the startup never gets an answer
    assert time.monotonic() - t0 < 2.5
    proxy.clear()
    with _connect(url) as c:
        assert c.execute("select 1").fetchone() == (1,)


def test_a_pool_under_load_and_stop_leaves_no_threads(db_url):
    parts = urlsplit(db_url)
    proxy = FaultProxy(parts.hostname, parts.port or 5432).start()
    pool = ConnectionPool(_through(db_url, proxy.port), min_size=12, max_size=12, open=True,
                          kwargs={"autocommit": True}, timeout=10)
    try:
        def work(i: int) -> int:
            with pool.connection() as c:
                return c.execute("select %s::int + 1", (i,)).fetchone()[0]

        with ThreadPoolExecutor(16) as ex:
            assert list(ex.map(work, range(400))) == [i + 1 for i in range(400)]
        assert proxy.stats()["active"] == 12
        # a reset mid-load: the pool notices broken connections and makes new ones
        proxy.set_mode("reset", seconds=0.3)
        time.sleep(0.5)
        pool.check()
        with ThreadPoolExecutor(16) as ex:
            assert list(ex.map(work, range(100))) == [i + 1 for i in range(100)]
    finally:
        pool.close()
    t0 = time.monotonic()
    proxy.stop()
    assert time.monotonic() - t0 < 1.5
    assert not _proxy_threads(proxy)


needs_redis_server = pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server binary")


@pytest.fixture
def own_redis(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    proxy = FaultProxy("127.0.0.1", server.port).start()
    yield server, proxy
    proxy.stop()
    server.stop()
    assert not _proxy_threads(proxy)


def _redis(port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1, retry=None,
                       max_connections=32)


@needs_redis_server
def test_redis_through_the_proxy(own_redis):
    server, proxy = own_redis
    r = _redis(proxy.port)
    blob = os.urandom(3 * 1024 * 1024)  # many chunks each way, byte for byte
    assert r.set("blob", blob) and r.get("blob") == blob

    def work(i: int) -> bytes:
        r.set(f"k{i}", i)
        return r.get(f"k{i}")

    with ThreadPoolExecutor(16) as ex:
        assert list(ex.map(work, range(300))) == [str(i).encode() for i in range(300)]

    proxy.set_mode("reset")
    with pytest.raises(redis.ConnectionError):
        r.ping()
    proxy.clear()
    assert r.ping()

    proxy.set_mode("stall", seconds=3)
    with pytest.raises(redis.TimeoutError):
        r.get("k1")  # a 1 s client timeout under a 3 s stall
    proxy.clear()
    r.connection_pool.disconnect()  # the timed-out connection is out of step; a fresh one is not
    assert r.get("k1") == b"1"

    # the server itself gone: the proxy accepts, cannot reach it, and the client sees a closed link
    server.kill()
    with pytest.raises(redis.ConnectionError):
        r.ping()  # the link its connection was on is closed
    r.connection_pool.disconnect()
    with pytest.raises(redis.ConnectionError):
        r.ping()  # a new link, whose upstream connect is refused
    server.restart()
    r.connection_pool.disconnect()
    assert r.ping() and r.get("k1") is None  # back on the same port, empty
    s = proxy.stats()
    assert s["upstream_refused"] >= 1 and s["bytes_up"] > len(blob) and s["bytes_down"] > len(blob)
    r.close()


def test_a_unix_socket_upstream_the_embedded_postgresql_listens_on(tmp_path):
    """The embedded PostgreSQL (pgserver) listens on a unix socket only: the proxy forwards TCP to it."""
    import socket

    path = str(tmp_path / ".s.PGSQL.5432")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def echo() -> None:
        c, _ = server.accept()
        with c:
            c.sendall(c.recv(64).upper())

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    proxy = FaultProxy(path, None).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as s:
            s.sendall(b"ping")
            assert s.recv(64) == b"PING"
    finally:
        proxy.stop()
        server.close()
    assert not _proxy_threads(proxy)


def test_a_node_reaches_the_embedded_postgresql_through_the_proxy_by_tcp_alone():
    from aivedio_tools.chaos.runner import _via, postgres_upstream

    embedded = "postgresql://postgres:@/postgres?host=/home/x/.aivedio/pgdata"
    assert postgres_upstream(embedded) == ("/home/x/.aivedio/pgdata/.s.PGSQL.5432", None)
    assert _via(embedded, 6000) == "postgresql://postgres:@127.0.0.1:6000/postgres"  # no host= left to win over TCP
    assert postgres_upstream("postgresql://postgres@127.0.0.1:5433/db") == ("127.0.0.1", 5433)
    assert _via("postgresql://u:p@db.internal:5432/db?sslmode=require", 6000) == "postgresql://u:p@127.0.0.1:6000/db?sslmode=require"
