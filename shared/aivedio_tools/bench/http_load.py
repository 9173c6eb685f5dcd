"""A small HTTP load generator: closed-loop for sustained throughput, open-loop at a fixed rate
for latency percentiles. Client processes with keep-alive connections, bounded in time and count,
aimed only at loopback servers this run started; each request is prepared bytes and each answer
read only as far as its status and length (_Connection)."""
from __future__ import annotations

import json
import multiprocessing as mp
import socket
import time
import uuid
from typing import Callable
from urllib.parse import urlsplit

CONNECT_TIMEOUT_SECONDS = 30.0


class _Connection:
    """One keep-alive HTTP/1.1 connection that sends prepared bytes and reads just enough of the
    answer (the status and Content-Length): a client as lean as pgbench's, so the load generator
    takes little of the machine the server under test runs on. http.client parses every answer's
    headers with the email package, several times the CPU of the request it measures."""

    def __init__(self, base_url: str):
        u = urlsplit(base_url)
        assert u.hostname in ("127.0.0.1", "localhost", "::1"), "bench traffic stays on loopback"
        self.address = (u.hostname, u.port)
        self.host = f"{u.hostname}:{u.port}".encode()
        self.sock: socket.socket | None = None
        self.buf = b""

    def _connect(self) -> socket.socket:
        s = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT_SECONDS)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        return s

    def post(self, path: str, headers: bytes, body: bytes) -> int:
        """The answer's status; raises OSError on a broken connection (the caller reconnects)."""
        if self.sock is None:
            self.sock = self._connect()
        self.sock.sendall(b"POST %s HTTP/1.1\r\nHost: %s\r\n%sContent-Length: %d\r\n\r\n%s"
                          % (path.encode(), self.host, headers, len(body), body))
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length, close = 0, False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                close = True
        while len(self.buf) < length:
            self._more()
        self.buf = self.buf[length:]
        if close:
            self.close()
        return status

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionResetError("the server closed the connection")
        self.buf += chunk

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _client(base_urls: list[str], keys: list[str], body: bytes, seconds: float, rate: float | None, seed: int, out: mp.Queue) -> None:
    """One client process: one connection per base URL it rotates through; closed loop when rate is None."""
    conns = [_Connection(u) for u in base_urls]
    fixed = [f"Authorization: Bearer {k}\r\nContent-Type: application/json\r\n".encode() for k in keys]
    statuses: dict[int, int] = {}
    latencies: list[float] = []
    end = time.monotonic() + seconds
    i = 0
    next_at = time.monotonic()
    run = uuid.uuid4().hex[:8]
    while time.monotonic() < end:
        if rate:
            now = time.monotonic()
            if now < next_at:
                time.sleep(next_at - now)
            next_at += 1.0 / rate
        k = (seed + i) % len(conns)
        headers = b"%sIdempotency-Key: bench-%d-%d-%s\r\n" % (fixed[(seed + i) % len(keys)], seed, i, run.encode())
        t0 = time.perf_counter()
        try:
            st = conns[k].post("/v1/generations", headers, body)
        except (OSError, ValueError, IndexError):
            st = 0
            conns[k].close()
        latencies.append(time.perf_counter() - t0)
        statuses[st] = statuses.get(st, 0) + 1
        i += 1
    for c in conns:
        c.close()
    out.put({"statuses": statuses, "latencies": latencies})


def run_load(base_urls: list[str], keys: list[str], body: dict, *, clients: int, seconds: float, rate_total: float | None = None) -> dict:
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    raw = json.dumps(body).encode()
    per_client = rate_total / clients if rate_total else None
    procs = [ctx.Process(target=_client, args=(base_urls, keys, raw, seconds, per_client, n * 7919, q)) for n in range(clients)]
    for p in procs:
        p.start()
    results = [q.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    statuses: dict[str, int] = {}
    lat: list[float] = []
    for r in results:
        for st, n in r["statuses"].items():
            statuses[str(st)] = statuses.get(str(st), 0) + n
        lat += r["latencies"]
    lat.sort()

    def pct(p: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 2) if lat else None

    ok = statuses.get("202", 0)
    return {"requests": len(lat), "accepted": ok, "statuses": statuses, "seconds": seconds,
            "accepted_per_second": round(ok / seconds, 1), "p50_ms": pct(0.50), "p99_ms": pct(0.99)}


__all__ = ["run_load", "Callable"]
