"""The fault plan: everything a chaos run does derives from its seed, drawn up front, written to
plan.json and printed before the run starts, so a failing seed reproduces its scenario.

One seed gives a seed per component (workload, faults, failpoints, provider), its own fault
intensities (some seeds are kill-heavy, some have no Redis faults, some a quiet provider), the
timed fault events, and the windows in which liveness is judged. A `target` (a safeguard's name)
biases the plan towards the faults that exercise that safeguard, so that `--break X` on X's
targeted seed shows X's checker firing, and the same targeted seed without the switch shows none.

Faults never take a whole role down at once: two events never overlap on one role's processes
unless the role has another process up (the reconciler, alone in its role, is never killed), and
a liveness window is a stretch with no fault active."""
from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from aivedio.faults.failpoints import FAILPOINTS
from aivedio.faults.safeguards import SAFEGUARDS, SafeguardError

ROLES = {"api": 2, "scheduler": 2, "dispatcher": 2, "reconciler": 1}
TIME_SCALE = 40.0  # platform seconds per real second
ACCOUNTS = {"acc-1": 4, "acc-2": 3}  # the platform's max_concurrency per provider account
TENANTS = (  # name, service class, weight, charge policy, requests per second
    ("t-enterprise", "ENTERPRISE_RESERVED", 4, "SUCCESS_ONLY", 1.2),
    ("t-paid-a", "PAID_SHARED", 2, "SUCCESS_ONLY", 1.2),
    ("t-paid-b", "PAID_SHARED", 1, "SUCCESS_ONLY", 1.0),
    ("t-standard", "STANDARD", 1, "SUCCESS_ONLY", 0.8),
)
LIVENESS_WINDOW_MIN_S = 4.0  # shorter quiet stretches are not judged
LIVENESS_BOUND_S = 60.0  # real seconds from the end of the faults to every task settled (see runner.TIMERS)

# The fault kinds, in families whose intensity each seed draws on its own.
FAMILIES = {
    "kill": ("kill",),
    "stop": ("stop",),
    "pg": ("pg-terminate", "pg-hold-row", "pg-pin-xmin", "pg-lock-timeout"),
    "redis": ("redis-flushall", "redis-pause", "redis-kill"),
    "proxy": ("proxy",),
}
PROXY_TARGETS = ("pg", "redis", "provider")
PROXY_MODES = ("delay", "drop", "stall", "reset")

# A safeguard's targeted plan: the checker that must fire when it is broken, and what the plan
# turns up to exercise it (intensities, provider behaviour, failpoints, workload).
TARGETS: dict[str, dict[str, Any]] = {
    "idempotency-lock": {"checker": "admission-idempotency", "workload": {"duplicate_rate": 0.5, "racing_duplicates": True}},
    "publish-in-transaction": {"checker": "total-queue", "failpoints": {"after-commit-before-publish": 0.05}},
    "lookup-before-retry": {"checker": "one-provider-job", "provider": {"accept_then_timeout_rate": 0.3}},
    "capacity-check": {"checker": "capacity", "workload": {"rate_factor": 2.0}},
    # A worker paused between its send marker and the send, past its lease: the attempt is
    # replaced (absence confirmed), then the stale worker sends and reports on the old token.
    "fencing": {"checker": "fencing", "stalls": {"before-submit-send": [0.15, 6.0]}},
    # A quiet seed: with no fault to lose an execution, any rescue is a rescue of a live attempt.
    # A lease of 10 s real (400 platform s) so that a step merely slowed on busy cores is not rescued.
    "rescuer-state-guard": {"checker": "rescues", "intensity": {f: 0.0 for f in ("kill", "stop", "pg", "redis", "proxy")},
                            "failpoints": {}, "stalls": {}, "timers": {"lease_seconds": 400}},
    "settlement-idempotency": {"checker": "charged-once", "deliveries": {"max_copies": 3, "rate": 0.5}},
    "release-on-terminal": {"checker": "charged-once"},
    "webhook-dedupe": {"checker": "webhooks", "provider": {"webhook_duplicate_rate": 0.8, "webhook_drop_rate": 0.0}},
    "lease-scanner": {"checker": "liveness", "intensity": {"kill": 1.0}},
}


