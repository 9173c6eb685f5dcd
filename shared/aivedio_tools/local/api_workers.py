"""`aivedio serve --api-workers N`: the API handler in N processes on one port, as Lambda runs
several instances of the `api` function.

The main process keeps everything else (loops, outbox relay, workflow runner, provider
simulators) and, with N > 1, does not serve the API itself. Each worker is a 'spawn' process that
builds its own Platform from the main process's resolved settings and PlatformConfig (the same
database and Redis URLs, so no worker ever starts an embedded server; the same webhook secrets
and simulator addresses, which are random per run), and listens on host:port with SO_REUSEPORT,
so the kernel spreads connections over the workers.

Across processes:
- wake-ups: a worker's Platform.wake(name) (an admission wakes the outbox relay) is forwarded to
  the main process over a multiprocessing queue, coalesced, and sets the main loop's Event there,
  so a worker's outbox events are relayed at once; it works without Redis too. The relay's poll
  stays the safety net.
- /healthz: a worker answers with the main process's loop status, which the main process writes
  to a small JSON file about twice a second.
- /metrics: every process shares its series through files in one directory, and the worker that
  answers a scrape merges them (aivedio_tools.local.prometheus.share), so the loops' counters show too.
- supervision: a worker that dies is logged and started again; more than RESTARTS_PER_MINUTE
  deaths in a minute make `serve` exit loudly (WorkerCrashLoop). SIGINT/SIGTERM to the main
  process terminates and joins every worker; workers ignore SIGINT (a terminal's Ctrl-C reaches
  the whole group) and stop on SIGTERM, or when the main process is gone."""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aivedio.config import ConfigError, PlatformConfig, Settings
from aivedio.context import build_platform, set_platform
from aivedio.providers.registry import close_adapters
from aivedio_tools.local import prometheus
from aivedio_tools.local.handlers import api_server

log = logging.getLogger(__name__)

READY_TIMEOUT_SECONDS = 90.0  # a spawned worker imports the whole API first
STOP_TIMEOUT_SECONDS = 10.0  # after SIGTERM, before SIGKILL
RESTARTS_PER_MINUTE = 5
STATUS_WRITE_SECONDS = 0.5
WORKER_POOL_SIZE = 10  # database connections per worker


class WorkerCrashLoop(RuntimeError):
    """API workers keep dying: `serve` exits instead of restarting them forever."""


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (not listening) to host:port with SO_REUSEPORT: it turns port 0 into a real
    port the workers can all bind, and fails now when another program holds the port. A
    non-listening socket takes no connections; the caller closes it once the workers listen."""
    probe_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    if port:
        # SO_REUSEPORT would let us join another `aivedio serve` on this port silently: refuse.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.3)
            if probe.connect_ex((probe_host, port)) == 0:
                raise ConfigError(f"cannot listen on {host}:{port}: something already listens there")
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return s


# --- inside a worker -------------------------------------------------------------------------------

class _WakeForwarder:
    """Sends wake-ups to the main process, coalesced: a burst of admissions is one message per loop."""

    def __init__(self, events: Any):
        self.events = events
        self.pending: set[str] = set()
        self.cv = threading.Condition()
        threading.Thread(target=self._run, name="wake-forwarder", daemon=True).start()

    def wake(self, name: str) -> None:
        with self.cv:
            if name not in self.pending:
                self.pending.add(name)
                self.cv.notify()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.pending:
                    self.cv.wait()
                names, self.pending = self.pending, set()
            for name in names:
                self.events.put(("wake", name))


@dataclass
class _RemoteEvent:
    """Stands where Platform.wake looks for a loop's Event; set() wakes the main process's loop."""
    forwarder: _WakeForwarder
    name: str

    def set(self) -> None:
        self.forwarder.wake(self.name)


class _SharedLoopStatus(Mapping):
    """The main process's loop status, read from its file (for /healthz in a worker). dict(it)
    calls keys() and then reads each key: keys() reads the file, the items come from that read."""

    def __init__(self, path: str):
        self.path = path
        self._last: dict[str, Any] = {}

    def _read(self) -> dict[str, Any]:
        try:
            self._last = json.loads(Path(self.path).read_text())
        except (OSError, ValueError):
            self._last = {}
        return self._last

    def keys(self):
        return self._read().keys()

    def __getitem__(self, key: str) -> Any:
        return self._last[key] if key in self._last else self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs from the main process; pickled into the spawned process."""
    settings: Settings
    config_json: dict[str, Any]  # PlatformConfig.model_dump(mode="json"): the main process's resolved config
    host: str
    port: int
    loop_names: tuple[str, ...]
    provider_base_urls: dict[str, str] | None
    callback_base_url: str | None
    status_path: str
    metrics_dir: str | None = None  # aivedio_tools.local.prometheus.share: every process's series, merged per scrape


