"""`aivedio serve`: the whole platform in one process.

API Gateway becomes a local HTTP server in front of the `api` handler; each EventBridge schedule
becomes a Loop thread calling the same handler EventBridge would call; SQS becomes in-process
delivery to the consumers registered in aivedio_tools.local.consumers. The handlers are the ones that
run in Lambda, unchanged."""
from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from aivedio import events_routing
from aivedio.attempts.executions import LOCAL_STEP_RESOURCE
from aivedio.bootstrap import apply_config
from aivedio.config import ConfigError, Settings, load_config
from aivedio.context import Platform, build_platform, set_platform
from aivedio.db.pool import redact
from aivedio.media import pipeline
from aivedio.providers.registry import close_adapters
from aivedio_tools.local import consumers, media_dispatch
from aivedio_tools.local.api_workers import ApiWorkers, WorkerCrashLoop, reserve_port
from aivedio_tools.local.apigw import ACCOUNT_ID
from aivedio_tools.local.embedded import stop_embedded, with_embedded_servers
from aivedio_tools.local.handlers import api_server, load_handler
from aivedio_tools.local.http_server import LambdaHttpServer
from aivedio_tools.local.lambda_context import FakeLambdaContext
from aivedio_tools.local.workflow_runner import WorkflowRunner
from aivedio_tools.provider_sim import start_simulators

log = logging.getLogger(__name__)

ATTEMPT_STEP_HANDLER = "functions.attempt_step.handler"
SCHEDULED_TIMEOUT_SECONDS = 60.0  # the Lambda timeout scheduled handlers get locally
LOOP_JOIN_SECONDS = 10.0


def scheduled_event(rule: str) -> dict[str, Any]:
    """The event an EventBridge schedule rule sends to its target."""
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": "Scheduled Event",
        "source": "aws.events",
        "account": ACCOUNT_ID,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "region": "local",
        "resources": [f"arn:aws:events:local:{ACCOUNT_ID}:rule/aivedio-{rule}"],
        "detail": {},
    }


def scheduled(rule: str, module: str, payload: dict[str, Any] | None = None) -> Callable[[], Any]:
    """A loop body that invokes a scheduled Lambda handler the way EventBridge would: with the
    rule's input when it has one (a maintenance service's name), else the scheduled event."""
    handler = load_handler(module)

    def run() -> Any:
        event = dict(payload) if payload is not None else scheduled_event(rule)
        return handler(event, FakeLambdaContext(f"aivedio-{rule}", timeout_seconds=SCHEDULED_TIMEOUT_SECONDS))

    return run


@dataclass(frozen=True)
class Loop:
    name: str
    interval_platform_seconds: float  # the clock turns it into real seconds (time_scale)
    fn: Callable[[], Any]


# Each factory adds loops. Periodic Lambda handlers belong in aivedio.events_routing.SCHEDULES, which
# makes their loop here and their EventBridge schedule in AWS; a factory is for loops with no AWS twin.
LoopFactory = Callable[[Platform], Iterable[Loop]]
LOOP_FACTORIES: list[LoopFactory] = []


def loop_factory(fn: LoopFactory) -> LoopFactory:
    LOOP_FACTORIES.append(fn)
    return fn


@loop_factory
def _scheduled(platform: Platform) -> Iterator[Loop]:
    """One loop per EventBridge schedule of aivedio.events_routing.SCHEDULES (the CDK app reads the
    same table), at the interval the config file gives it."""
    for s in events_routing.SCHEDULES:
        yield Loop(s.name, s.local_interval(platform.config), scheduled(s.name, s.module, s.payload))


# Event type -> the SQS-consuming Lambda handler that SQS would invoke with it in AWS; the table is
# aivedio.events_routing.SUBSCRIPTIONS, which the CDK app turns into queues.
SUBSCRIPTIONS: list[tuple[str, str]] = [(s.event_type, s.module) for s in events_routing.SUBSCRIPTIONS]


def sqs_consumer(module: str) -> Callable[[dict], None]:
    """Deliver one outbox envelope to an SQS-consuming handler as a one-record SQS event. A
    reported batch item failure raises, so the relay delivers it again (as SQS would)."""
    handler = load_handler(module)
    name = module.split(".")[-2]

    def deliver(envelope: dict) -> None:
        event = {"Records": [{"messageId": envelope["event_id"], "receiptHandle": "local", "body": json.dumps(envelope),
                              "attributes": {"ApproximateReceiveCount": "1"}, "messageAttributes": {},
                              "eventSource": "aws:sqs", "eventSourceARN": f"arn:aws:sqs:local:{ACCOUNT_ID}:aivedio-{name}",
                              "awsRegion": "local"}]}
        result = handler(event, FakeLambdaContext(f"aivedio-{name}", timeout_seconds=SCHEDULED_TIMEOUT_SECONDS)) or {}
        if result.get("batchItemFailures"):
            raise consumers.DeliveryFailed(f"{name} failed {envelope['event_type']} {envelope['event_id']}")

    deliver.__name__ = f"sqs:{module}"
    return deliver


