"""`aivedio demo`: the whole platform at work, then (with --serve, which `make run` uses) left serving.

It starts everything in one process tree on the embedded PostgreSQL and Redis (or the URLs in the
environment): the API and the admin API, the scheduler, dispatch and the attempt workflows, the
media workers and the reconcilers, and three provider simulators that differ in price, latency,
reliability and capacity, one of them misbehaving (accept-then-time-out, 429 bursts, dropped
webhooks, failed-but-charged jobs, broken outputs). An admin operator is created through the admin
core (audited), and the tenants through the admin API with its token: an enterprise tenant with
reserved capacity and three users, two paid tenants at weights 2 and 1, a free tenant, a whale that
floods, and a studio ordering 4K. Their work goes over the tenant HTTP API, with cancellations and
duplicate submits among it, under a time_scale that makes an hour pass in two minutes.

Progress is live (rich on a terminal, plain lines otherwise); the report (aivedio_tools.demo.report) is
printed and written as one HTML file, and its verdicts decide the exit status. `--verify` checks the
invariants of an existing database without running anything."""
from __future__ import annotations

import logging
import random
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from aivedio.admin.operators import create_operator
from aivedio.config import (
    LaneConfig,
    PlatformConfig,
    ProviderAccount,
    ProviderConfig,
    SimulatorBehaviour,
    Timers,
    settings_from_env,
)
from aivedio.context import build_platform, set_platform
from aivedio.db.pool import redact
from aivedio_tools.demo import progress as demo_progress
from aivedio_tools.demo import report as demo_report
from aivedio_tools.local.embedded import stop_embedded, with_embedded_servers
from aivedio_tools.local.runtime import LocalRuntime, _default_api_url
from aivedio_tools.provider_sim import SimulatorServer

DEFAULT_TIME_SCALE = 30.0  # an hour of platform time in two real minutes
PROMPTS = ("a fox running through snow", "city lights at dusk, slow pan", "waves on a rocky shore",
           "a paper boat in rain", "a lighthouse in a storm, drone shot", "ink drops blooming in water")
SHAPES: dict[str, dict[str, Any]] = {
    "short": {"model": "video-model-x", "mode": "text_to_video", "duration_seconds": 5, "resolution": "720p"},
    "hd": {"model": "video-model-x", "mode": "text_to_video", "duration_seconds": 8, "resolution": "1080p"},
    "long": {"model": "video-model-x", "mode": "text_to_video", "duration_seconds": 15, "resolution": "720p"},
    "sd": {"model": "video-model-x", "mode": "text_to_video", "duration_seconds": 5, "resolution": "480p"},
    "4k": {"model": "video-model-x", "mode": "text_to_video", "duration_seconds": 5, "resolution": "4k"},
}


@dataclass(frozen=True)
class TenantSpec:
    key: str  # the demo's name for it (the tenant is named <key>-<run>)
    service_class: str
    weight: int
    share: float  # of the steady submissions
    shapes: tuple[str, ...]
    credits: int = 200_000
    extra_users: int = 0  # users besides the owner, made through the admin API
    flood: int = 0  # submissions sent at once at the start, per 100 tasks of the run
    policy: dict[str, int | bool] = field(default_factory=dict)


# Per-user caps opened so that the lanes and the providers, not one user's cap, decide the shares.
_OPEN_USERS = {"max_user_running_tasks": 20, "max_user_running_units": 60, "max_user_queued_tasks": 100,
               "max_user_queued_units": 1000, "user_submit_rate_per_minute": 120}
TENANTS: tuple[TenantSpec, ...] = (
    TenantSpec("enterprise", "ENTERPRISE_RESERVED", 4, 0.25, ("short", "hd", "long"), extra_users=2,
               policy={"reserved_units": 24}),
    TenantSpec("paid-gold", "PAID_SHARED", 2, 0.22, ("short", "hd"), policy=dict(_OPEN_USERS)),
    TenantSpec("paid-silver", "PAID_SHARED", 1, 0.22, ("short", "hd"), policy=dict(_OPEN_USERS)),
    TenantSpec("free", "BEST_EFFORT", 1, 0.16, ("sd", "short"), credits=20_000),
    TenantSpec("whale", "PAID_SHARED", 1, 0.0, ("short", "long"), flood=45,
               policy={**_OPEN_USERS, "max_user_queued_tasks": 40, "max_queued_tasks": 40, "max_running_tasks": 20}),
    TenantSpec("studio-4k", "PAID_SHARED", 1, 0.15, ("4k",), policy=dict(_OPEN_USERS)),
)
CANCEL_RATE = 0.08  # of the admitted tasks, cancelled a moment later
DUPLICATE_RATE = 0.1  # of the submissions, sent again with the same Idempotency-Key


