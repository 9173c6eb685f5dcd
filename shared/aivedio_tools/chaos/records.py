"""A chaos run's recorded files, loaded once: what the checkers read, and nothing else.

`Run.load(dir)` reads the run directory the runner writes (plan.json, history.jsonl, facts/*.json,
truth.json, samples.jsonl, faults.jsonl, run.json). A missing required file is an explicit
`RunFileMissing` naming it; samples and faults are optional (a run may have taken none). A `Run`
can also be built in memory (the unit tests' tiny models): every field has an empty default.

`Run.ops` pairs the history's lines into operations: each "invoke" with the next line of the same
process (its ok, fail or info), in the order recorded. An invoke without its answer (the run ended
first) is an op of type "pending"."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from aivedio_tools.chaos.facts import FACT_FILES, OPTIONAL_FACTS

PLAN, HISTORY, TRUTH, RUN = "plan.json", "history.jsonl", "truth.json", "run.json"
SAMPLES, FAULTS = "samples.jsonl", "faults.jsonl"
FACTS_DIR = "facts"
REQUIRED_FILES = (PLAN, HISTORY, TRUTH, RUN)
OPTIONAL_FILES = (SAMPLES, FAULTS)
INVOKE = "invoke"
OK, FAIL, INFO, PENDING = "ok", "fail", "info", "pending"


class RunFileMissing(FileNotFoundError):
    """A file every run directory has is not there: the directory is not a (finished) chaos run."""


class RunFileMalformed(ValueError):
    pass


@dataclass(frozen=True)
class Op:
    """One client operation: its invoke line and its completion line (None while pending)."""

    invoke: dict[str, Any]
    done: dict[str, Any] | None

    @property
    def type(self) -> str:
        return self.done["type"] if self.done is not None else PENDING

    @property
    def f(self) -> str:
        return self.invoke["f"]

    @property
    def process(self) -> str:
        return self.invoke["process"]

    @property
    def tenant(self) -> str | None:
        return self.invoke.get("tenant")

    @property
    def key(self) -> str | None:
        return self.invoke.get("key")

    @property
    def body(self) -> str | None:
        return self.invoke.get("body")

    @property
    def t0(self) -> float:
        return float(self.invoke["t"])

    @property
    def t1(self) -> float:
        """When the answer was recorded; infinity while pending (it may still take effect)."""
        return float(self.done["t"]) if self.done is not None else math.inf

    @property
    def value(self) -> dict[str, Any]:
        return (self.done or {}).get("value") or {}

    @property
    def task_id(self) -> str | None:
        """The task the op is about: the one a submit's answer names, else the one it was asked about."""
        return self.value.get("task_id") or (self.done or {}).get("task_id") or self.invoke.get("task_id")

    def lines(self) -> list[dict[str, Any]]:
        return [self.invoke] + ([self.done] if self.done is not None else [])


@dataclass
class Run:
    plan: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    facts: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    truth: dict[str, Any] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    run: dict[str, Any] = field(default_factory=dict)
    dir: Path | None = None

    @classmethod
    def load(cls, directory: str | Path) -> Run:
        d = Path(directory)
        for name in REQUIRED_FILES:
            _require(d / name)
        facts: dict[str, list[dict[str, Any]]] = {}
        for name in FACT_FILES:
            path = d / FACTS_DIR / f"{name}.json"
            if name in OPTIONAL_FACTS and not path.exists():
                continue
            facts[name] = _read_json(_require(path))
        history = sorted(_read_jsonl(d / HISTORY), key=lambda line: line.get("i", 0))
        return cls(plan=_read_json(d / PLAN), history=history, facts=facts, truth=_read_json(d / TRUTH),
                   samples=_read_jsonl(d / SAMPLES) if (d / SAMPLES).exists() else [],
                   faults=_read_jsonl(d / FAULTS) if (d / FAULTS).exists() else [],
                   run=_read_json(d / RUN), dir=d)

    @property
    def params(self) -> dict[str, Any]:
        return self.plan.get("params") or {}

    def rows(self, name: str) -> list[dict[str, Any]]:
        """One facts table's rows (none when the model leaves it out)."""
        return self.facts.get(name) or []

    def tenant_id(self, tenant: str | None) -> str | None:
        """A history tenant name as the facts spell it (plan params name -> tenant_id); a name the
        plan does not map stands for itself."""
        spec = (self.params.get("tenants") or {}).get(tenant)
        return str(spec["tenant_id"]) if isinstance(spec, dict) and spec.get("tenant_id") else tenant

    @cached_property
    def ops(self) -> list[Op]:
        """The history's lines paired per process, in the order of their invokes."""
        out: list[Op] = []
        open_: dict[str, dict[str, Any]] = {}
        for line in self.history:
            proc = line.get("process")
            if line.get("type") == INVOKE:
                if proc in open_:  # a second invoke before an answer: the first never got one
                    out.append(Op(open_.pop(proc), None))
                open_[proc] = line
            elif proc in open_:
                out.append(Op(open_.pop(proc), line))
        out += [Op(inv, None) for inv in open_.values()]
        return sorted(out, key=lambda op: op.invoke.get("i", 0))

    def jobs(self) -> list[dict[str, Any]]:
        """The provider simulator's jobs (truth.json: one simulator's truth, or {provider: truth})."""
        if "jobs" in self.truth:
            return list(self.truth["jobs"])
        return [j for t in self.truth.values() if isinstance(t, dict) for j in t.get("jobs", [])]

    def provider_accounts(self) -> dict[str, dict[str, Any]]:
        if "accounts" in self.truth:
            return dict(self.truth["accounts"])
        return {a: v for t in self.truth.values() if isinstance(t, dict) for a, v in (t.get("accounts") or {}).items()}


def _require(path: Path) -> Path:
    if not path.exists():
        raise RunFileMissing(f"{path}: missing; a chaos run directory has {', '.join(REQUIRED_FILES)} and "
                             f"{FACTS_DIR}/{{{', '.join(n for n in FACT_FILES if n not in OPTIONAL_FACTS)}}}.json")
    return path


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RunFileMalformed(f"{path}: {e}") from None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                if n == _line_count(path):  # the last line of a file cut off mid-write (a killed runner)
                    break
                raise RunFileMalformed(f"{path}:{n}: {e}") from None
    return out


def _line_count(path: Path) -> int:
    with path.open() as f:
        return sum(1 for _ in f)
