"""`aivedio demo`: the README's main job, as a user runs it: a fresh database, the whole platform,
a mixed workload through the HTTP API, and a report whose every task finished."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import create_test_database, drop_test_database, _test_redis_url

SCRIPT = Path(sys.executable).with_name("aivedio")
AIVEDIO = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "aivedio.cli"]


@pytest.mark.slow
def test_demo_runs_every_task_to_a_terminal_state(tmp_path, redis_prefix):
    url = create_test_database("demo")
    try:
        env = {**os.environ, "AIVEDIO_DATABASE_URL": url, "AIVEDIO_REDIS_URL": _test_redis_url(),
               "AIVEDIO_REDIS_PREFIX": redis_prefix, "AIVEDIO_HOME": str(tmp_path)}
        r = subprocess.run([*AIVEDIO, "demo", "--tasks", "15", "--time-scale", "60", "--timeout", "120", "--json"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        doc = json.loads(r.stdout)
        assert doc["all_finished"] and doc["finished"] == doc["admitted"] > 0
        assert doc["reservations_leaked_on_terminal_tasks"] == 0
        assert sum(doc["decisions"].values()) == 15
        assert "demo: platform up" in r.stderr
    finally:
        drop_test_database(url)
