"""Failpoints at the crash windows that matter (issue 18, "Faults"): `hit(name)` kills this process
on the spot, as a crash at exactly that instant would, with the probability the chaos run armed it
with; or, armed as a stall, stops the calling thread there for that many seconds, as a SIGSTOP past
the lease at exactly that instant would. Inert unless AIVEDIO_FAILPOINTS arms it, under the same
allow variable as the safeguard switches, and never in Lambda.

AIVEDIO_FAILPOINTS = "seed=N;name=probability,name=probability/stall=seconds" (seed: this
process's own)."""
from __future__ import annotations

import os
import random
import sys
import threading
import time

from aivedio.faults.safeguards import ALLOW_ENV, ALLOW_VALUE, SafeguardError

ENV = "AIVEDIO_FAILPOINTS"
EXIT_CODE = 86  # a process a failpoint killed exits with this (the runner counts them)

FAILPOINTS: dict[str, str] = {
    "after-commit-before-publish": "the outbox relay: the event's state committed, the event not yet published",
    "after-claim-before-dispatch": "a claim committed, its TaskDispatchRequested not yet delivered to dispatch",
    "before-submit-send": "the last instant before a submit is sent, after every check (a stall here is a worker paused then)",
    "after-accept-before-record": "the provider accepted a submit, the attempt not yet recorded as SUBMITTED",
    "after-ledger-before-ack": "settlement wrote the ledger, the queue message not yet acknowledged",
    "after-verify-before-apply": "a webhook's signature verified, the webhook not yet applied",
}


def _parse() -> tuple[random.Random | None, dict[str, tuple[float, float | None]]]:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None, {}
    if "AWS_LAMBDA_FUNCTION_NAME" in os.environ:
        raise SafeguardError(f"{ENV} is set in Lambda: failpoints are never armed there")
    if os.environ.get(ALLOW_ENV) != ALLOW_VALUE:
        raise SafeguardError(f"{ENV} needs {ALLOW_ENV}={ALLOW_VALUE}")
    seed, armed = 0, {}
    for part in raw.split(";"):
        part = part.strip()
        if part.startswith("seed="):
            seed = int(part[5:])
        elif part:
            for item in part.split(","):
                name, _, p = item.partition("=")
                if name not in FAILPOINTS:
                    raise SafeguardError(f"{ENV}: unknown failpoint {name!r} (known: {', '.join(FAILPOINTS)})")
                p, _, stall = p.partition("/stall=")
                armed[name] = (float(p), float(stall) if stall else None)
    return random.Random(seed), armed


_RNG, _ARMED = _parse()
_LOCK = threading.Lock()


def hit(name: str) -> None:
    """Crash here, now (or stall, if armed so), if this failpoint is armed and its draw says so."""
    if not _ARMED:
        return
    if name not in FAILPOINTS:
        raise KeyError(name)
    p, stall = _ARMED.get(name, (0.0, None))
    if not p:
        return
    with _LOCK:
        fire = _RNG.random() < p
    if not fire:
        return
    if stall is not None:
        sys.stderr.write(f"FAILPOINT {name}: stalling pid {os.getpid()} for {stall:g}s\n")
        time.sleep(stall)
        return
    sys.stderr.write(f"FAILPOINT {name}: crashing pid {os.getpid()}\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)


def env_for(seed: int, armed: dict[str, float], stalls: dict[str, list[float]] | None = None) -> dict[str, str]:
    """The environment arming these failpoints (name -> probability of a crash) and stalls (name ->
    [probability, seconds]) in a child process."""
    stalls = stalls or {}
    unknown = (set(armed) | set(stalls)) - set(FAILPOINTS)
    if unknown:
        raise SafeguardError(f"unknown failpoints {sorted(unknown)}")
    items = [f"{n}={p}" for n, p in sorted(armed.items()) if n not in stalls]
    items += [f"{n}={p}/stall={sec}" for n, (p, sec) in sorted(stalls.items())]
    if not items:
        return {}
    return {ENV: f"seed={seed};" + ",".join(items), ALLOW_ENV: ALLOW_VALUE}
