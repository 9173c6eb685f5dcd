"""`aivedio demo`: the whole platform on the embedded default (or the URLs in the environment), a
mixed multi-tenant workload driven through the HTTP API, live progress on stderr, and a final
report. Everything runs for real: admission, the scheduler, dispatch, attempt workflows against
the built-in provider simulator (which misbehaves a little, as providers do), webhooks, and the
terminal transitions. time_scale compresses the provider's minutes into seconds."""
from __future__ import annotations

import random
import sys
import time
import uuid
from dataclasses import dataclass
from statistics import median
from typing import Any

import httpx

from aivedio.config import PlatformConfig, ProviderConfig, SimulatorBehaviour, Timers

# Who takes part: (name, service class, contract weight, share of the submissions, request shapes)
TENANTS = (
    ("studio-enterprise", "ENTERPRISE_RESERVED", 4, 0.3, ("short", "long")),
    ("agency-paid", "PAID_SHARED", 2, 0.4, ("short", "hd", "long")),
    ("hobbyist", "STANDARD", 1, 0.3, ("short",)),
)
SHAPES: dict[str, dict[str, Any]] = {
    "short": {"model": "video-model-x", "mode": "text_to_video", "duration_seconds": 5, "resolution": "720p"},
    "hd": {"model": "video-model-x", "mode": "text_to_video", "duration_seconds": 8, "resolution": "1080p"},
    "long": {"model": "video-model-x", "mode": "text_to_video", "duration_seconds": 20, "resolution": "720p"},
}
PROMPTS = ("a fox running through snow", "city lights at dusk, slow pan", "waves on a rocky shore", "a paper boat in rain")
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def demo_config(time_scale: float) -> PlatformConfig:
    behaviour = SimulatorBehaviour(latency_seconds_min=20, latency_seconds_max=60, failure_rate=0.03,
                                   accept_then_timeout_rate=0.03, webhook_drop_rate=0.05, webhook_duplicate_rate=0.1)
    return PlatformConfig(time_scale=time_scale,
                          providers=[ProviderConfig(name="provider-a", submit_timeout_seconds=2.0, simulator=behaviour)],
                          timers=Timers(scheduler_tick_seconds=1.0, unknown_first_check_seconds=5))


@dataclass
class Submitted:
    tenant: str
    task_id: str
    submitted_at: float


def run_demo(*, tasks: int = 60, time_scale: float = 30.0, timeout_seconds: float = 300.0, seed: int = 7,
             config: PlatformConfig | None = None, progress: bool = True) -> dict[str, Any]:
    from aivedio.admin.tenants import create_tenant
    from aivedio.config import settings_from_env
    from aivedio.context import build_platform
    from aivedio.local.embedded import with_embedded_servers
    from aivedio.local.runtime import LocalRuntime

    rng = random.Random(seed)
    settings = with_embedded_servers(settings_from_env())
    platform = build_platform(settings, config or demo_config(time_scale), migrate=True)
    rt = LocalRuntime(platform, port=0)
    say = (lambda msg: sys.stderr.write(msg + "\n")) if progress else (lambda msg: None)
    try:
        rt.start()
        say(f"demo: platform up at {rt.base_url} (time_scale={platform.clock.time_scale:g})")
        run = uuid.uuid4().hex[:6]
        keys = {}
        for name, service_class, weight, _, _ in TENANTS:
            t = create_tenant(platform, name=f"{name}-{run}", service_class=service_class, weight=weight, credits=100_000)
            keys[name] = t.api_key
        http = httpx.Client(base_url=rt.base_url, timeout=30)
        submitted: list[Submitted] = []
        decisions: dict[str, int] = {}
        weights = [share for _, _, _, share, _ in TENANTS]
        for i in range(tasks):
            name, _, _, _, shapes = rng.choices(TENANTS, weights=weights)[0]
            body = {**SHAPES[rng.choice(shapes)], "prompt": rng.choice(PROMPTS)}
            r = http.post("/v1/generations", json=body,
                          headers={"Authorization": f"Bearer {keys[name]}", "Idempotency-Key": f"demo-{run}-{i}"})
            code = r.json().get("decision") or r.json().get("error") or str(r.status_code)
            decisions[code] = decisions.get(code, 0) + 1
            if r.status_code == 202:
                submitted.append(Submitted(name, r.json()["task_id"], time.monotonic()))
        say(f"demo: {len(submitted)} of {tasks} admitted {decisions}")
        deadline = time.monotonic() + timeout_seconds
        states: dict[str, dict[str, Any]] = {}
        last = ""
        while time.monotonic() < deadline:
            for s in submitted:
                if states.get(s.task_id, {}).get("state") in TERMINAL:
                    continue
                states[s.task_id] = http.get(f"/v1/generations/{s.task_id}",
                                             headers={"Authorization": f"Bearer {keys[s.tenant]}"}).json()
            counts: dict[str, int] = {}
            for doc in states.values():
                counts[doc.get("state", "?")] = counts.get(doc.get("state", "?"), 0) + 1
            line = " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
            if line != last:
                say(f"demo: {line}")
                last = line
            if all(d.get("state") in TERMINAL for d in states.values()):
                break
            time.sleep(0.5)
        return _report(platform, submitted, states, decisions, tasks)
    finally:
        rt.stop()
        platform.close()