def demo_providers() -> list[ProviderConfig]:
    """Three simulated providers: premium (fast, reliable, dear), bulk (slow, cheap, no 4K) and flaky
    (cheapest, and misbehaving in every way the contract allows)."""
    return [
        ProviderConfig(name="premium", cost_per_second="0.0800", submit_timeout_seconds=2.0,
                       accounts=[ProviderAccount(account_id="acct-1", max_concurrency=10)],
                       simulator=SimulatorBehaviour(seed=11, cost_per_second="0.0800", latency_seconds_min=15,
                                                    latency_seconds_max=35, failure_rate=0.01)),
        ProviderConfig(name="bulk", cost_per_second="0.0300", submit_timeout_seconds=2.0, max_resolution="1080p",
                       accounts=[ProviderAccount(account_id="acct-1", max_concurrency=8),
                                 ProviderAccount(account_id="acct-2", max_concurrency=8)],
                       simulator=SimulatorBehaviour(seed=12, cost_per_second="0.0300", queue_seconds_max=10,
                                                    latency_seconds_min=40, latency_seconds_max=90, failure_rate=0.04)),
        ProviderConfig(name="flaky", cost_per_second="0.0200", submit_timeout_seconds=2.0,
                       accounts=[ProviderAccount(account_id="acct-1", max_concurrency=6)],
                       simulator=SimulatorBehaviour(seed=13, cost_per_second="0.0200", latency_seconds_min=20,
                                                    latency_seconds_max=70, failure_rate=0.15, failed_but_charged_rate=0.5,
                                                    accept_then_timeout_rate=0.08, accept_then_timeout_hold_seconds=2.5,
                                                    burst_429_rate=0.05, burst_429_seconds=20, webhook_drop_rate=0.3,
                                                    webhook_duplicate_rate=0.15, webhook_delay_seconds_max=5,
                                                    output_truncated_rate=0.04, output_wrong_duration_rate=0.03)),
    ]


def demo_config(time_scale: float = DEFAULT_TIME_SCALE) -> PlatformConfig:
    """Lanes sized so that they, and the providers, are the bottleneck: shares, waits and borrowing show."""
    lanes = {"ENTERPRISE_RESERVED": LaneConfig(capacity_units=40, borrowable_units=16, min_headroom_units=4),
             "PAID_SHARED": LaneConfig(capacity_units=48), "STANDARD": LaneConfig(capacity_units=24),
             "BEST_EFFORT": LaneConfig(capacity_units=12), "EXPENSIVE": LaneConfig(capacity_units=40, max_queue_units=4000)}
    return PlatformConfig(time_scale=time_scale, providers=demo_providers(), lanes=lanes,
                          timers=Timers(scheduler_tick_seconds=1.0, unknown_first_check_seconds=5, poll_first_seconds=10,
                                        poll_min_seconds=15, poll_max_seconds=30))


# --- the run ------------------------------------------------------------------------------------------------

@dataclass
class Options:
    tasks: int = 160
    time_scale: float = DEFAULT_TIME_SCALE
    submit_seconds: float = 90.0  # real seconds over which the steady tenants submit
    timeout_seconds: float = 420.0  # real seconds to wait for every task to finish
    seed: int = 7
    report_path: Path | None = None  # None: <home>/demo-report.html
    port: int = 0
    host: str = "127.0.0.1"
    serve: bool = False  # keep serving after the report (make run)
    workload: bool = True  # False: only serve (make run DEMO=0)
    progress: bool = True
    rich: bool | None = None  # None: when stdout is a terminal


@dataclass
class Tenant:
    spec: TenantSpec
    name: str
    tenant_id: str
    wallet_id: str
    keys: list[str]  # the owner's first, then each extra user's


