"""The continuous schedules as they run in AWS (aivedio.events_routing, aivedio.wakeups): the outbox
relay and the scheduler tick keep polling until near their Lambda timeout, at their loop's interval
while idle and at once when woken through Redis; the relay wakes the tick when a terminal event is
out, the tick wakes the relay after claims, and a handler that wrote events wakes the relay. Locally
(LocalRuntime) the same handlers make one pass a run. Real PostgreSQL and Redis; the scheduler
itself is replaced by a recorder where only the tick handler's loop is under test."""
from __future__ import annotations

import threading
import time
import uuid

import pytest

from aivedio import events_routing, outbox, wakeups
from aivedio.config import PlatformConfig, Timers
from aivedio.context import set_platform
from aivedio.events_routing import RELAY, TICK
from aivedio_tools.local.lambda_context import FakeLambdaContext
from aivedio.scheduling.scheduler import TickReport

pytestmark = pytest.mark.redis_cluster  # each test also runs on a 3-node Redis cluster

IDLE = 5.0  # idle poll interval of these tests' loops: far longer than any wait a wake-up ends


@pytest.fixture
def aws_platform(make_platform, conn):
    """A platform as a deployed function has it: no local runtime, Redis for wake-ups, long idle polls."""
    conn.execute("delete from outbox_event")
    p = make_platform(PlatformConfig(timers=Timers(outbox_relay_seconds=IDLE, scheduler_tick_seconds=IDLE)))
    delivered: list[tuple[float, dict]] = []
    p.extras["outbox_deliver"] = lambda envelope: delivered.append((time.monotonic(), envelope))
    p.extras["delivered"] = delivered
    set_platform(p)
    yield p
    set_platform(None)


def context(reserve_millis: int, seconds: float) -> FakeLambdaContext:
    """A Lambda context whose run (until the reserve) lasts `seconds`."""
    return FakeLambdaContext("aivedio-test", timeout_seconds=reserve_millis / 1000 + seconds)


def write(platform, event_type: str) -> uuid.UUID:
    with platform.db.connection() as c, c.transaction():
        return outbox.write_event(c, event_type, aggregate_type="test", aggregate_id=uuid.uuid4(), tenant_id=None,
                                  payload={"k": 1})


def later(seconds: float, fn) -> threading.Thread:
    t = threading.Timer(seconds, fn)
    t.start()
    return t


# --- wake-ups through Redis ----------------------------------------------------------------------

def test_a_wake_ends_the_wait_at_once_and_wakes_are_coalesced(aws_platform):
    p = aws_platform
    later(0.2, lambda: p.wake(RELAY))
    t0 = time.monotonic()
    assert wakeups.wait(p, RELAY, IDLE) is True
    assert time.monotonic() - t0 < 2.0
    for _ in range(3):
        p.wake(TICK)
    assert wakeups.wait(p, TICK, 0.1) is True
    t0 = time.monotonic()
    assert wakeups.wait(p, TICK, 0.3) is False, "three wakes leave one"
    assert time.monotonic() - t0 >= 0.25


def test_without_redis_a_wake_is_lost_and_the_wait_is_the_interval(make_platform):
    p = make_platform(redis=False)
    p.wake(RELAY)
    t0 = time.monotonic()
    assert wakeups.wait(p, RELAY, 0.3) is False
    assert time.monotonic() - t0 >= 0.25


# --- the relay -------------------------------------------------------------------------------------

def test_the_relay_polls_until_near_its_timeout_and_relays_at_once_when_woken(aws_platform):
    from functions.outbox_relay import handler as relay

    p = aws_platform
    woken_at: list[float] = []

    def commit_and_wake():
        write(p, "test.latency")
        woken_at.append(time.monotonic())
        p.wake(RELAY)  # what outbox.waking_relay() does once the writer's handler is done

    t0 = time.monotonic()
    later(0.5, commit_and_wake)
    assert relay.lambda_handler({}, context(relay.RESERVE_MILLIS, 2.5)) == {"published": 1}
    took = time.monotonic() - t0
    [(at, envelope)] = p.extras["delivered"]
    assert envelope["event_type"] == "test.latency"
    assert at - woken_at[0] < 1.0, "relayed on the wake, not at the idle poll"
    assert 2.0 < took < IDLE, "the run polls until its reserve, no longer"


def test_after_a_batch_the_relay_picks_up_what_follows_without_a_wake(aws_platform):
    """A TaskQueued is followed by its claim's TaskDispatchRequested, written by a process that may
    not wake the relay: after a pass that published, the relay polls every RELAY_HOT_POLL_SECONDS."""
    from functions.outbox_relay import handler as relay

    p = aws_platform
    write(p, "test.first")
    written_at: list[float] = []
    later(0.2, lambda: (write(p, "test.second"), written_at.append(time.monotonic())))
    assert relay.lambda_handler({}, context(relay.RESERVE_MILLIS, 1.0)) == {"published": 2}
    (_, first), (at, second) = p.extras["delivered"]
    assert (first["event_type"], second["event_type"]) == ("test.first", "test.second")
    assert at - written_at[0] < 0.5


