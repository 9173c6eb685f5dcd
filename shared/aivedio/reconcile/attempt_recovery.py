"""Room service `attempt-recovery`: the attempt lease scanner (aivedio.attempts.recovery, ch.
18.16.6). A live attempt whose lease expired lost its execution; the scanner takes the lease over by
CAS and starts a new execution, which resumes from PostgreSQL (a maybe-sent submit is looked up by
its key, never resent)."""
from __future__ import annotations

from aivedio.attempts.recovery import restart_expired
from aivedio.reconcile.room import Defaults, Report, in_batches, tuning

NAME = "attempt-recovery"
DEFAULTS = Defaults(interval_seconds=15.0, batch_size=200, max_batches=10)


def run_once(platform) -> Report:
    t = tuning(platform, NAME)

    def batch(limit: int) -> tuple[int, int]:
        n = restart_expired(platform, limit=limit)
        return n, n

    return in_batches(Report(NAME), t, batch)