def _component_seed(seed: int, component: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{component}".encode()).digest()[:8], "big")


def _intensities(rng: random.Random) -> dict[str, float]:
    """Per family: off (a third of the seeds for each family), light or heavy."""
    return {f: rng.choice((0.0, 0.0, 0.3, 0.6, 1.0)) for f in FAMILIES}


def _provider(rng: random.Random, seed: int) -> dict[str, Any]:
    quiet = rng.random() < 0.15
    r = (lambda hi: 0.0) if quiet else (lambda hi: round(rng.uniform(0, hi), 3))
    return {"seed": seed, "queue_seconds_min": 0, "queue_seconds_max": 4, "latency_seconds_min": 20, "latency_seconds_max": 60,
            "failure_rate": r(0.08), "failed_but_charged_rate": r(0.5), "accept_then_timeout_rate": r(0.12),
            "server_error_rate": r(0.05), "burst_429_rate": r(0.03), "burst_429_seconds": 20, "retry_after_seconds": 2,
            "webhook_drop_rate": r(0.2), "webhook_duplicate_rate": r(0.3), "webhook_delay_seconds_max": r(40)}


def _events(rng: random.Random, duration: float, intensity: dict[str, float]) -> list[dict[str, Any]]:
    """Timed fault events over [1, duration - 1]: a Poisson-like count per family scaled by its
    intensity, each placed where it does not take the last process of a role down."""
    events: list[dict[str, Any]] = []
    busy: dict[str, list[tuple[float, float]]] = {}  # process -> its down intervals

    def free(proc: str, t0: float, t1: float) -> bool:
        return all(t1 <= a or t0 >= b for a, b in busy.get(proc, []))

    def role_up(role: str, t0: float, t1: float, proc: str) -> bool:
        others = [f"{role}-{i}" for i in range(ROLES[role]) if f"{role}-{i}" != proc]
        return any(free(o, t0, t1) for o in others)

    per_family = {"kill": 0.12, "stop": 0.08, "pg": 0.25, "redis": 0.12, "proxy": 0.2}  # events per second at intensity 1
    for family, rate in per_family.items():
        n = int(round(rate * duration * intensity[family] + (rng.random() - 0.5) * intensity[family]))
        for _ in range(max(0, n)):
            t = round(rng.uniform(1.0, max(1.5, duration - 2.0)), 2)
            kind = rng.choice(FAMILIES[family])
            ev: dict[str, Any] = {"t": t, "kind": kind}
            if family in ("kill", "stop"):
                role = rng.choice([r for r in ROLES if ROLES[r] > 1])
                proc = f"{role}-{rng.randrange(ROLES[role])}"
                # stop: past the attempt lease (runner.TIMERS.lease_seconds / TIME_SCALE = 3 s real)
                span = round(rng.uniform(0.5, 2.0), 2) if family == "kill" else round(rng.uniform(4.0, 6.0), 2)
                if not (free(proc, t, t + span) and role_up(role, t, t + span, proc)):
                    continue
                busy.setdefault(proc, []).append((t, t + span))
                ev.update(target=proc, seconds=span)
            elif kind == "pg-terminate":
                ev.update(n=rng.randint(1, 4))
            elif kind == "pg-hold-row":
                ev.update(table=rng.choice(("wallet_account", "resource_pool_shard")), seconds=round(rng.uniform(0.3, 2.0), 2))
            elif kind == "pg-pin-xmin":
                ev.update(seconds=round(rng.uniform(1.0, 5.0), 2))
            elif kind == "pg-lock-timeout":
                ev.update(ms=rng.choice((20, 50, 100)), seconds=round(rng.uniform(1.0, 4.0), 2))
            elif kind == "redis-pause":
                ev.update(ms=rng.choice((200, 500, 1500)))
            elif kind == "redis-kill":
                ev.update(seconds=round(rng.uniform(0.5, 2.0), 2))
            elif kind == "proxy":
                ev.update(target=rng.choice(PROXY_TARGETS), mode=rng.choice(PROXY_MODES),
                          seconds=round(rng.uniform(0.2, 1.5), 2), ms=rng.choice((20, 100, 300)))
            events.append(ev)
    return sorted(events, key=lambda e: (e["t"], e["kind"], e.get("target", "")))


def _span(ev: dict[str, Any]) -> float:
    return float(ev.get("seconds") or (ev.get("ms", 0) / 1000.0) or 0.5)


def liveness_windows(events: list[dict[str, Any]], duration: float) -> list[list[float]]:
    """Stretches of at least LIVENESS_WINDOW_MIN_S with no fault active (a fault's effects are
    given 2 s more to wear off); the run's first 3 s (processes warming up) are not judged."""
    covered = sorted((e["t"], e["t"] + _span(e) + 2.0) for e in events)
    windows, t = [], 3.0
    for a, b in covered:
        if a - t >= LIVENESS_WINDOW_MIN_S:
            windows.append([round(t, 2), round(a, 2)])
        t = max(t, b)
    if duration - t >= LIVENESS_WINDOW_MIN_S:
        windows.append([round(t, 2), round(duration, 2)])
    return windows


def make_plan(seed: int, duration: float = 20.0, *, target: str | None = None, breaks: tuple[str, ...] = (),
              untargeted: bool = False) -> dict[str, Any]:
    """The whole run, as data. Same (seed, duration, target) -> the same plan, whatever breaks
    (a break with no target aims the plan at the first safeguard broken, unless `untargeted`)."""
    target = target or (breaks[0] if breaks and not untargeted else None)
    if duration < 5:
        raise SafeguardError(f"--duration: {duration} s (at least 5)")
    for name in (*breaks, *([target] if target else [])):
        if name not in SAFEGUARDS:
            raise SafeguardError(f"unknown safeguard {name!r} (known: {', '.join(SAFEGUARDS)})")
    seeds = {c: _component_seed(seed, c) for c in ("workload", "faults", "failpoints", "provider", "deliveries")}
    frng = random.Random(seeds["faults"])
    spec = TARGETS.get(target, {}) if target else {}
    intensity = {**_intensities(frng), **spec.get("intensity", {})}
    provider = {**_provider(random.Random(seeds["provider"]), seeds["provider"] % 2**31), **spec.get("provider", {})}
    prng = random.Random(seeds["failpoints"])
    fp_intensity = prng.choice((0.0, 0.0, 0.01, 0.03))
    failpoints = {name: round(prng.uniform(0, fp_intensity), 4) for name in FAILPOINTS} if fp_intensity else {}
    if "failpoints" in spec:  # a target names its failpoints exactly (none for a quiet seed)
        failpoints = dict(spec["failpoints"])
    # Stalls: a thread stopped at a failpoint past its lease (a SIGSTOP at exactly that instant).
    stalls = {"before-submit-send": [round(prng.uniform(0.0, 0.05), 4), 6.0]} if prng.random() < 0.3 else {}
    stalls = dict(spec.get("stalls", stalls))
    drng = random.Random(seeds["deliveries"])
    deliveries = {"max_copies": drng.choice((1, 1, 2, 5)), "rate": round(drng.uniform(0, 0.3), 3), **spec.get("deliveries", {})}
    wrng = random.Random(seeds["workload"])
    workload = {"duplicate_rate": round(wrng.uniform(0.02, 0.1), 3), "conflict_rate": round(wrng.uniform(0.01, 0.05), 3),
                "cancel_rate": round(wrng.uniform(0.02, 0.08), 3), "long_rate": round(wrng.uniform(0.1, 0.3), 3),
                "racing_duplicates": False, "rate_factor": 1.0, **spec.get("workload", {})}
    events = _events(frng, duration, intensity)
    return {
        "seed": seed, "duration_s": duration, "target": target, "breaks": list(breaks),
        "checker_expected": TARGETS[breaks[0]]["checker"] if breaks else None,
        "seeds": seeds, "roles": dict(ROLES), "intensity": intensity, "provider": provider, "failpoints": failpoints, "stalls": stalls,
        "deliveries": deliveries, "workload": workload,
        "tenants": [{"name": n, "service_class": c, "weight": w, "charge_policy": cp, "rate_per_s": r} for n, c, w, cp, r in TENANTS],
        "faults": events, "liveness_windows": liveness_windows(events, duration), "timers": dict(spec.get("timers", {})),
        "params": {"time_scale": TIME_SCALE, "accounts": dict(ACCOUNTS), "liveness_bound_s": LIVENESS_BOUND_S,
                   "breaks": list(breaks)},
    }


def digest(plan: dict[str, Any]) -> str:
    """The plan's identity: equal digests, equal scenarios (the tenants' database ids, filled in
    once they exist, are not part of it)."""
    fixed = {k: v for k, v in plan.items() if k != "params"}
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:16]