def worker_main(index: int, spec: WorkerSpec, events: Any) -> None:
    """A worker process's body: the API handlers (tenant and admin) behind LambdaHttpServer until SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides when workers stop
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s api-worker-{index}[%(process)d] %(name)s %(message)s")

    platform = server = None
    try:
        platform = build_platform(spec.settings, PlatformConfig.model_validate(spec.config_json), pool_size=WORKER_POOL_SIZE)
        forwarder = _WakeForwarder(events)
        platform.extras["wake"] = {n: _RemoteEvent(forwarder, n) for n in spec.loop_names}
        platform.extras["loop_status"] = _SharedLoopStatus(spec.status_path)
        if spec.provider_base_urls:
            platform.extras["provider_base_urls"] = dict(spec.provider_base_urls)
        if spec.callback_base_url:
            platform.extras["callback_base_url"] = spec.callback_base_url
        set_platform(platform)
        if spec.metrics_dir:
            prometheus.share(spec.metrics_dir)
        server = api_server(spec.host, spec.port, reuse_port=True)
        server.start()
    except BaseException as e:  # noqa: BLE001 - reported to the main process, which decides
        events.put(("failed", index, os.getpid(), repr(e)))
        if platform is not None:
            platform.close()
        raise SystemExit(1) from None
    events.put(("ready", index, os.getpid(), None))
    parent = mp.parent_process()
    if parent is not None:  # an orphan stops too (the main process was killed)
        threading.Thread(target=lambda: (parent.join(), stop.set()), name="parent-watch", daemon=True).start()
    stop.wait()
    server.stop()

    close_adapters(platform)
    platform.close()
    set_platform(None)


# --- in the main process ---------------------------------------------------------------------------

@dataclass
class _Worker:
    index: int
    process: Any
    pid: int | None = None
    ready: bool = False


@dataclass
class ApiWorkers:
    """N API worker processes on host:port, supervised from the main process's platform."""
    platform: Any  # the main process's Platform: its wake Events and loop status
    settings: Settings  # resolved: the database and Redis URLs the workers use
    config: PlatformConfig
    host: str
    port: int
    count: int
    _workers: dict[int, _Worker] = field(default_factory=dict)
    _deaths: list[float] = field(default_factory=list)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _failures: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers.values()]

    def start(self) -> "ApiWorkers":
        """Spawn the workers and wait until each listens. Raises ConfigError when one fails to start."""
        reserved = reserve_port(self.host, self.port)
        try:
            self.port = reserved.getsockname()[1]
            self._ctx = mp.get_context("spawn")
            self._events = self._ctx.Queue()
            self._status_dir = tempfile.mkdtemp(prefix="aivedio-serve-")
            p = self.platform
            self._spec = WorkerSpec(
                settings=self.settings, config_json=self.config.model_dump(mode="json"), host=self.host, port=self.port,
                loop_names=tuple(p.extras.get("wake", {})), provider_base_urls=p.extras.get("provider_base_urls"),
                callback_base_url=p.extras.get("callback_base_url"),
                status_path=os.path.join(self._status_dir, "loop_status.json"),
                metrics_dir=self._share_metrics())
            self._write_status()
            for target, name in ((self._read_events, "api-worker-events"), (self._publish_status, "api-worker-status")):
                t = threading.Thread(target=target, name=name, daemon=True)
                t.start()
                self._threads.append(t)
            for i in range(self.count):
                self._spawn(i)
            deadline = time.monotonic() + READY_TIMEOUT_SECONDS
            with self._cv:
                while not all(w.ready for w in self._workers.values()):
                    if self._failures:
                        raise ConfigError(f"an API worker failed to start: {self._failures[0]}")
                    dead = [w for w in self._workers.values() if not w.process.is_alive()]
                    if dead:
                        raise ConfigError(f"API worker {dead[0].index} exited while starting (code {dead[0].process.exitcode})")
                    if time.monotonic() > deadline:
                        raise ConfigError(f"API workers not listening after {READY_TIMEOUT_SECONDS:.0f}s")
                    self._cv.wait(0.2)
        except BaseException:
            self.stop()
            raise
        finally:
            reserved.close()
        return self

    def _share_metrics(self) -> str:
        """The main process's loops count claims, relays and repairs: share them with the workers."""
        directory = os.path.join(self._status_dir, "metrics")
        prometheus.share(directory)
        return directory

    def _spawn(self, index: int) -> None:
        proc = self._ctx.Process(target=worker_main, args=(index, self._spec, self._events), name=f"aivedio-api-{index}",
                                 daemon=False)
        proc.start()
        self._workers[index] = _Worker(index, proc)

    def _read_events(self) -> None:
        while not self._stopping.is_set():
            try:
                kind, *rest = self._events.get(timeout=0.2)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return
            if kind == "wake":
                self.platform.wake(rest[0])
                continue
            index, pid, detail = rest
            with self._cv:
                w = self._workers.get(index)
                if kind == "ready" and w is not None and w.process.pid == pid:
                    w.ready, w.pid = True, pid
                    log.info("API worker %d listening (pid %d)", index, pid)
                elif kind == "failed":
                    self._failures.append(detail)
                    log.error("API worker %d (pid %d) failed: %s", index, pid, detail)
                self._cv.notify_all()

    def _write_status(self) -> None:
        path = self._spec.status_path
        tmp = f"{path}.tmp"
        Path(tmp).write_text(json.dumps(dict(self.platform.extras.get("loop_status", {})), default=str))
        os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one

    def _publish_status(self) -> None:
        last = None
        while not self._stopping.wait(STATUS_WRITE_SECONDS):
            now = dict(self.platform.extras.get("loop_status", {}))
            if now != last:
                try:
                    self._write_status()
                except OSError as e:
                    log.warning("loop status not shared with the API workers: %s", e)
                last = now

    def check(self) -> None:
        """Restart the workers that died (the main loop calls it); WorkerCrashLoop when they keep dying."""
        if self._stopping.is_set():
            return
        for index, w in list(self._workers.items()):
            if w.process.is_alive():
                continue
            now = time.monotonic()
            self._deaths = [t for t in self._deaths if now - t < 60.0] + [now]
            log.error("API worker %d (pid %s) died with exit code %s; starting it again", index, w.process.pid, w.process.exitcode)
            w.process.join(0)
            if len(self._deaths) > RESTARTS_PER_MINUTE:
                raise WorkerCrashLoop(f"API workers died {len(self._deaths)} times within a minute; stopping")
            self._spawn(index)

    def stop(self) -> None:
        """SIGTERM every worker, join it (SIGKILL after STOP_TIMEOUT_SECONDS), and clean up."""
        self._stopping.set()
        for w in self._workers.values():
            if w.process.is_alive():
                w.process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        for w in self._workers.values():
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                log.warning("API worker %d (pid %d) did not stop; killing it", w.index, w.process.pid)
                w.process.kill()
                w.process.join(5)
        self._workers.clear()
        for t in self._threads:
            t.join(2)
        self._threads = []
        events = getattr(self, "_events", None)
        if events is not None:
            events.close()
            events.join_thread()
        if getattr(self, "_status_dir", None):
            shutil.rmtree(self._status_dir, ignore_errors=True)
