"""What the child processes of a reliability test report through a multiprocessing queue: tuples
whose first item names the kind ("ready", "error", ...). A child's error fails the test at once."""
from __future__ import annotations

import queue
import time
from collections.abc import Callable


class Events:
    def __init__(self, q):
        self.q, self.seen = q, []

    def pump(self, timeout: float) -> None:
        try:
            ev = self.q.get(timeout=timeout)
        except queue.Empty:
            return
        self.seen.append(ev)
        if ev[0] == "error":
            raise AssertionError(f"a child process failed: {ev[1]}")

    def of(self, kind: str) -> list:
        return [ev for ev in self.seen if ev[0] == kind]

    def wait_for(self, what: str | Callable[[tuple], bool], n: int, timeout: float) -> list:
        """Pump until n events match `what` (a kind, or a predicate on the event), or timeout."""
        pred = (lambda e: e[0] == what) if isinstance(what, str) else what
        end = time.monotonic() + timeout
        while len([e for e in self.seen if pred(e)]) < n and time.monotonic() < end:
            self.pump(0.2)
        return [e for e in self.seen if pred(e)]

    def drain(self) -> None:
        while True:
            try:
                self.seen.append(self.q.get(timeout=0.2))
            except queue.Empty:
                return