@dataclass
class Workload:
    """What the clients did and saw, for the progress view and the report."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    decisions: Counter = field(default_factory=Counter)  # "<tenant>:<code>" -> n
    rejections: Counter = field(default_factory=Counter)  # code -> n
    submitted: dict[str, str] = field(default_factory=dict)  # task_id -> tenant key
    duplicates: int = 0
    duplicates_same_task: int = 0
    cancels: Counter = field(default_factory=Counter)  # answer -> n
    sent: int = 0

    def record(self, tenant: str, code: str, task_id: str | None) -> None:
        with self.lock:
            self.sent += 1
            self.decisions[f"{tenant}:{code}"] += 1
            if task_id:
                self.submitted[task_id] = tenant
            else:
                self.rejections[code] += 1


class Interrupted(Exception):
    pass


def _code(r: httpx.Response) -> str:
    try:
        doc = r.json()
    except ValueError:
        return str(r.status_code)
    return str(doc.get("decision") or doc.get("error") or r.status_code)


def run(opts: Options, stop: threading.Event | None = None) -> tuple[int, dict[str, Any] | None]:
    """Start everything, run the workload (unless opts.workload is False), report, and with
    opts.serve keep serving until `stop` is set. Returns (exit code, the report document)."""
    stop = stop or threading.Event()
    say = (lambda msg: sys.stderr.write(msg + "\n")) if opts.progress else (lambda msg: None)
    platform = rt = sims = None
    code, doc = 0, None
    try:
        settings = _default_api_url(settings_from_env(), opts.host, opts.port)
        log_path = _logs_to_file(settings.home / "demo.log")
        settings = with_embedded_servers(settings)
        platform = build_platform(settings, demo_config(opts.time_scale), migrate=True)
        sims = _start_simulators(platform)
        rt = LocalRuntime(platform, port=opts.port, host=opts.host)
        try:
            rt.start()
        except OSError as e:
            say(f"aivedio demo: cannot listen on {opts.host}:{opts.port}: {e.strerror or e}")
            return 2, None
        run_id = uuid.uuid4().hex[:6]
        admin = _create_operator(platform, run_id)
        http = httpx.Client(base_url=rt.base_url, timeout=30)
        tenants = _create_tenants(http, admin["token"], run_id, opts) if opts.workload else []
        _print_banner(rt, admin, opts, log_path)
        if opts.workload:
            doc = _run_workload(platform, rt, http, sims, tenants, run_id, opts, stop, say)
            if doc is None:
                say("aivedio demo: interrupted; stopping")
                return 130, None
            code = 0 if doc["verdicts_passed"] else 1
        if opts.serve and not stop.is_set():
            _print_serving(rt, admin, tenants, opts)
            while not stop.wait(0.5):
                pass
            say("aivedio demo: stopping")
        return code, doc
    except Interrupted:
        return 130, None
    finally:
        if rt is not None:
            rt.stop()
        for s in (sims or {}).values():
            s.stop()
        if platform is not None:
            platform.close()
        set_platform(None)
        stop_embedded()


def _start_simulators(platform) -> dict:
    """The demo's own simulators, before LocalRuntime would start its own: each account may run 10x
    what the platform is told it may, so a platform overshooting max_concurrency would show in the
    simulator's peak instead of being hidden by its 429s (the no-capacity-exceeded verdict)."""
    sims = {}
    try:
        for p in platform.config.providers:
            loose = p.model_copy(update={"accounts": [a.model_copy(update={"max_concurrency": a.max_concurrency * 10})
                                                      for a in p.accounts]})
            sims[p.name] = SimulatorServer(loose, p.simulator, platform.config.time_scale, port=0).start()
    except BaseException:
        for s in sims.values():
            s.stop()
        raise
    platform.extras["provider_base_urls"] = {n: s.base_url for n, s in sims.items()}
    platform.extras["provider_simulators"] = sims
    return sims


def _create_operator(platform, run_id: str) -> dict:
    """The demo's admin operator, through the admin core as the CLI makes one (audited as cli:demo)."""
    op = platform.db.transaction(lambda c: create_operator(c, actor="cli:demo", name=f"demo-admin-{run_id}", role="admin"))
    return op.as_dict()