def describe(plan: dict[str, Any]) -> list[str]:
    """The plan in a few lines, printed before the run starts."""
    kinds: dict[str, int] = {}
    for e in plan["faults"]:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    lines = [f"chaos seed {plan['seed']}  plan {digest(plan)}  duration {plan['duration_s']:g}s"
             + (f"  target {plan['target']}" if plan["target"] else "")
             + (f"  BREAKING {','.join(plan['breaks'])}" if plan["breaks"] else ""),
             "  intensity  " + ", ".join(f"{k}={v:g}" for k, v in plan["intensity"].items()),
             "  faults     " + (", ".join(f"{k}x{n}" for k, n in sorted(kinds.items())) or "none"),
             "  failpoints " + (", ".join(f"{k}={v:g}" for k, v in plan["failpoints"].items()) or "none"),
             "  stalls     " + (", ".join(f"{k}={p:g} for {sec:g}s" for k, (p, sec) in plan["stalls"].items()) or "none"),
             "  provider   " + ", ".join(f"{k}={v}" for k, v in plan["provider"].items() if k.endswith("rate") and v),
             f"  deliveries up to {plan['deliveries']['max_copies']} copies at rate {plan['deliveries']['rate']:g}",
             f"  liveness windows {plan['liveness_windows']}"]
    return lines
