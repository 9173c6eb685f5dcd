"""Which seeds a sweep runs, and `aivedio chaos soak`.

CI (tests/reliability/test_chaos.py) runs, in this order: the seeds in FAILING_SEEDS_FILE (a seed
that ever failed is replayed first, forever, until it is taken out by hand with its fix), the
FIXED_SEEDS, and seeds derived from the commit, so each commit explores a little new ground; and
for a rotating subset of the safeguard switches (chosen by the commit too), the switch's targeted
seed with the switch, whose checker must fire, and without, where none may."""
from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from aivedio.faults.safeguards import SAFEGUARDS
from aivedio_tools.chaos import plan as plans
from aivedio_tools.chaos import runner

FAILING_SEEDS_FILE = Path(__file__).resolve().parents[3] / "tests" / "reliability" / "chaos_failing_seeds.txt"
FIXED_SEEDS = (1, 2)
COMMIT_SEEDS = 1
# One switch per commit, drawn from its hash: a switch run is two chaos runs (up to 2 min when
# its checker is liveness, which waits out the bound), CI's time is near its limit, and every switch
# is also proven each run at the integration level (tests/integration/test_chaos_safeguards_*).
SWITCHES_PER_RUN = 1
TARGET_SEED = 7  # the seed each switch's targeted plan is drawn from


def commit_id(repo: Path | None = None) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo or FAILING_SEEDS_FILE.parent, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "no-commit"
    except (OSError, subprocess.SubprocessError):
        return "no-commit"


def _derived(text: str, n: int, modulo: int) -> list[int]:
    return [int.from_bytes(hashlib.sha256(f"{text}:{i}".encode()).digest()[:4], "big") % modulo for i in range(n)]


def failing_seeds(path: Path = FAILING_SEEDS_FILE) -> list[int]:
    if not path.exists():
        return []
    return [int(line.split("#")[0]) for line in path.read_text().splitlines() if line.split("#")[0].strip()]


def remember_failure(seed: int, why: str, path: Path = FAILING_SEEDS_FILE) -> None:
    if seed in failing_seeds(path):
        return
    with path.open("a") as f:
        f.write(f"{seed}  # {why}\n")


def ci_seeds(commit: str) -> list[int]:
    seen: list[int] = []
    for s in (*failing_seeds(), *FIXED_SEEDS, *(100 + x for x in _derived(commit, COMMIT_SEEDS, 1_000_000))):
        if s not in seen:
            seen.append(s)
    return seen


def ci_switches(commit: str) -> list[str]:
    names = sorted(SAFEGUARDS)
    start = _derived(commit, 1, len(names))[0]
    return [names[(start + i) % len(names)] for i in range(SWITCHES_PER_RUN)]


def soak(seconds: float, duration: float, out: Path, *, admin_url: str, echo) -> dict[str, Any]:
    """Seeds one after another (the failing ones first, then from a counter) until `seconds` pass."""
    t0 = time.monotonic()
    queue = failing_seeds()
    nxt = int(time.time()) % 1_000_000
    report: dict[str, Any] = {"seeds": 0, "tasks": 0, "faults": {}, "violations": 0, "failing_seeds": []}
    while seconds <= 0 or time.monotonic() - t0 < seconds:
        if queue:
            seed = queue.pop(0)
        else:
            seed, nxt = nxt, nxt + 1
        v = runner.run(seed, duration, out / str(seed), admin_url=admin_url, echo=echo)
        report["seeds"] += 1
        report["tasks"] += v["run"]["facts"].get("tasks", 0)
        for k, n in v["run"]["faults"].items():
            report["faults"][k] = report["faults"].get(k, 0) + n
        if not v["ok"]:
            report["violations"] += sum(len(x) for x in v["violations"].values())
            report["failing_seeds"].append(seed)
            remember_failure(seed, ",".join(sorted(v["violations"])))
        echo(json.dumps({"seed": seed, "ok": v["ok"], "fired": sorted(v["violations"])}))
    return report


def switch_rates(seeds: list[int], duration: float, out: Path, *, admin_url: str, echo,
                 switches: list[str] | None = None) -> dict[str, Any]:
    """How often each switch's checker fires on seeds not aimed at it (plans drawn as for any seed,
    the switch on): a measure of how much of the ground the random sweep covers."""
    report: dict[str, Any] = {}
    for name in switches or sorted(SAFEGUARDS):
        checker = plans.TARGETS[name]["checker"]
        fired = 0
        for seed in seeds:
            # target=None with a break would aim the plan; the untargeted plan is the seed's own.
            v = runner.run(seed, duration, out / f"{name}-{seed}", admin_url=admin_url, breaks=(name,), untargeted=True,
                           echo=lambda s: None)
            hit = checker in v["violations"]
            fired += hit
            echo(json.dumps({"switch": name, "seed": seed, "checker": checker, "fired": hit, "all_fired": sorted(v["violations"])}))
        report[name] = {"checker": checker, "seeds": len(seeds), "fired": fired}
    return report