def test_the_relay_wakes_the_tick_once_a_terminal_event_is_out(aws_platform):
    from functions.outbox_relay import handler as relay

    p = aws_platform
    write(p, "TaskQueued")  # its consumer, the queue indexer, wakes the tick, not the relay
    relay.lambda_handler({}, context(relay.RESERVE_MILLIS, 0.1))
    assert wakeups.wait(p, TICK, 0.05) is False
    write(p, "TaskSucceeded")
    relay.lambda_handler({}, context(relay.RESERVE_MILLIS, 0.1))
    assert wakeups.wait(p, TICK, 0.05) is True
    assert events_routing.woken_by(["TaskFailed", "TaskCancelled", "TaskQueued"]) == [TICK]


def test_a_handler_that_wrote_events_wakes_the_relay(platform):
    relay_woken = threading.Event()
    platform.extras["wake"] = {RELAY: relay_woken}  # the local loop's Event, as LocalRuntime sets it
    try:
        with outbox.waking_relay():
            pass
        assert not relay_woken.is_set()
        with outbox.waking_relay():
            write(platform, "test.written")
        assert relay_woken.is_set()
    finally:
        platform.extras.pop("wake")


# --- the tick --------------------------------------------------------------------------------------

class RecordingScheduler:
    """Stands in for the scheduler: records when each tick ran; claims what `claims` pops."""

    def __init__(self, claims: list[int]):
        self.claims, self.ticks = claims, []

    def __call__(self, platform):
        return self

    def tick(self, budget: float) -> TickReport:
        self.ticks.append(time.monotonic())
        return TickReport(claims=self.claims.pop(0) if self.claims else 0)


def test_the_tick_polls_until_near_its_timeout_and_ticks_at_once_when_woken(aws_platform, monkeypatch):
    from functions.scheduler_tick import handler as tick

    p = aws_platform
    sched = RecordingScheduler([])
    monkeypatch.setattr(tick, "Scheduler", sched)
    woken_at: list[float] = []
    later(0.5, lambda: (woken_at.append(time.monotonic()), p.wake(TICK)))
    t0 = time.monotonic()
    assert tick.lambda_handler({}, context(tick.RESERVE_MILLIS, 2.0))["claims"] == 0
    assert 1.5 < time.monotonic() - t0 < IDLE
    assert len(sched.ticks) == 2, "one at the start, one on the wake; the idle poll is 5 s"
    assert sched.ticks[1] - woken_at[0] < 1.0


def test_a_tick_that_claimed_wakes_the_relay_and_ticks_again(aws_platform, monkeypatch):
    from functions.scheduler_tick import handler as tick

    p = aws_platform
    sched = RecordingScheduler([3, 0])
    monkeypatch.setattr(tick, "Scheduler", sched)
    assert tick.lambda_handler({}, context(tick.RESERVE_MILLIS, 0.5))["claims"] == 3
    assert len(sched.ticks) == 2 and sched.ticks[1] - sched.ticks[0] < 0.3
    assert wakeups.wait(p, RELAY, 0.05) is True, "the claims' TaskDispatchRequested go out now"


def test_locally_the_handlers_make_one_pass_a_run(aws_platform, monkeypatch):
    from functions.outbox_relay import handler as relay
    from functions.scheduler_tick import handler as tick

    p = aws_platform
    p.extras["local_runtime"] = True
    sched = RecordingScheduler([2])
    monkeypatch.setattr(tick, "Scheduler", sched)
    t0 = time.monotonic()
    assert tick.lambda_handler({}, context(tick.RESERVE_MILLIS, 60))["claims"] == 2
    assert relay.lambda_handler({}, context(relay.RESERVE_MILLIS, 60)) == {"published": 0}
    assert len(sched.ticks) == 1 and time.monotonic() - t0 < 2.0


def test_a_process_wakes_the_relay_at_most_once_per_hot_poll(platform, monkeypatch):
    """Writers right after one that woke the relay do not wake it again: it polls every
    RELAY_HOT_POLL_SECONDS after a pass that published, so their events go out as soon. (The poll
    is lengthened here, so a slow machine's burst still falls within one; time passing is the wake's
    clock moved back.)"""
    monkeypatch.setattr(outbox, "RELAY_HOT_POLL_SECONDS", 60.0)
    woken: list[float] = []

    class Counting:
        def set(self) -> None:
            woken.append(time.monotonic())

    platform.extras["wake"] = {RELAY: Counting()}
    platform.extras.pop("relay_woken_at", None)
    try:
        for i in range(5):
            with outbox.waking_relay():
                write(platform, f"test.burst.{i}")
        assert len(woken) == 1
        platform.extras["relay_woken_at"] -= outbox.RELAY_HOT_POLL_SECONDS  # a hot poll's time has passed
        with outbox.waking_relay():
            write(platform, "test.after")
        assert len(woken) == 2
    finally:
        platform.extras.pop("wake")
