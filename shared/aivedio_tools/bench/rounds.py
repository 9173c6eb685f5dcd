"""Alternating rounds: a benchmark, then its baseline, `rounds` times, and each ratio reported as
the median of the rounds' ratios with their spread beside it. These machines are noisy (one run of
the same benchmark gave 0.35 and 0.43 minutes apart): a figure from one round says little, the
median of alternating rounds says what the bench and its baseline share, the spread how far to
trust it."""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

DEFAULT_ROUNDS = 3


def spread(values: list[float | None], digits: int = 3) -> dict:
    """{"median", "min", "max", "values"} of the rounds' figures (None where a round had none)."""
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "values": values}
    return {"median": round(statistics.median(got), digits), "min": round(min(got), digits), "max": round(max(got), digits),
            "values": [None if v is None else round(v, digits) for v in values]}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def alternate(bench: Callable[[int], dict], baseline: Callable[[int], dict], *, rounds: int,
              figure: Callable[[dict], float | None], baseline_figure: Callable[[dict], float | None]) -> dict:
    """bench(i) then baseline(i), for i in range(rounds). Returns {"rounds": [{"bench", "baseline",
    "ratio"}...], "ratio": spread of the ratios}: ratio = figure(bench) / baseline_figure(baseline)."""
    out: list[dict[str, Any]] = []
    for i in range(rounds):
        b = bench(i)
        base = baseline(i)
        out.append({"bench": b, "baseline": base, "ratio": ratio(figure(b), baseline_figure(base))})
    return {"rounds": out, "ratio": spread([r["ratio"] for r in out])}
