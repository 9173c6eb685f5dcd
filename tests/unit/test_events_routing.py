"""The routing table both runtimes read."""
from __future__ import annotations

from pathlib import Path

import pytest

from aivedio import events_routing
from aivedio.config import PlatformConfig

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_is_consistent_and_points_at_real_handlers():
    events_routing.check()
    for entry in (*events_routing.SUBSCRIPTIONS, *events_routing.SCHEDULES):
        assert (ROOT / entry.module.replace(".", "/")).with_suffix(".py").is_file(), entry


def test_consumers_group_event_types_by_function():
    assert events_routing.consumers()["queue_indexer"] == ("TaskQueued",)


def test_schedules_have_local_intervals_from_the_config():
    config = PlatformConfig()
    intervals = {s.name: s.local_interval(config) for s in events_routing.SCHEDULES}
    assert intervals["outbox-relay"] == config.timers.outbox_relay_seconds
    assert intervals["scheduler-tick"] == config.timers.scheduler_tick_seconds


def test_an_event_type_may_not_have_two_consumers(monkeypatch):
    monkeypatch.setattr(events_routing, "SUBSCRIPTIONS", (events_routing.Subscription("X", "a"),
                                                          events_routing.Subscription("X", "b")))
    with pytest.raises(ValueError, match="two consumers"):
        events_routing.check()


def test_the_relay_and_the_tick_are_continuous_and_terminal_events_wake_the_tick():
    assert {s.name for s in events_routing.SCHEDULES if s.continuous} == {events_routing.RELAY, events_routing.TICK}
    assert events_routing.schedule(events_routing.TICK).function == "scheduler_tick"
    assert events_routing.woken_by(["TaskSucceeded", "TaskFailed", "TaskCancelled"]) == [events_routing.TICK]
    assert events_routing.woken_by(["TaskQueued", "TaskDispatchRequested"]) == []


def test_a_wake_must_name_a_schedule_and_a_continuous_schedule_runs_every_minute(monkeypatch):
    monkeypatch.setattr(events_routing, "WAKES", (events_routing.Wake("TaskSucceeded", "no-such-loop"),))
    with pytest.raises(ValueError, match="no such schedule"):
        events_routing.check()
    monkeypatch.undo()
    slow = events_routing.Schedule("slow", "outbox_relay", lambda c: 1.0, 5, continuous=True)
    monkeypatch.setattr(events_routing, "SCHEDULES", (*events_routing.SCHEDULES, slow))
    with pytest.raises(ValueError, match="every minute"):
        events_routing.check()
