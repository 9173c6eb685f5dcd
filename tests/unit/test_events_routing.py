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
