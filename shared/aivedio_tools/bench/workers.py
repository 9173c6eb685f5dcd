"""What every benchmark does with its worker processes once the measurement is over."""
from __future__ import annotations

import os
import queue
import time
from contextlib import contextmanager


@contextmanager
def quiet_children():
    """Worker processes started inside this block write their stderr to /dev/null: they log a line
    per admission, as the API does, and a terminal flooded with them would be measured too. A worker
    that fails reports its error to the parent over its queue, as every benchmark's workers do."""
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def join_or_kill(procs, timeout: float = 30) -> None:
    """Wait for each worker to finish; kill one that does not within `timeout` seconds."""
    for proc in procs:
        proc.join(timeout=timeout)
        if proc.is_alive():
            proc.kill()


def raise_first_error(results: list[dict], what: str) -> None:
    """A worker that failed reports {"error": ...}: the benchmark fails with the first one."""
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"{what} failed: {errors[0]}")


def get_or_fail(q, procs, timeout: float, what: str):
    """q.get, but fail at once when a worker died instead of waiting out the timeout."""
    end = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            dead = [pr.exitcode for pr in procs if pr.exitcode not in (None, 0)]
            if dead or time.monotonic() > end:
                raise RuntimeError(f"{what} failed or timed out (exit codes {dead})") from None
