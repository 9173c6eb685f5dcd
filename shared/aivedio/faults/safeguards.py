"""Named safeguard switches: each one, when broken, disables one safeguard of the platform, so that
the chaos suite can prove the checker that guards it is able to fail (issue 18, "Each checker is
proven able to fail").

They are read here and nowhere else. A switch turns on only when AIVEDIO_CHAOS_BREAK names it and
AIVEDIO_CHAOS_ALLOW_BREAKING is exactly ALLOW_VALUE, and never in Lambda: a Lambda environment
that names one fails at import, so a deploy that sets one cannot start (and the synth test
asserts no function sets either variable)."""
from __future__ import annotations

import logging
import os

BREAK_ENV = "AIVEDIO_CHAOS_BREAK"
ALLOW_ENV = "AIVEDIO_CHAOS_ALLOW_BREAKING"
ALLOW_VALUE = "i-know-this-breaks-the-platform"

# name -> the safeguard it disables (and where it lives).
SAFEGUARDS: dict[str, str] = {
    "idempotency-lock": "admission's lock on the idempotency record: two requests with one key make one task",
    "publish-in-transaction": "the outbox: an event is written in the same transaction as the state it announces",
    "lookup-before-retry": "a SUBMIT_UNKNOWN is looked up by its idempotency key before any new submit",
    "capacity-check": "the claim's check of the provider account's free slots",
    "fencing": "a write of an attempt's step carries its fencing token and a stale one is refused",
    "rescuer-state-guard": "the lease scanner restarts only attempts still live and still expired",
    "settlement-idempotency": "settlement applies a terminal event once (processed_event)",
    "release-on-terminal": "a terminal task releases its resource reservations",
    "webhook-dedupe": "a provider webhook is applied once per webhook-id",
    "lease-scanner": "the lease scanner restarts attempts whose execution was lost",
}


class SafeguardError(RuntimeError):
    pass


def _parse() -> frozenset[str]:
    raw = os.environ.get(BREAK_ENV, "").strip()
    if not raw:
        return frozenset()
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    unknown = names - set(SAFEGUARDS)
    if unknown:
        raise SafeguardError(f"{BREAK_ENV}: unknown safeguards {sorted(unknown)} (known: {', '.join(SAFEGUARDS)})")
    if "AWS_LAMBDA_FUNCTION_NAME" in os.environ:
        raise SafeguardError(f"{BREAK_ENV} is set in Lambda: safeguards are never broken there")
    if os.environ.get(ALLOW_ENV) != ALLOW_VALUE:
        raise SafeguardError(f"{BREAK_ENV}={raw} needs {ALLOW_ENV}={ALLOW_VALUE}")
    logging.getLogger("aivedio").warning("SAFEGUARDS BROKEN on purpose in this process: %s", ", ".join(sorted(names)))
    return names


_BROKEN: frozenset[str] = _parse()


def broken(name: str) -> bool:
    """True when this process runs with the named safeguard switched off (a chaos run only)."""
    if name not in SAFEGUARDS:
        raise KeyError(name)  # a typo at a call site must not silently keep a safeguard on
    return name in _BROKEN


def env_for(names: list[str] | tuple[str, ...]) -> dict[str, str]:
    """The environment that breaks these safeguards in a child process."""
    unknown = set(names) - set(SAFEGUARDS)
    if unknown:
        raise SafeguardError(f"unknown safeguards {sorted(unknown)} (known: {', '.join(SAFEGUARDS)})")
    return {BREAK_ENV: ",".join(names), ALLOW_ENV: ALLOW_VALUE} if names else {}