_subscribed: dict[str, Callable[[dict], None]] = {}


def subscribe_all() -> None:
    for event_type, module in SUBSCRIPTIONS:
        if module not in _subscribed:
            _subscribed[module] = sqs_consumer(module)
        consumers.register(event_type, _subscribed[module])


def default_loops(platform: Platform) -> list[Loop]:
    return [loop for factory in LOOP_FACTORIES for loop in factory(platform)]


class _LoopThread(threading.Thread):
    """Runs one loop until stopped; records its health in platform.extras["loop_status"]."""

    def __init__(self, loop: Loop, platform: Platform, stop: threading.Event, wake: threading.Event):
        super().__init__(name=f"loop-{loop.name}", daemon=True)
        self.loop, self.platform, self.stop, self.wake = loop, platform, stop, wake

    def run(self) -> None:
        clock = self.platform.clock
        status: dict[str, Any] = {"runs": 0, "errors": 0, "last_run_at": None, "last_duration_ms": None,
                                  "last_ok": None, "last_error": None, "last_error_at": None,
                                  "interval_seconds": clock.real_seconds(self.loop.interval_platform_seconds)}
        while not self.stop.is_set():
            started_at, t0 = clock.now(), time.monotonic()
            ok, error = True, None
            try:
                self.loop.fn()
            except Exception as e:  # a loop survives its failures; the next run tries again
                ok, error = False, repr(e)
                log.exception("loop %s failed", self.loop.name)
            status = {**status, "runs": status["runs"] + 1, "last_run_at": started_at.isoformat(),
                      "last_duration_ms": round((time.monotonic() - t0) * 1000, 1), "last_ok": ok}
            if not ok:
                status.update(errors=status["errors"] + 1, last_error=error, last_error_at=started_at.isoformat())
            # Replaced whole, never mutated, so /healthz can copy it from another thread.
            self.platform.extras["loop_status"][self.loop.name] = status
            self.wake.wait(clock.real_seconds(self.loop.interval_platform_seconds))
            self.wake.clear()


class LocalRuntime:
    """The API server and the loops over one Platform. Tests use it directly:
    rt = LocalRuntime(platform, port=0); rt.start(); rt.base_url; rt.stop()."""

    def __init__(self, platform: Platform, port: int = 8080, host: str = "127.0.0.1", loops: list[Loop] | None = None,
                 workflow_workers: int = 8, serve_api: bool = True):
        self.platform = platform
        self.serve_api = serve_api  # False: API worker processes serve it (aivedio_tools.local.api_workers)
        self.workflow_workers = workflow_workers
        self._runner = None
        self._simulators: dict = {}
        self.port, self.host = port, host
        self._loops = loops
        self._stop = threading.Event()
        self._threads: list[_LoopThread] = []
        self.server: LambdaHttpServer | None = None

    @property
    def base_url(self) -> str:
        if self.server is None:
            raise RuntimeError("LocalRuntime is not started")
        return self.server.url

    @property
    def loops(self) -> list[Loop]:
        return [t.loop for t in self._threads]

    def start(self) -> "LocalRuntime":
        p = self.platform
        set_platform(p)  # the handlers find the platform through get_platform(), as in Lambda
        p.extras["outbox_deliver"] = consumers.deliver
        p.extras["local_runtime"] = True
        p.extras[pipeline.LOCAL_DISPATCHER] = media_dispatch.run_local
        with p.db.connection() as conn:
            apply_config(conn, p.config, p.clock)
        subscribe_all()
        self._start_providers_and_workflows()
        p.extras.setdefault("loop_status", {})
        loops = default_loops(p) if self._loops is None else self._loops
        p.extras["wake"] = {loop.name: threading.Event() for loop in loops}
        if self.serve_api:
            self.server = api_server(self.host, self.port)
            self.server.start()
            if p.settings.api_base_url == Settings.model_fields["api_base_url"].default:
                p.extras["callback_base_url"] = self.server.url  # webhooks come back to this server
        self._stop.clear()
        self._threads = [_LoopThread(loop, p, self._stop, p.extras["wake"][loop.name]) for loop in loops]
        for t in self._threads:
            t.start()
        return self

    def _start_providers_and_workflows(self) -> None:
        """The built-in provider simulators (for providers whose entry names no base_url) and the
        workflow runner that executes attempt workflows in this process."""
        p = self.platform
        missing = [pc for pc in p.config.providers if not pc.base_url]
        if missing and "provider_base_urls" not in p.extras:
            self._simulators = start_simulators(p.config)
            p.extras["provider_base_urls"] = {n: s.base_url for n, s in self._simulators.items()}
            p.extras["provider_simulators"] = self._simulators
        if "workflow_runner" not in p.extras:
            step = load_handler(ATTEMPT_STEP_HANDLER)

            def attempt_step(payload: dict) -> dict:
                return step(payload, FakeLambdaContext("aivedio-attempt_step", timeout_seconds=SCHEDULED_TIMEOUT_SECONDS))

            self._runner = WorkflowRunner(p.clock, {LOCAL_STEP_RESOURCE: attempt_step}, workers=self.workflow_workers).start()
            p.extras["workflow_runner"] = self._runner

    def stop(self) -> None:
        self._stop.set()
        for ev in self.platform.extras.get("wake", {}).values():
            ev.set()
        for t in self._threads:
            t.join(LOOP_JOIN_SECONDS)
            if t.is_alive():
                log.warning("loop %s did not stop within %.0fs", t.loop.name, LOOP_JOIN_SECONDS)
        self._threads = []
        media_dispatch.stop_local(self.platform)  # the media workers this process started (their jobs go to the reconciler)
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._runner is not None:
            self._runner.stop()
            self.platform.extras.pop("workflow_runner", None)
            self._runner = None

        close_adapters(self.platform)
        for sim in self._simulators.values():
            sim.stop()
        if self._simulators:
            self.platform.extras.pop("provider_base_urls", None)
            self.platform.extras.pop("provider_simulators", None)
        self._simulators = {}
        self.platform.extras.pop("outbox_deliver", None)
        self.platform.extras.pop("callback_base_url", None)
        self.platform.extras.pop("wake", None)
        set_platform(None)

    def __enter__(self) -> "LocalRuntime":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _banner(rt: LocalRuntime, url: str, api_workers: str) -> str:
    p = rt.platform
    redis = "disabled (conservative mode)" if p.cache is None else redact(p.cache.url)
    loops = ", ".join(f"{lp.name} every {p.clock.real_seconds(lp.interval_platform_seconds):g}s" for lp in rt.loops) or "none"
    return "\n".join([
        f"AiVedio is running (time_scale={p.clock.time_scale:g})",
        f"  API       {url}   ({api_workers})",
        f"  health    curl {url}/healthz",
        f"  docs      {url}/swagger   (OpenAPI: {url}/openapi.json)",
        f"  database  {redact(p.db.url)}",
        f"  redis     {redis}",
        f"  loops     {loops}",
        "Ctrl-C stops it.",
        "",
    ])


