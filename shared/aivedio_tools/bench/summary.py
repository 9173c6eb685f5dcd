"""The bench's one-page verdict: every figure that has a target, beside it, met or not, read from
the sections' own reports (each section states its targets where it measures them)."""
from __future__ import annotations

from typing import Any

# (section, the figure's path in the section's report, the target's path, "min" or "max")
FIGURES: tuple[tuple[str, tuple[str, ...], tuple[str, ...], str], ...] = (
    ("admission", ("in_process", "ratio_vs_pgbench"), ("targets", "in_process_ratio_vs_pgbench"), "min"),
    ("admission", ("http", "ratio_vs_pgbench"), ("targets", "http_ratio_vs_pgbench"), "min"),
    ("admission", ("http", "half_load", "p99_ms"), ("targets", "half_load_p99_ms"), "max"),
    ("admission", ("pg_cpu_ratio",), ("targets", "pg_cpu_ratio_max"), "max"),
    ("admission", ("hot_wallet", "ratio_to_spread"), ("targets", "hot_wallet_ratio_to_spread"), "min"),
    ("settlement", ("ratio_vs_pgbench",), ("target_ratio",), "min"),
)


def _get(doc: Any, path: tuple[str, ...]) -> Any:
    for p in path:
        if not isinstance(doc, dict) or p not in doc:
            return None
        doc = doc[p]
    return doc


def _generic(section: str, doc: Any, path: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Targets stated beside their figure in a nested report: target_ratio (a floor on
    ratio_vs_pgbench), target_ratio_min (on ratio_large_vs_small), target_ratio_max (on each ratio
    of `ratios`)."""
    out: list[dict[str, Any]] = []
    if not isinstance(doc, dict):
        return out
    if "target_ratio" in doc and "ratio_vs_pgbench" in doc and path:
        out.append(_row(section, path + ("ratio_vs_pgbench",), doc["ratio_vs_pgbench"], doc["target_ratio"], "min"))
    if "target_ratio_min" in doc and "ratio_large_vs_small" in doc:
        out.append(_row(section, path + ("ratio_large_vs_small",), doc["ratio_large_vs_small"], doc["target_ratio_min"], "min"))
    if "target_ratio_max" in doc and isinstance(doc.get("ratios"), dict):
        out += [_row(section, path + ("ratios", k), v, doc["target_ratio_max"], "max") for k, v in doc["ratios"].items()]
    for k, v in doc.items():
        if isinstance(v, dict) and k not in ("ratios", "targets"):
            out += _generic(section, v, path + (k,))
    return out


def _row(section: str, path: tuple[str, ...], value: Any, target: Any, kind: str) -> dict[str, Any]:
    met = None if value is None or target is None else (value >= target if kind == "min" else value <= target)
    return {"figure": ".".join((section, *path)), "value": value, "target": f"{'>=' if kind == 'min' else '<='} {target}",
            "met": met}


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    rows = [_row(s, f, _get(report.get(s), f), _get(report.get(s), t), k) for s, f, t, k in FIGURES if s in report]
    rows += [r for s in ("scheduler",) if s in report for r in _generic(s, report[s])]
    return {"figures": rows, "met": sum(1 for r in rows if r["met"]), "missed": sum(1 for r in rows if r["met"] is False),
            "unmeasured": sum(1 for r in rows if r["met"] is None)}
