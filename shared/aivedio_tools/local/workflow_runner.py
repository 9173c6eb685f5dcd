"""The local stand-in for Step Functions: it executes the project's ASL documents (the attempt
workflow of aivedio.attempts.workflow) with the same semantics the state machine has in AWS, for
the subset the project uses: Task (Parameters with ".$" paths, ResultPath, Retry, Catch), Choice
(StringEquals), Wait (Seconds, SecondsPath), Pass, Succeed and Fail, with JSONPath of the form
"$" or "$.a.b".

Executions are cheap: a Wait does not hold a thread. Due executions sit in a heap and a few worker
threads run them state by state until the next Wait or the end. A Task's Resource names a callable
(the substitution of ${AttemptStepFunctionArn} is "local:attempt_step", which calls the
attempt_step Lambda handler). Nothing is persisted here: an execution lost with the process is
restarted by the lease scanner from what PostgreSQL records, as in AWS after a failed execution.
Waits are in platform seconds; the clock turns them into real seconds (time_scale)."""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aivedio.attempts.executions import ExecutionAlreadyExists  # noqa: F401 - raised here, caught where executions start

log = logging.getLogger(__name__)

Resource = Callable[[dict[str, Any]], Any]
FINISHED_NAMES_KEPT = 100_000  # names of closed executions, refused again as Step Functions does



class StatesError(Exception):
    """An error in the States language: its name (e.g. States.TaskFailed) and cause."""

    def __init__(self, error: str, cause: str = ""):
        super().__init__(f"{error}: {cause}")
        self.error, self.cause = error, cause


def read_path(doc: Any, path: str) -> Any:
    if path == "$":
        return doc
    if not path.startswith("$."):
        raise StatesError("States.Runtime", f"unsupported path {path!r}")
    cur = doc
    for part in path[2:].split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise StatesError("States.Runtime", f"path {path!r} not found in the input")
        cur = cur[part]
    return cur


def write_path(doc: Any, path: str | None, value: Any) -> Any:
    """ResultPath: "$" replaces the document, "$.a.b" sets a field, None discards the result."""
    if path is None:
        return doc
    if path == "$":
        return value
    out = dict(doc) if isinstance(doc, dict) else {}
    parts = path[2:].split(".")
    cur = out
    for part in parts[:-1]:
        nxt = dict(cur.get(part) or {})
        cur[part] = nxt
        cur = nxt
    cur[parts[-1]] = value
    return out


def parameters(template: Any, doc: Any) -> Any:
    if isinstance(template, dict):
        out = {}
        for k, v in template.items():
            if k.endswith(".$"):
                out[k[:-2]] = read_path(doc, v)
            else:
                out[k] = parameters(v, doc)
        return out
    if isinstance(template, list):
        return [parameters(v, doc) for v in template]
    return template


def _matches(errors: list[str], error: str) -> bool:
    return "States.ALL" in errors or error in errors


@dataclass
class Execution:
    name: str
    definition: dict[str, Any]
    state: str
    doc: Any
    retries: dict[tuple[str, int], int] = field(default_factory=dict)
    status: str = "RUNNING"  # RUNNING | SUCCEEDED | FAILED
    output: Any = None
    error: str | None = None
    steps: int = 0