def _default_api_url(settings: Settings, host: str, port: int) -> Settings:
    """Point api_base_url (where simulators send webhooks) at this server unless it was set."""
    if settings.api_base_url != Settings.model_fields["api_base_url"].default or port == 0:
        return settings
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return settings.model_copy(update={"api_base_url": f"http://{shown}:{port}"})


def serve(settings: Settings, port: int = 8080, host: str = "127.0.0.1", api_workers: int = 1) -> int:
    """Run until SIGINT/SIGTERM; then stop the API workers, the loops, the server, the platform and
    the embedded servers this process started. Returns the exit code.

    api_workers == 1: this process serves the API too, as before. api_workers > 1: this process
    runs everything but the API, and that many worker processes serve it on host:port
    (aivedio_tools.local.api_workers); a worker that dies is restarted, and workers that keep dying
    end the serve with exit code 1."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    platform: Platform | None = None
    rt: LocalRuntime | None = None
    workers: ApiWorkers | None = None
    code = 0
    try:
        config = load_config(settings.config_file)
        if api_workers > 1 and port == 0:
            # Port 0 means a different port per process: choose one now that every worker binds.
            with reserve_port(host, 0) as s:
                port = s.getsockname()[1]
        settings = _default_api_url(settings, host, port)
        settings = with_embedded_servers(settings)  # the workers get these URLs, never servers of their own
        platform = build_platform(settings, config, migrate=True)
        rt = LocalRuntime(platform, port=port, host=host, serve_api=api_workers <= 1)
        try:
            rt.start()
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        if api_workers > 1:
            # platform.config, not config: the one the simulators' credentials were resolved into.
            workers = ApiWorkers(platform, settings, platform.config, host, port, api_workers).start()
            url, shown = workers.url, f"{api_workers} API worker processes, pids {', '.join(map(str, workers.pids))}"
        else:
            url, shown = rt.base_url, "1 API worker: this process"
        sys.stderr.write(_banner(rt, url, shown))
        sys.stderr.flush()
        while not stop.wait(0.5):
            if workers is not None:
                try:
                    workers.check()
                except WorkerCrashLoop as e:
                    log.error("%s", e)
                    code = 1
                    break
        log.info("stopping")
    finally:
        if workers is not None:
            workers.stop()
        if rt is not None:
            rt.stop()
        if platform is not None:
            platform.close()
        set_platform(None)
        stop_embedded()
        for s, h in previous.items():
            signal.signal(s, h)
    return code
