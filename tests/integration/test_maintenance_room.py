"""The maintenance room (aivedio.reconcile.room): one list of every repair, each service's tuning
from its defaults and the config, the batch loop, the schedules and loops made from the list, and
the maintenance Lambda that runs a service by name."""
from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import pytest

from aivedio import events_routing
from aivedio.config import ConfigError, MaintenanceService, PlatformConfig, parse_config
from aivedio_tools.local import runtime
from aivedio.reconcile import room
from aivedio.reconcile.room import Defaults, Report, Tuning, in_batches


def test_every_service_is_a_module_with_its_defaults_and_run_once():
    names = [s.name for s in room.SERVICES]
    assert len(names) == len(set(names))
    for s in room.SERVICES:
        mod = s.load()
        assert mod.NAME == s.name, s.module
        assert isinstance(mod.DEFAULTS, Defaults) and mod.DEFAULTS.interval_seconds > 0, s.name
        assert callable(mod.run_once), s.name
        assert s.repairs and s.never, f"{s.name}: the operations table needs what it repairs and what it never does"


def test_each_service_has_one_schedule_and_one_local_loop():
    by_name = {s.name: s for s in events_routing.SCHEDULES}
    for s in room.SERVICES:
        sched = by_name[s.name]
        assert sched.function == s.function
        assert sched.aws_every_minutes == s.defaults.aws_every_minutes >= 1
        assert sched.payload == ({"service": s.name} if s.function == room.MAINTENANCE_FUNCTION else None)
    loops = {loop.name for loop in runtime.default_loops(type("P", (), {"config": PlatformConfig()})())}
    assert {s.name for s in room.SERVICES} <= loops


def test_tuning_applies_the_config_and_scales_with_time():
    name = room.SERVICES[0].name
    cfg = PlatformConfig(time_scale=10.0, maintenance={name: MaintenanceService(batch_size=3, age_seconds=600)})
    p = type("P", (), {"config": cfg, "clock": type("C", (), {"time_scale": 10.0})()})()
    t = room.tuning(p, name)
    assert t.batch_size == 3 and t.age_seconds == 600
    assert t.max_batches == room.service(name).defaults.max_batches  # not overridden: the default
    assert t.age == timedelta(seconds=60)  # ten times faster


def test_an_unknown_service_in_the_config_is_an_error_not_a_no_op():
    with pytest.raises(ConfigError, match="no maintenance service 'expired-reservatons'"):
        parse_config({"maintenance": {"expired-reservatons": {"batch_size": 5}}})
    with pytest.raises(ConfigError, match="batch_size"):
        parse_config({"maintenance": {room.SERVICES[0].name: {"batch_size": 0}}})


def test_in_batches_runs_until_a_short_batch_or_its_bound():
    rows = list(range(7))

    def batch(limit: int) -> tuple[int, int]:
        taken = rows[:limit]
        del rows[:limit]
        return len(taken), len(taken)

    t = Tuning(Defaults(interval_seconds=1, batch_size=3, max_batches=10), 1.0)
    r = in_batches(Report("x"), t, batch)
    assert (r.examined, r.repaired, r.batches, r.complete) == (7, 7, 3, True)  # 3 + 3 + 1: the short one ends it
    rows.extend(range(9))
    r = in_batches(Report("x"), Tuning(Defaults(interval_seconds=1, batch_size=3, max_batches=2), 1.0), batch)
    assert (r.examined, r.batches, r.complete) == (6, 2, False)  # bounded: the next run carries on
    assert len(rows) == 3


def test_the_maintenance_lambda_runs_the_service_its_schedule_names(platform):
    from aivedio.errors import InvalidRequest
    from aivedio_tools.local.lambda_context import FakeLambdaContext
    from functions.maintenance.handler import lambda_handler

    ctx = FakeLambdaContext("aivedio-maintenance")
    mine = [s for s in room.SERVICES if s.function == room.MAINTENANCE_FUNCTION]
    for s in mine:
        out = lambda_handler(dict(s.payload), ctx)
        assert out["service"] == s.name and out["complete"] in (True, False)
    with pytest.raises(KeyError, match="no maintenance service"):
        lambda_handler({"service": "nope"}, ctx)
    with pytest.raises(InvalidRequest):
        lambda_handler({}, ctx)
    legacy = next(s for s in room.SERVICES if s.function != room.MAINTENANCE_FUNCTION)
    with pytest.raises(InvalidRequest, match="its own function"):
        lambda_handler({"service": legacy.name}, ctx)


def test_reconcile_list_and_run_as_a_user_types_them(db_url, redis_url, redis_prefix):
    env = {"AIVEDIO_DATABASE_URL": db_url, "AIVEDIO_REDIS_URL": redis_url, "AIVEDIO_REDIS_PREFIX": redis_prefix,
           "PATH": "/usr/bin:/bin"}
    cli = [sys.executable, "-m", "aivedio_tools.cli"]

    def aivedio(*args: str) -> tuple[int, dict]:
        done = subprocess.run([*cli, *args], env=env, capture_output=True, text=True, timeout=120)
        return done.returncode, json.loads(done.stdout)

    rc, listed = aivedio("reconcile", "list", "--json")
    assert rc == 0 and [d["service"] for d in listed["services"]] == [s.name for s in room.SERVICES]
    name = room.SERVICES[0].name
    rc, report = aivedio("reconcile", "run", name, "--operator", "ops-room", "--json")
    assert rc == 0 and report["service"] == name and report["complete"] is True
    import psycopg

    with psycopg.connect(db_url) as c:
        audited = c.execute("select operator, target from audit_log where action = 'maintenance.run'").fetchall()
    assert ("ops-room", f"service:{name}") in audited
