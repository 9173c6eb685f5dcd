"""The chaos suite (issue 18) as CI runs it: `aivedio chaos` over the real stack as OS processes.

- The plan: the same seed gives the same plan; seeds differ in their fault intensities; no plan
  takes the last process of a role down.
- The sweep (aivedio_tools.chaos.sweep.ci_seeds): the seeds that ever failed, the fixed seeds and a seed
  derived from the commit, each a short run whose every checker must stay silent.
- The switches (aivedio_tools.chaos.sweep.ci_switches, a rotating subset chosen by the commit): the
  switch's targeted seed with the switch makes its checker fire; the same seed without it fires
  none. `CHAOS_SWITCHES=all` (or a comma list) runs others.
- `aivedio chaos check DIR`, typed as a user types it, gives the run's verdict again offline.

The runs are serial in one xdist group with the attempt invariants (LOAD_GROUP)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aivedio_tools.chaos import plan as plans
from aivedio_tools.chaos import sweep
from aivedio.faults.safeguards import SAFEGUARDS
from tests.conftest import admin_url

RUN_SECONDS = 12.0
# The runs load both cores with seven processes: they share the xdist group of the attempt
# invariants, whose timings (leases against waits) must not run beside them.
LOAD_GROUP = "attempt-invariants"
AIVEDIO = str(Path(sys.executable).parent / "aivedio")  # the console script, as a user types it
COMMIT = sweep.commit_id()

def _switches() -> list[str]:
    raw = os.environ.get("CHAOS_SWITCHES", "")
    if raw == "all":
        return sorted(SAFEGUARDS)
    return [s for s in raw.split(",") if s] or sweep.ci_switches(COMMIT)


def _run(tmp_path: Path, seed: int, **kw) -> dict:
    from aivedio_tools.chaos import runner

    out = tmp_path / f"seed-{seed}-{kw.get('target') or 'none'}-{'-'.join(kw.get('breaks', ())) or 'intact'}"
    v = runner.run(seed, RUN_SECONDS, out, admin_url=admin_url(), echo=print, **kw)
    v["dir"] = out
    return v


def _fired(v: dict) -> dict[str, list]:
    return {name: found for name, found in v["violations"].items() if found}


# --- the plan ---------------------------------------------------------------------------------------

def test_the_same_seed_gives_the_same_plan():
    for seed in (1, 7, 12345):
        a, b = plans.make_plan(seed, 20), plans.make_plan(seed, 20)
        assert a == b and plans.digest(a) == plans.digest(b)
        assert plans.make_plan(seed, 20, breaks=("fencing",))["faults"] == plans.make_plan(seed, 20, target="fencing")["faults"]
    assert plans.digest(plans.make_plan(1, 20)) != plans.digest(plans.make_plan(2, 20))


def test_seeds_draw_their_own_intensities():
    drawn = [plans.make_plan(s, 20) for s in range(40)]
    no_redis = [p for p in drawn if p["intensity"]["redis"] == 0]
    kill_heavy = [p for p in drawn if p["intensity"]["kill"] == 1.0]
    assert no_redis and kill_heavy and len(no_redis) < 40
    assert len({json.dumps(p["intensity"], sort_keys=True) for p in drawn}) > 20
    assert any(p["failpoints"] for p in drawn) and any(not p["failpoints"] for p in drawn)


def test_no_plan_takes_the_last_process_of_a_role_down():
    for seed in range(200):
        p = plans.make_plan(seed, 30)
        down = [(e["target"], e["t"], e["t"] + e["seconds"]) for e in p["faults"] if e["kind"] in ("kill", "stop")]
        for name, a, _ in down:
            role = name.rsplit("-", 1)[0]
            at_a = {n for n, x, y in down if n.rsplit("-", 1)[0] == role and x <= a < y}
            assert len(at_a) < p["roles"][role], f"seed {seed}: every {role} process down at {a}s"


def test_every_safeguard_has_a_target_and_its_checker_exists():
    from aivedio_tools.chaos.checkers import CHECKERS

    assert set(plans.TARGETS) == set(SAFEGUARDS)
    for name, spec in plans.TARGETS.items():
        assert spec["checker"] in CHECKERS, f"{name}: no checker {spec['checker']}"


def test_a_bad_safeguard_name_is_refused_before_anything_starts(tmp_path):
    r = subprocess.run([AIVEDIO, "chaos", "--seed", "1", "--break", "no-such-thing"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_a_run_that_fails_while_it_is_set_up_leaks_no_database_and_no_server(tmp_path, monkeypatch):
    """The simulator refuses to start after the run's database and redis-server exist: both are undone."""
    import psycopg

    from aivedio_tools.chaos import runner
    from aivedio_tools.chaos.redis_server import RedisServer
    from aivedio_tools.provider_sim import SimulatorServer

    started: list[RedisServer] = []
    real_start = RedisServer.start

    def recorded_start(self):
        started.append(self)
        return real_start(self)

    def refused(self):
        raise RuntimeError("the simulator did not start")

    monkeypatch.setattr(RedisServer, "start", recorded_start)
    monkeypatch.setattr(SimulatorServer, "start", refused)
    seed = 424242
    with pytest.raises(RuntimeError, match="did not start"):
        runner.run(seed, 5.0, tmp_path / "run", admin_url=admin_url())
    with psycopg.connect(admin_url(), autocommit=True) as c:
        left = c.execute("select datname from pg_database where datname like %s", (f"aivedio_chaos_{seed}_%",)).fetchall()
    assert left == [], left
    assert len(started) == 1 and started[0].proc is None  # the redis-server it had started was stopped


# --- the sweep --------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", sweep.ci_seeds(COMMIT))
@pytest.mark.slow
@pytest.mark.xdist_group(LOAD_GROUP)
@pytest.mark.timeout(300)
def test_a_seed_keeps_every_promise(tmp_path, seed):
    v = _run(tmp_path, seed)
    run = v["run"]
    assert run["facts"]["tasks"] > 10, run  # the seed did real work
    assert not _fired(v), f"seed {seed} broke a promise (replay: aivedio chaos --seed {seed} --duration {RUN_SECONDS:g}):\n" \
                          + json.dumps(_fired(v), indent=1, default=str)[:6000]
    # Offline, as a user types it: the same verdict from the recorded files alone.
    r = subprocess.run([AIVEDIO, "chaos", "check", str(v["dir"]), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["ok"] is True


@pytest.mark.parametrize("switch", _switches())
@pytest.mark.slow
@pytest.mark.xdist_group(LOAD_GROUP)
@pytest.mark.timeout(600)
def test_a_broken_safeguard_is_caught_by_its_checker(tmp_path, switch):
    checker = plans.TARGETS[switch]["checker"]
    broken = _run(tmp_path, sweep.TARGET_SEED, breaks=(switch,))
    assert checker in _fired(broken), f"{switch} broken, but {checker} stayed silent; fired: {sorted(_fired(broken))}"
    intact = _run(tmp_path, sweep.TARGET_SEED, target=switch)
    assert not _fired(intact), f"{switch}'s targeted seed fired without the switch: " + json.dumps(_fired(intact), default=str)[:4000]


def test_the_testing_doc_lists_every_checker():
    from aivedio_tools.chaos.checkers import CHECKERS

    testing = (Path(__file__).resolve().parents[2] / "docs" / "testing.md").read_text()
    section = testing.split("## The chaos suite", 1)[1].split("\n## ", 1)[0]
    listed = [line.split("`")[1] for line in section.splitlines() if line.startswith("| `")]
    assert listed == list(CHECKERS)
