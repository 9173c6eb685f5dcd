"""Polling for a condition in tests, with a deadline."""
from __future__ import annotations

import time


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    """The predicate's first truthy value; AssertionError when none comes within timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")
