"""A small TCP fault proxy, put in front of PostgreSQL, Redis and the provider simulator by the chaos
runner (issue 18, "Faults"), so the platform meets a slow, broken or silent network without any
change to its code: it only knows the proxy's port.

    proxy = FaultProxy("127.0.0.1", 5432).start()      # clients connect to proxy.port
    proxy.set_mode("delay", ms=50)                       # from any thread, at any time
    proxy.set_mode("stall", seconds=3)                   # back to pass by itself after 3 s
    proxy.clear()
    proxy.stop()

Modes:
- `pass`: forward bytes as they come (the default).
- `delay` (ms): each chunk is forwarded `ms` milliseconds after it was read. Chunks of one direction
  go one after another, so a stream of many chunks slows down more than a request and its reply.
- `drop`: every open connection is closed (FIN), and new ones are accepted and closed at once, as a
  peer that restarts or a firewall that drops the flow does.
- `stall`: nothing is read or forwarded in either direction, connections stay open; the peers' own
  timeouts (or TCP keepalive) are what notice, as in a partition.
- `reset`: open and new connections are aborted with RST (SO_LINGER 0), as a crashed middlebox does.

Any mode may carry `seconds`; after it, the proxy is back in pass by itself (checked lazily, per
chunk and per accept), so the injector need not wake up to end a fault.

One thread accepts; each connection has one thread per direction, which is cheap enough for the
pools of a local stack (tens of connections). Every socket has a short timeout (Python waits with
poll, so there is no select() limit on descriptor numbers), so each thread looks at the mode and the
stop flag twice a second, and `stop()` returns within about a second leaving no threads."""
from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter

MODES = ("pass", "delay", "drop", "stall", "reset")
TICK = 0.5  # how often an idle thread looks at the mode and the stop flag (shutdown wakes it sooner)
CHUNK = 65536