class WorkflowRunner:
    """runner = WorkflowRunner(clock, {"local:attempt_step": fn}); runner.start(); runner.start_execution(...)."""

    def __init__(self, clock, resources: dict[str, Resource], *, workers: int = 8, max_steps: int = 100_000):
        self.clock, self.resources = clock, resources
        self.workers, self.max_steps = workers, max_steps
        self._heap: list[tuple[float, int, Execution]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._running: dict[str, Execution] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()
        self._threads: list[threading.Thread] = []
        self._stop = False
        self._busy = 0

    # -- lifecycle --

    def start(self) -> "WorkflowRunner":
        self._stop = False
        self._threads = [threading.Thread(target=self._work, name=f"workflow-{i}", daemon=True) for i in range(self.workers)]
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout)
        self._threads = []

    # -- API --

    def start_execution(self, name: str, definition: dict[str, Any], execution_input: Any) -> Execution:
        """Start an execution. A name already running is idempotent; a closed one is refused, as
        Step Functions refuses to reuse an execution name."""
        with self._cv:
            if name in self._running:
                return self._running[name]
            if name in self._finished:
                raise ExecutionAlreadyExists(name)
            ex = Execution(name, definition, definition["StartAt"], execution_input)
            self._running[name] = ex
            self._push(ex, self.clock.monotonic())
            return ex

    def running(self) -> int:
        with self._cv:
            return len(self._running)

    def idle(self) -> bool:
        with self._cv:
            return not self._running and self._busy == 0

    def run_until_idle(self, timeout: float) -> bool:
        """For tests: wait until no execution is running."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.idle():
                return True
            time.sleep(0.02)
        return self.idle()

    # -- machinery --

    def _push(self, ex: Execution, due: float) -> None:
        heapq.heappush(self._heap, (due, next(self._seq), ex))
        self._cv.notify()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._stop:
                    now = self.clock.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        break
                    timeout = (self._heap[0][0] - now) if self._heap else 1.0
                    self._cv.wait(min(max(timeout, 0.001), 1.0))
                if self._stop:
                    return
                _, _, ex = heapq.heappop(self._heap)
                self._busy += 1
            try:
                delay = self._advance(ex)
            except Exception as e:  # a bug in the runner itself: the execution fails, the lease scanner recovers
                log.exception("workflow %s crashed in state %s", ex.name, ex.state)
                ex.status, ex.error, delay = "FAILED", f"Runner: {e!r}", None
            with self._cv:
                self._busy -= 1
                if ex.status == "RUNNING":
                    self._push(ex, self.clock.monotonic() + (delay or 0.0))
                else:
                    self._running.pop(ex.name, None)
                    self._finished[ex.name] = ex.status
                    while len(self._finished) > FINISHED_NAMES_KEPT:
                        self._finished.popitem(last=False)

    def _advance(self, ex: Execution) -> float | None:
        """Run states until a Wait (returns its real seconds) or the end (returns None)."""
        while ex.status == "RUNNING":
            ex.steps += 1
            if ex.steps > self.max_steps:
                ex.status, ex.error = "FAILED", "States.Runtime: too many steps"
                return None
            spec = ex.definition["States"][ex.state]
            kind = spec["Type"]
            if kind == "Task":
                self._task(ex, spec)
            elif kind == "Choice":
                ex.state = self._choose(spec, ex.doc)
            elif kind == "Wait":
                seconds = spec["Seconds"] if "Seconds" in spec else read_path(ex.doc, spec["SecondsPath"])
                ex.state = spec["Next"]
                return self.clock.real_seconds(float(seconds))
            elif kind == "Pass":
                if "Result" in spec:
                    ex.doc = write_path(ex.doc, spec.get("ResultPath", "$"), spec["Result"])
                self._next(ex, spec)
            elif kind == "Succeed":
                ex.status, ex.output = "SUCCEEDED", ex.doc
            elif kind == "Fail":
                ex.status, ex.error = "FAILED", f"{spec.get('Error')}: {spec.get('Cause')}"
                log.warning("workflow %s failed: %s", ex.name, ex.error)
            else:
                raise StatesError("States.Runtime", f"state type {kind} is not supported locally")
        return None

    def _next(self, ex: Execution, spec: dict) -> None:
        if spec.get("End"):
            ex.status, ex.output = "SUCCEEDED", ex.doc
        else:
            ex.state = spec["Next"]

    def _choose(self, spec: dict, doc: Any) -> str:
        for rule in spec["Choices"]:
            try:
                value = read_path(doc, rule["Variable"])
            except StatesError:
                continue
            if "StringEquals" in rule and value == rule["StringEquals"]:
                return rule["Next"]
        if "Default" not in spec:
            raise StatesError("States.NoChoiceMatched", str(spec.get("Comment")))
        return spec["Default"]

    def _task(self, ex: Execution, spec: dict) -> None:
        state = ex.state
        try:
            fn = self.resources[spec["Resource"]]
            payload = parameters(spec.get("Parameters", {}), ex.doc) if "Parameters" in spec else ex.doc
            result = fn(payload)
        except Exception as e:
            error = e.error if isinstance(e, StatesError) else "States.TaskFailed"
            for i, rule in enumerate(spec.get("Retry", [])):
                if _matches(rule["ErrorEquals"], error):
                    n = ex.retries.get((state, i), 0)
                    if n < rule.get("MaxAttempts", 3):
                        ex.retries[(state, i)] = n + 1
                        delay = rule.get("IntervalSeconds", 1) * rule.get("BackoffRate", 2.0) ** n
                        log.warning("workflow %s: %s failed (%r); retry %d in %.1fs", ex.name, state, e, n + 1, delay)
                        time.sleep(min(self.clock.real_seconds(delay), 30.0))
                        return  # the same state runs again
                    break
            for rule in spec.get("Catch", []):
                if _matches(rule["ErrorEquals"], error):
                    log.warning("workflow %s: %s failed (%r); caught", ex.name, state, e)
                    ex.doc = write_path(ex.doc, rule.get("ResultPath", "$"), {"Error": error, "Cause": repr(e)})
                    ex.state = rule["Next"]
                    return
            ex.status, ex.error = "FAILED", f"{error}: {e!r}"
            return
        ex.retries = {k: v for k, v in ex.retries.items() if k[0] != state}
        ex.doc = write_path(ex.doc, spec.get("ResultPath", "$"), result)
        self._next(ex, spec)
