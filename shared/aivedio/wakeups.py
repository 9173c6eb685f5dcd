"""Wake-ups between the platform's loops, and the runs of the continuous ones.

"Loop NAME has work now" is said with Platform.wake(NAME), the same call in both runtimes:

- locally each loop of aivedio_tools.local.runtime waits on a threading.Event between runs, and wake()
  sets it, so the loop runs now instead of at its interval;
- in AWS the continuous schedules of aivedio.events_routing (the outbox relay and the scheduler
  tick) are Lambda runs that keep polling until near their timeout. Between idle polls a run
  blocks on a Redis list of its loop (BLPOP), and wake() pushes one element onto it (coalesced: the
  list holds at most one, and expires), so the run polls again at once.

A wake is a hint, never the only way work is found: when it is lost (Redis down, conservative mode,
a function without Redis such as attempt_step) the loop still polls at its interval, which is the
bound the README states. Who wakes whom: a writer of outbox events wakes the relay once its
transaction committed (aivedio.outbox.waking_relay), the relay wakes the loops of the event types
it relayed (events_routing.WAKES: a terminal task released capacity, so the tick runs), the queue
indexer wakes the tick once the tenant is on its ring, and the tick wakes the relay after claims
(their TaskDispatchRequested)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from aivedio import events_routing
from aivedio.cache.client import CacheUnavailable
from aivedio.observability import due, logger

if TYPE_CHECKING:
    from aivedio.cache.client import Cache
    from aivedio.context import Platform

KEY = "wake"  # Redis: {prefix}:wake:{loop name}, a list of at most one element
TTL_SECONDS = 60  # a wake nobody waited for is forgotten (the next poll finds the work anyway)
SOCKET_SLACK_SECONDS = 1.0  # the waiting connection's socket timeout exceeds the BLPOP timeout by this
WARN_EVERY_SECONDS = 60.0  # a Redis outage is logged once a minute per process, not at every poll


def push(cache: Cache, name: str) -> None:
    """Wake whoever waits on loop `name` (best effort: a failure is logged, never raised)."""
    key = cache.key(KEY, name)

    def send() -> None:
        pipe = cache.r.pipeline(transaction=False)
        pipe.rpush(key, 1)
        pipe.ltrim(key, 0, 0)
        pipe.expire(key, TTL_SECONDS)
        pipe.execute()

    try:
        cache.run(send)
    except CacheUnavailable as e:
        if due("wake-push-failed", WARN_EVERY_SECONDS):
            logger.warning("wake-up not sent; the loop finds the work at its next poll", extra={"loop": name, "error": str(e)})


def _blocking_client(platform: Platform, seconds: float):
    """A connection of its own for BLPOP, whose socket timeout outlasts the block (the cache's
    0.5 s would report every longer wait as an error); made again for a longer wait."""
    need = seconds + SOCKET_SLACK_SECONDS
    held = platform.extras.get("wake_redis")
    if held is None or held[0] < need:
        if held is not None:
            held[1].close()
        held = (need, platform.cache.blocking_client(need))  # a cluster client on a cluster
        platform.extras["wake_redis"] = held
    return held[1]


def wait(platform: Platform, name: str, seconds: float) -> bool:
    """Block until loop `name` is woken or `seconds` pass; True when woken. Without Redis, or
    when Redis fails, it sleeps the whole interval."""
    if seconds <= 0:
        return False
    if platform.cache is not None:
        t0 = time.monotonic()
        try:
            return _blocking_client(platform, seconds).blpop([platform.cache.key(KEY, name)], timeout=seconds) is not None
        except Exception as e:  # noqa: BLE001 - any failure: fall back to the interval
            if due("wake-wait-failed", WARN_EVERY_SECONDS):
                logger.warning("wake-up wait failed; sleeping the interval", extra={"loop": name, "error": repr(e)})
            held = platform.extras.pop("wake_redis", None)
            if held is not None:
                held[1].close()
            if (left := seconds - (time.monotonic() - t0)) > 0:
                time.sleep(left)
            return False
    time.sleep(seconds)
    return False


class ContinuousRun:
    """One Lambda run of a continuous schedule: its handler makes passes until RESERVE before the
    timeout, and after an idle pass waits for a wake-up or its loop's interval (the same interval
    the local loop has, from events_routing). Locally a run is one pass: the loop thread does the
    waiting, on its Event, at that interval; the handler code is the same.

        run = ContinuousRun(platform, "outbox-relay", context, reserve_millis=5000)
        while True:
            more = one_pass()            # e.g. a full batch: more is due now
            if more and run.seconds_left() > 0:
                continue
            if not run.idle():           # locally always False; in Lambda False near the timeout
                break
    """

    def __init__(self, platform: Platform, name: str, context, *, reserve_millis: int):
        self.platform, self.name, self.context, self.reserve_millis = platform, name, context, reserve_millis
        self.local = bool(platform.extras.get("local_runtime"))
        self.interval = platform.clock.real_seconds(events_routing.schedule(name).local_interval(platform.config))

    def seconds_left(self) -> float:
        """Real seconds until the reserve before the timeout."""
        return (self.context.get_remaining_time_in_millis() - self.reserve_millis) / 1000.0

    def pause(self, seconds: float) -> bool:
        """Wait up to `seconds` within the run, ending early when woken; in both runtimes (locally
        on the loop's own Event, which the loop would otherwise wait on after the run)."""
        seconds = min(seconds, max(0.0, self.seconds_left()))
        event = self.platform.extras.get("wake", {}).get(self.name) if self.local else None
        if event is not None:
            woken = event.wait(seconds)
            event.clear()
            return woken
        if self.local:
            time.sleep(seconds)
            return False
        return wait(self.platform, self.name, seconds)

    def idle(self) -> bool:
        """After a pass that found nothing more to do: False ends the run (always locally, and near
        the timeout in Lambda); else True once woken or after the interval."""
        if self.local:
            return False
        left = self.seconds_left()
        if left <= 0:
            return False
        wait(self.platform, self.name, min(self.interval, left))
        return self.seconds_left() > 0