def _abort(sock: socket.socket) -> None:
    """Close with RST rather than FIN: SO_LINGER on, with a zero timeout."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class _Link:
    """One client connection and its upstream connection, with a thread per direction."""

    def __init__(self, proxy: "FaultProxy", client: socket.socket):
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        self.closing = threading.Event()  # set when either side ends, or a fault ends the link
        self.rst = False  # close with RST instead of FIN
        self._lock = threading.Lock()
        self._closed = False
        self._done = 0

    def start(self) -> None:
        self.proxy._spawn(self._run_up, "up")

    def end(self, rst: bool = False) -> None:
        """Ask both directions to stop; the last one out closes the sockets. shutdown(SHUT_RD) sends
        nothing on the wire but wakes a thread waiting in recv on that socket."""
        self.rst = self.rst or rst
        self.closing.set()
        for s in (self.client, self.upstream):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RD)
                except OSError:
                    pass

    def _run_up(self) -> None:
        # Connect here, not in the accept loop, so one slow upstream does not hold up the others.
        try:
            self.upstream = self.proxy.connect_upstream()
        except OSError:
            self.proxy._count("upstream_refused")
            self.closing.set()
            self._finish()
            self._finish()  # the down direction never ran
            return
        for s in (self.client, self.upstream):
            s.settimeout(TICK)
            if s.family != socket.AF_UNIX:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small requests go out at once
        if self.closing.is_set():  # a drop or reset landed while we were connecting
            self.end()
        self.proxy._spawn(lambda: self._pump(self.upstream, self.client, "bytes_down"), "down")
        self._pump(self.client, self.upstream, "bytes_up")

    def _pump(self, src: socket.socket, dst: socket.socket, counter: str) -> None:
        proxy = self.proxy
        try:
            while not self.closing.is_set():
                kind, params = proxy.mode()
                if kind == "stall":
                    self.closing.wait(min(TICK, proxy.mode_left()))
                    continue
                try:
                    data = src.recv(CHUNK)
                except TimeoutError:
                    continue
                if not data:
                    if not self.closing.is_set():  # the peer closed its side: pass the FIN on
                        dst.shutdown(socket.SHUT_WR)
                    return
                kind, params = proxy.mode()
                if kind == "delay":
                    proxy._count("delayed_chunks")
                    if self.closing.wait(params.get("ms", 0) / 1000):
                        return
                while kind == "stall" and not self.closing.is_set():  # a stall set while we were reading
                    self.closing.wait(min(TICK, proxy.mode_left()))
                    kind, params = proxy.mode()
                self._send_all(dst, data)
                proxy._count(counter, len(data))
        except OSError:
            self.end()  # a reset or a broken pipe: the whole link is over
        finally:
            self._finish()

    def _send_all(self, dst: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        while view and not self.closing.is_set():
            try:
                view = view[dst.send(view):]  # one send: on a timeout nothing of it was sent
            except TimeoutError:
                continue

    def _finish(self) -> None:
        with self._lock:
            self._done += 1
            if self._done < 2 or self._closed:
                return
            self._closed = True
        for s in (self.client, self.upstream):
            if s is None:
                continue
            if self.rst:
                _abort(s)
            else:
                s.close()
        self.proxy._forget(self)


class FaultProxy:
    """Listens on TCP; forwards to `target_host`:`target_port`, or, with no port, to the unix
    socket at the path `target_host` (the embedded PostgreSQL listens on one only)."""

    def __init__(self, target_host: str, target_port: int | None, listen_port: int = 0,
                 listen_host: str = "127.0.0.1", connect_timeout: float = 5.0):
        self.target_host = target_host
        self.target_port = target_port
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.connect_timeout = connect_timeout
        self.port: int | None = None
        self._mode: tuple[str, dict, float | None] = ("pass", {}, None)  # kind, params, monotonic end
        self._links: set[_Link] = set()
        self._lock = threading.Lock()
        self._stats: Counter = Counter()
        self._modes_set: Counter = Counter()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._threads: list[threading.Thread] = []  # the links' threads, pruned as they end

    def connect_upstream(self) -> socket.socket:
        if self.target_port is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.connect_timeout)
            try:
                s.connect(self.target_host)
            except OSError:
                s.close()
                raise
            return s
        return socket.create_connection((self.target_host, self.target_port), timeout=self.connect_timeout)

    # -- lifecycle --

    def start(self) -> "FaultProxy":
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((self.listen_host, self.listen_port))
        ls.listen(256)
        ls.settimeout(TICK)
        self._listener = ls
        self.port = ls.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True, name=f"fault-proxy-{self.port}-accept")
        self._acceptor.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop accepting, close every link, and wait for every thread."""
        self._stopping.set()
        if self._acceptor is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept at once
            except OSError:
                pass
            self._acceptor.join(timeout)
        for link in self._snapshot():
            link.end()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                alive = [t for t in self._threads if t.is_alive()]
            if not alive:
                break
            alive[0].join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- modes --

    def set_mode(self, kind: str, seconds: float | None = None, **params) -> None:
        """Switch to `kind` now (for `seconds`, or until the next set_mode/clear). drop and reset also
        end every open connection at once."""
        if kind not in MODES:
            raise ValueError(f"unknown fault proxy mode {kind!r}; one of {MODES}")
        if kind == "delay" and "ms" not in params:
            raise ValueError("delay needs ms")
        until = time.monotonic() + seconds if seconds is not None else None
        self._mode = (kind, dict(params), until)
        with self._lock:
            self._modes_set[kind] += 1
        if kind in ("drop", "reset"):
            links = self._snapshot()
            self._count("dropped" if kind == "drop" else "reset", len(links))
            for link in links:
                link.end(rst=kind == "reset")
        elif kind == "stall":
            self._count("stalls")

    def clear(self) -> None:
        self._mode = ("pass", {}, None)

    def mode(self) -> tuple[str, dict]:
        kind, params, until = self._mode
        if until is not None and time.monotonic() >= until:
            return "pass", {}
        return kind, params

    def mode_left(self) -> float:
        """Seconds until the current mode ends by itself (a large number when it has no end)."""
        until = self._mode[2]
        return 3600.0 if until is None else max(0.0, until - time.monotonic())

    def stats(self) -> dict:
        """Connections and bytes seen, and what the faults did (connections dropped or reset, chunks
        delayed, stalls begun), with how often each mode was set."""
        with self._lock:
            out = {"connections": 0, "active": len(self._links), "bytes_up": 0, "bytes_down": 0,
                   "upstream_refused": 0, "dropped": 0, "reset": 0, "delayed_chunks": 0, "stalls": 0}
            out.update(self._stats)
            out["modes_set"] = dict(self._modes_set)
        out["mode"] = self.mode()[0]
        return out

    # -- internals --

    def _accept_loop(self) -> None:
        ls = self._listener
        try:
            while not self._stopping.is_set():
                try:
                    client, _ = ls.accept()
                except TimeoutError:
                    continue
                except OSError:  # stop() shut the listener down to wake us
                    if self._stopping.is_set():
                        break
                    continue
                self._count("connections")
                kind, _ = self.mode()
                if kind == "drop":
                    self._count("dropped")
                    client.close()
                elif kind == "reset":
                    self._count("reset")
                    _abort(client)
                else:
                    link = _Link(self, client)
                    with self._lock:
                        self._links.add(link)
                    link.start()
        finally:
            ls.close()

    def _spawn(self, target, direction: str) -> None:
        t = threading.Thread(target=target, daemon=True, name=f"fault-proxy-{self.port}-{direction}")
        with self._lock:
            if direction == "up":
                self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
            # Started under the lock: a thread listed but not yet started is not alive, and another
            # link's prune (or stop's wait) in that gap would drop it, untracked, still to run.
            # start() only waits for the thread to exist; its target takes the lock later.
            t.start()

    def _snapshot(self) -> list[_Link]:
        with self._lock:
            return list(self._links)

    def _forget(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n