def _report(platform, submitted: list[Submitted], states: dict[str, dict], decisions: dict[str, int], tasks: int) -> dict:
    per_tenant: dict[str, dict[str, Any]] = {}
    for s in submitted:
        doc = states.get(s.task_id, {})
        t = per_tenant.setdefault(s.tenant, {"tasks": 0, "states": {}, "charged": 0, "wait_seconds": []})
        t["tasks"] += 1
        t["states"][doc.get("state", "?")] = t["states"].get(doc.get("state", "?"), 0) + 1
        t["charged"] += int((doc.get("charge") or {}).get("final_charge_amount") or 0)
        if doc.get("started_at") and doc.get("created_at"):
            from datetime import datetime

            waited = (datetime.fromisoformat(doc["started_at"].replace("Z", "+00:00"))
                      - datetime.fromisoformat(doc["created_at"].replace("Z", "+00:00"))).total_seconds()
            t["wait_seconds"].append(waited * platform.clock.time_scale)
    for t in per_tenant.values():
        waits = sorted(t.pop("wait_seconds"))
        t["wait_platform_seconds"] = {"p50": round(median(waits), 1) if waits else None,
                                      "max": round(waits[-1], 1) if waits else None}
    with platform.db.connection() as conn:
        leaked = conn.execute("""select count(*) as n from resource_reservation r join generation_task t using (task_id)
                                  where r.state = 'ACTIVE' and t.state in ('SUCCEEDED', 'FAILED', 'CANCELLED')""").fetchone()["n"]
    finished = sum(1 for d in states.values() if d.get("state") in TERMINAL)
    return {"submitted": tasks, "admitted": len(submitted), "decisions": decisions, "finished": finished,
            "all_finished": finished == len(submitted), "tenants": per_tenant,
            "reservations_leaked_on_terminal_tasks": leaked}


def register(sub) -> None:
    s = sub.add_parser("demo", help="serve on the embedded default, drive a mixed workload through the API, report")
    s.add_argument("--tasks", type=int, default=60)
    s.add_argument("--time-scale", type=float, default=30.0, help="platform seconds per real second")
    s.add_argument("--timeout", type=float, default=300.0, help="real seconds to wait for every task to finish")
    s.add_argument("--seed", type=int, default=7)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=_demo)


def _demo(args) -> int:
    from aivedio.cli import _emit

    if args.tasks < 1 or args.time_scale <= 0:
        sys.stderr.write("aivedio demo: --tasks must be >= 1 and --time-scale > 0\n")
        return 2
    doc = run_demo(tasks=args.tasks, time_scale=args.time_scale, timeout_seconds=args.timeout, seed=args.seed)
    _emit(doc, args.json)
    return 0 if doc["all_finished"] and doc["reservations_leaked_on_terminal_tasks"] == 0 else 1