def _create_tenants(http: httpx.Client, token: str, run_id: str, opts: Options) -> list[Tenant]:
    """Each tenant and its extra users through the admin API, audited as the demo's operator."""
    auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    out = []
    for spec in TENANTS:
        body = {"name": f"{spec.key}-{run_id}", "service_class": spec.service_class, "weight": spec.weight,
                "credits": spec.credits, "policy": spec.policy or None}
        r = http.post("/admin/v1/tenants", json=body, headers=auth)
        if r.status_code != 201:
            raise RuntimeError(f"admin API: creating tenant {body['name']}: {r.status_code} {r.text[:400]}")
        t = r.json()
        keys = [t["api_key"]]
        for i in range(spec.extra_users):
            u = http.post(f"/admin/v1/tenants/{t['tenant_id']}/users", json={"name": f"{spec.key}-user-{i + 2}"}, headers=auth)
            if u.status_code != 201:
                raise RuntimeError(f"admin API: creating a user of {body['name']}: {u.status_code} {u.text[:400]}")
            keys.append(u.json()["api_key"])
        out.append(Tenant(spec, body["name"], t["tenant_id"], t["wallet_id"], keys))
    return out


def _plan(tenants: list[Tenant], opts: Options, rng: random.Random) -> list[tuple[float, Tenant, str, dict]]:
    """(real second to send at, tenant, api key, body): the whale's flood at once, the rest spread."""
    steady = [t for t in tenants if t.spec.share > 0]
    weights = [t.spec.share for t in steady]
    plan = []
    for t in tenants:
        for _ in range(t.spec.flood * opts.tasks // 100):
            plan.append((rng.uniform(0, 0.5), t, rng.choice(t.keys), {**SHAPES[rng.choice(t.spec.shapes)],
                                                                        "prompt": rng.choice(PROMPTS)}))
    for i in range(opts.tasks):
        t = rng.choices(steady, weights=weights)[0]
        plan.append((opts.submit_seconds * i / opts.tasks, t, rng.choice(t.keys),
                     {**SHAPES[rng.choice(t.spec.shapes)], "prompt": rng.choice(PROMPTS)}))
    return sorted(plan, key=lambda x: x[0])


def _run_workload(platform, rt, http, sims, tenants, run_id, opts: Options, stop: threading.Event, say) -> dict | None:
    rng = random.Random(opts.seed)
    wl = Workload()
    plan = _plan(tenants, opts, rng)
    started = time.monotonic()
    sampler = demo_progress.Sampler(platform, sims, wl, tenants, started)
    view = demo_progress.view(opts.rich, sampler, enabled=opts.progress)
    sampler.start()
    senders = [threading.Thread(target=_send_all, args=(http, plan[i::4], wl, run_id, started, stop, rng.random()),
                                daemon=True, name=f"demo-client-{i}") for i in range(4)]
    for s in senders:
        s.start()
    deadline = started + opts.submit_seconds + opts.timeout_seconds
    with view:
        while True:
            view.update()
            if stop.wait(1.0):
                sampler.stop()
                return None
            if all(not s.is_alive() for s in senders) and sampler.all_terminal():
                break
            if time.monotonic() > deadline:
                say(f"aivedio demo: not every task finished within {opts.timeout_seconds:g}s")
                break
        sampler.sample()
        view.update()
    sampler.stop()
    elapsed = time.monotonic() - started
    say(f"aivedio demo: workload done in {elapsed:.0f}s real ({elapsed * opts.time_scale / 60:.0f} platform minutes); "
        "building the report")
    doc = demo_report.build(platform, sims, wl, tenants, sampler, run_id=run_id, elapsed_seconds=elapsed)
    path = opts.report_path or (platform.settings.home / "demo-report.html")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(demo_report.html(doc))
    doc["report_path"] = str(path.resolve())
    sys.stderr.write(demo_report.text(doc) + "\n")
    return doc


def _send_all(http: httpx.Client, plan, wl: Workload, run_id: str, started: float, stop: threading.Event, seed: float) -> None:
    rng = random.Random(seed)
    cancels: list[tuple[float, str, str]] = []  # (when, key, task id)
    for i, (at, tenant, key, body) in enumerate(plan):
        while cancels and cancels[0][0] <= time.monotonic():
            _, k, tid = cancels.pop(0)
            _cancel(http, wl, k, tid)
        delay = started + at - time.monotonic()
        if delay > 0 and stop.wait(delay):
            return
        if stop.is_set():
            return
        idem = f"demo-{run_id}-{tenant.spec.key}-{threading.current_thread().name[-1]}-{i}"
        headers = {"Authorization": f"Bearer {key}", "Idempotency-Key": idem}
        try:
            r = http.post("/v1/generations", json=body, headers=headers)
        except httpx.HTTPError as e:
            wl.record(tenant.spec.key, f"HTTP_{type(e).__name__}", None)
            continue
        task_id = r.json().get("task_id") if r.status_code in (200, 202) else None
        wl.record(tenant.spec.key, _code(r), task_id)
        if task_id and rng.random() < DUPLICATE_RATE:  # the client retries: same key, same body
            again = http.post("/v1/generations", json=body, headers=headers)
            with wl.lock:
                wl.duplicates += 1
                wl.duplicates_same_task += int(again.status_code in (200, 202) and again.json().get("task_id") == task_id)
        if task_id and rng.random() < CANCEL_RATE:
            cancels.append((time.monotonic() + rng.uniform(0.2, 3.0), key, task_id))
            cancels.sort()
    for when, k, tid in cancels:
        if stop.wait(max(0.0, when - time.monotonic())):
            return
        _cancel(http, wl, k, tid)


def _cancel(http: httpx.Client, wl: Workload, key: str, task_id: str) -> None:
    try:
        r = http.post(f"/v1/generations/{task_id}/cancel", headers={"Authorization": f"Bearer {key}"})
        answer = "accepted" if r.status_code == 202 else _code(r)
    except httpx.HTTPError as e:
        answer = type(e).__name__
    with wl.lock:
        wl.cancels[answer] += 1


# --- what is printed --------------------------------------------------------------------------------------

def _logs_to_file(path: Path) -> Path:
    """The platform's logs (Python logging and the Powertools logger) go to a file, so the terminal
    shows the progress; the banner says where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stream = open(path, "a", buffering=1)  # noqa: SIM115 - open for the life of the process
    for name in ("", "aivedio"):
        for h in logging.getLogger(name).handlers:
            if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (sys.stderr, sys.stdout):
                h.setStream(stream)
    return path


def _print_banner(rt, admin: dict, opts: Options, log_path: Path) -> None:
    p, url = rt.platform, rt.base_url
    sys.stderr.write("\n".join([
        f"AiVedio is running (time_scale={p.clock.time_scale:g}: an hour passes in {60 / p.clock.time_scale:g} real minutes)",
        f"  API        {url}   (health: curl {url}/healthz)",
        f"  Swagger    {url}/swagger   (OpenAPI: {url}/openapi.json)",
        f"  dashboard  {url}/dashboard   sign in with the operator token below",
        f"  operator   {admin['name']} (admin)  token {admin['token']}",
        f"  database   {redact(p.db.url)}",
        f"  logs       {log_path}",
        f"  providers  " + ", ".join(f"{n} at {u}" for n, u in p.extras.get("provider_base_urls", {}).items()),
        "Ctrl-C stops everything.", "", ""]))
    sys.stderr.flush()


def _print_serving(rt, admin: dict, tenants: list[Tenant], opts: Options) -> None:
    url = rt.base_url
    lines = ["", f"AiVedio keeps serving at {url} (Ctrl-C stops it).",
             f"  dashboard  {url}/dashboard   operator token {admin['token']}"]
    if tenants:
        lines.append("  demo tenants' API keys:")
        for t in tenants:
            lines.append(f"    {t.name:<22} {t.spec.service_class:<20} weight {t.spec.weight}  {t.keys[0]}")
        key = next(t.keys[0] for t in tenants if t.spec.key == "paid-gold")
    else:
        lines += ["  create a tenant and keep its key:",
                  "    KEY=$(.venv/bin/aivedio admin tenant create --name acme-$RANDOM --service-class PAID_SHARED --weight 2 "
                  "--credits 10000 --json | .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)[\"api_key\"])')"]
        key = "$KEY"
    body = '{"model": "video-model-x", "mode": "text_to_video", "prompt": "a red fox in snow", "duration_seconds": 5, "resolution": "720p"}'
    lines += ["  try:",
              f"    curl -H 'Content-Type: application/json' -H \"Authorization: Bearer {key}\" "
              f"-H \"Idempotency-Key: try-$RANDOM\" -d '{body}' {url}/v1/generations",
              f"    curl -H \"Authorization: Bearer {key}\" {url}/v1/generations",
              f"    curl -H 'Authorization: Bearer {admin['token']}' {url}/admin/v1/lanes", ""]
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()
