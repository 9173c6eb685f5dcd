"""Tenant scheduling policies (issue 16, docs/operations.md): `aivedio admin tenant policy
show|set` and its core, aivedio.policy.tenant_policy.

- every service class's default policy (admin.tenants.POLICY_DEFAULTS) passes the validation;
- a change bumps policy_version and writes, with it, the history row, the audit row (old and new
  values of the changed columns, the reason, the new policy_version) and a snapshot of the whole
  policy set; a change of service_class moves the tenant row with it (admission reads it there);
- an invalid result (a negative weight, running above queued caps, user above tenant caps,
  reserved above the lane's capacity or the running cap, an unknown column or service class, a
  wrong type, no change at all) is InvalidRequest naming each bad field, and writes nothing;
- a task admitted before a change is scheduled under its version: its lane, band, routing tier and
  the policy_version its dispatch event carries are those it was admitted with;
- the CLI as typed: JSON in and out, one JSON error document and exit 1 for bad input."""
from __future__ import annotations

import getpass
import json
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import dict_row

from aivedio.policy import tenant_policy as policy
from aivedio.admin.tenants import POLICY_DEFAULTS, initial_burst_credit
from aivedio.admission.models import GenerationRequest
from aivedio.config import SERVICE_CLASSES, PlatformConfig, ProviderAccount, ProviderConfig
from aivedio.errors import InvalidRequest, NotFound
from aivedio.scheduling.resources import ensure_platform_pools
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import new_tenant
from tests.scheduler_support import BODY_1U, OPEN, UNCAPPED, submit

pytestmark = pytest.mark.timeout(180)
AIVEDIO = Path(sys.executable).parent / "aivedio"  # the console script, as a user types it


def _set(p, tenant_id, changes, *, operator="ops-test", reason="test"):
    return p.db.transaction(lambda c: policy.set_policy(c, operator=operator, tenant_id=tenant_id, changes=changes,
                                                        reason=reason, config=p.config, now=p.clock.now()))


def _footprint(conn, tenant_id) -> dict:
    """Everything a policy change writes, for one tenant and globally."""
    one = lambda sql, *a: conn.execute(sql, a).fetchone()  # noqa: E731
    row = one("select * from tenant_scheduling_policy where tenant_id = %s", tenant_id)
    return {
        "policy": {k: v for k, v in row.items()},
        "tenant_class": one("select service_class from tenant where tenant_id = %s", tenant_id)["service_class"],
        "history": one("select count(*) as n from tenant_policy_history where tenant_id = %s", tenant_id)["n"],
        "audit": one("select count(*) as n from audit_log where action = 'policy.set'")["n"],
        "snapshots": one("select count(*) as n from policy_set_snapshot")["n"],
    }


# --- the rules --------------------------------------------------------------------------------------

@pytest.mark.parametrize("service_class", SERVICE_CLASSES)
@pytest.mark.parametrize("weight", [1, 7, 1000])
def test_every_default_policy_passes_the_validation(service_class, weight):
    config = PlatformConfig()
    p = {"service_class": service_class, "weight": weight, **POLICY_DEFAULTS[service_class], "burst_rounds": 4,
         "initial_burst_credit": initial_burst_credit(config, weight)}
    assert set(p) == set(policy.NAMES)  # the table is every settable column create_tenant writes
    assert policy.validate(p, lanes=config.lanes) == {}


def test_the_column_table_is_the_policy_table_less_its_keys(conn):
    cols = [r["column_name"] for r in conn.execute(
        """select column_name from information_schema.columns where table_name = 'tenant_scheduling_policy'
            order by ordinal_position""").fetchall()]
    assert set(cols) - set(policy.READ_ONLY) == set(policy.NAMES)
    for c in policy.COLUMNS:  # one flag per column, spelled as the contract does
        assert c.flag == "--" + c.name.replace("_", "-")


# --- a change ----------------------------------------------------------------------------------------

def test_a_change_bumps_the_version_and_is_recorded_audited_and_snapshotted(platform, conn):
    t = new_tenant(platform, weight=10)
    other = new_tenant(platform, service_class="STANDARD", weight=2)
    before = policy.show_policy(conn, t.tenant_id)
    assert before["policy_version"] == 1 and set(before) == {"tenant_id", *policy.NAMES, "policy_version", "updated_at"}

    doc = _set(platform, t.tenant_id, {"weight": 3, "max_user_running_tasks": 1, "expensive_allowed": False},
               reason="noisy neighbour")
    assert doc["policy_version"] == 2 and doc["weight"] == 3 and doc["max_user_running_tasks"] == 1
    assert doc["expensive_allowed"] is False
    assert policy.show_policy(conn, t.tenant_id) == doc
    assert {k: v for k, v in doc.items() if k not in ("weight", "max_user_running_tasks", "expensive_allowed",
                                                      "policy_version", "updated_at")} == \
           {k: v for k, v in before.items() if k not in ("weight", "max_user_running_tasks", "expensive_allowed",
                                                         "policy_version", "updated_at")}

    hist = conn.execute("select * from tenant_policy_history where tenant_id = %s order by policy_version",
                        (t.tenant_id,)).fetchall()
    assert [h["policy_version"] for h in hist] == [1, 2]
    assert hist[1]["policy"] == {n: doc[n] for n in policy.NAMES}
    assert (hist[1]["operator"], hist[1]["reason"]) == ("ops-test", "noisy neighbour")

    [a] = conn.execute("select * from audit_log where action = 'policy.set' and tenant_id = %s", (t.tenant_id,)).fetchall()
    assert (a["operator"], a["target"], a["tenant_id"], a["reason"], a["policy_version"]) == (
        "ops-test", f"tenant:{t.tenant_id}", t.tenant_id, "noisy neighbour", 2)
    assert a["old_value"] == {"weight": 10, "max_user_running_tasks": before["max_user_running_tasks"],
                              "expensive_allowed": before["expensive_allowed"]}
    assert a["new_value"] == {"weight": 3, "max_user_running_tasks": 1, "expensive_allowed": False}

    snap = policy.latest_snapshot(conn)
    assert snap["tenant_id"] == str(t.tenant_id) and snap["policy_version"] == 2 and snap["operator"] == "ops-test"
    assert set(snap["policies"]) >= {str(t.tenant_id), str(other.tenant_id)} and snap["tenant_count"] >= 2
    assert snap["policies"][str(t.tenant_id)]["policy_version"] == 2 and snap["policies"][str(t.tenant_id)]["weight"] == 3
    assert snap["policies"][str(other.tenant_id)]["policy_version"] == 1

    hist_doc = policy.policy_history(conn, t.tenant_id, limit=1)
    assert [i["policy_version"] for i in hist_doc["items"]] == [2] and hist_doc["next_cursor"]
    rest = policy.policy_history(conn, t.tenant_id, limit=1, cursor=hist_doc["next_cursor"])
    assert [i["policy_version"] for i in rest["items"]] == [1] and rest["next_cursor"] is None


def test_a_change_of_service_class_moves_the_tenant_row_too(platform, conn):
    t = new_tenant(platform, service_class="PAID_SHARED")
    doc = _set(platform, t.tenant_id, {"service_class": "STANDARD"})
    assert doc["service_class"] == "STANDARD"
    assert conn.execute("select service_class from tenant where tenant_id = %s", (t.tenant_id,)).fetchone()[
        "service_class"] == "STANDARD"


def test_snapshots_of_concurrent_changes_each_include_the_ones_before(platform, conn):
    tenants = [new_tenant(platform) for _ in range(4)]
    barrier = threading.Barrier(len(tenants))
    errors: list[BaseException] = []

    def change(t):
        try:
            barrier.wait()
            _set(platform, t.tenant_id, {"weight": 5})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=change, args=(t,)) for t in tenants]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    last = policy.latest_snapshot(conn)["policies"]
    assert all(last[str(t.tenant_id)]["policy_version"] == 2 for t in tenants)


# --- bad input --------------------------------------------------------------------------------------

BAD = [
    ({"weight": -1}, {"weight"}),
    ({"weight": 0}, {"weight"}),
    ({"weight": True}, {"weight"}),
    ({"weight": "3"}, {"weight"}),
    ({"weight": 2.5}, {"weight"}),
    ({"max_queued_tasks": -5}, {"max_queued_tasks"}),
    ({"expensive_allowed": "yes"}, {"expensive_allowed"}),
    ({"max_gpus": 4}, {"max_gpus"}),
    ({"policy_version": 9}, {"policy_version"}),
    ({"service_class": "PLATINUM"}, {"service_class"}),
    ({"max_running_tasks": 20_000}, {"max_running_tasks"}),  # above max_queued_tasks (10_000)
    ({"max_running_tasks": 50, "max_queued_tasks": 10}, {"max_running_tasks", "max_queued_tasks"}),
    ({"max_user_running_units": 500, "max_user_queued_units": 100}, {"max_user_running_units", "max_user_queued_units"}),
    ({"max_user_running_tasks": 500}, {"max_user_running_tasks"}),  # above the tenant's max_running_tasks (100)
    ({"max_user_queued_tasks": 20_000}, {"max_user_queued_tasks"}),  # above the tenant's max_queued_tasks
    ({"reserved_units": 300}, {"reserved_units"}),  # above max_running_units (240)
    ({"reserved_units": 1500, "max_running_units": 2000}, {"reserved_units"}),  # above PAID_SHARED's 1200 units
    ({"max_cost_per_minute": 10**12}, {"max_cost_per_minute"}),  # above max_cost_per_day
    ({"weight": -1, "max_running_tasks": 20_000, "foo": 1}, {"weight", "max_running_tasks", "foo"}),
    ({}, {"changes"}),
    (["weight", 3], {"changes"}),
]


@pytest.mark.parametrize("changes,fields", BAD, ids=[json.dumps(c)[:60] for c, _ in BAD])
def test_an_invalid_change_names_each_bad_field_and_writes_nothing(platform, conn, changes, fields):
    t = new_tenant(platform, service_class="PAID_SHARED")
    before = _footprint(conn, t.tenant_id)
    with pytest.raises(InvalidRequest) as e:
        _set(platform, t.tenant_id, changes)
    assert set(e.value.fields) == fields, e.value.fields
    assert e.value.code == "VALIDATION_ERROR" and e.value.details["fields"] == e.value.fields
    assert _footprint(conn, t.tenant_id) == before


def test_reserved_units_follow_the_lane_of_the_new_service_class(platform, conn):
    t = new_tenant(platform, service_class="ENTERPRISE_RESERVED")  # reserved_units 200, lane of 500 units
    with pytest.raises(InvalidRequest) as e:  # BEST_EFFORT's lane has 200 units
        _set(platform, t.tenant_id, {"service_class": "BEST_EFFORT", "reserved_units": 250})
    assert set(e.value.fields) == {"reserved_units"}
    doc = _set(platform, t.tenant_id, {"service_class": "STANDARD", "reserved_units": 240})
    assert doc["reserved_units"] == 240 and doc["policy_version"] == 2


def test_an_unknown_or_malformed_tenant_is_not_found(platform):
    for tid in (uuid.uuid4(), "not-a-uuid"):
        with pytest.raises(NotFound):
            _set(platform, tid, {"weight": 2})
        with pytest.raises(NotFound), platform.db.connection() as c:
            policy.show_policy(c, tid)


# --- a task keeps the version it was admitted under --------------------------------------------------

def test_a_task_admitted_before_a_change_is_scheduled_under_its_old_version(make_platform, conn):
    config = PlatformConfig(providers=[ProviderConfig(name="sim-a", accounts=[ProviderAccount(account_id="a1",
                                                                                                 max_concurrency=500)])])
    p = make_platform(config)
    with p.db.connection() as c:
        ensure_platform_pools(c, config)
    t = new_tenant(p, service_class="PAID_SHARED", weight=10, credits=1_000_000, **{**OPEN, **UNCAPPED})
    body = {**BODY_1U, "interactive": True}
    [old] = submit(p, t.tenant_id, t.user_id, body=body)
    assert GenerationRequest(**body).interactive

    doc = _set(p, t.tenant_id, {"service_class": "STANDARD", "weight": 3}, reason="downgraded contract")
    assert doc["policy_version"] == 2
    [new] = submit(p, t.tenant_id, t.user_id, body=body)

    tasks = {r["task_id"]: r for r in conn.execute(
        "select * from generation_task where task_id = any(%s)", ([old, new],)).fetchall()}
    assert (tasks[old]["queue_class"], tasks[old]["priority_band"], tasks[old]["policy_version"]) == ("PAID_SHARED", 2, 1)
    assert (tasks[new]["queue_class"], tasks[new]["priority_band"], tasks[new]["policy_version"]) == ("STANDARD", 3, 2)
    sched = Scheduler(p)
    current = conn.execute("select * from tenant_scheduling_policy where tenant_id = %s", (t.tenant_id,)).fetchone()
    with p.db.connection() as c:  # routed by the tier it was admitted under, not the tenant's current one
        assert sched._tier(c, "PAID_SHARED", tasks[old], current) == "PAID_SHARED"
        assert sched._tier(c, "STANDARD", tasks[new], current) == "STANDARD"

    report = sched.tick(5.0)
    assert report.claims == 2, report
    after = {r["task_id"]: r for r in conn.execute(
        "select * from generation_task where task_id = any(%s)", ([old, new],)).fetchall()}
    for tid in (old, new):
        assert after[tid]["state"] == "DISPATCHING"
        assert (after[tid]["queue_class"], after[tid]["priority_band"], after[tid]["policy_version"],
                after[tid]["deadline_at"]) == (tasks[tid]["queue_class"], tasks[tid]["priority_band"],
                                               tasks[tid]["policy_version"], tasks[tid]["deadline_at"])
    events = {uuid.UUID(e["payload"]["task_id"]): e["payload"] for e in conn.execute(
        "select payload from outbox_event where event_type = 'TaskDispatchRequested' and aggregate_id = any(%s)",
        ([old, new],)).fetchall()}
    assert (events[old]["queue_class"], events[old]["policy_version"]) == ("PAID_SHARED", 1)
    assert (events[new]["queue_class"], events[new]["policy_version"]) == ("STANDARD", 2)
    lanes = {r["task_id"]: r["lane_key"] for r in conn.execute(
        """select a.task_id, min(r.resource_key) filter (where r.resource_key like 'lane:%%') as lane_key
             from task_attempt a join resource_reservation r on r.attempt_id = a.attempt_id
            where a.task_id = any(%s) group by a.task_id""", ([old, new],)).fetchall()}
    assert lanes == {old: "lane:PAID_SHARED", new: "lane:STANDARD"}


# --- the CLI as typed ---------------------------------------------------------------------------------

def _aivedio(env: dict, *args: str) -> tuple[int, dict | None, str]:
    done = subprocess.run([str(AIVEDIO), *args], env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout.strip()
    return done.returncode, (json.loads(out) if out else None), done.stderr


def test_the_cli_shows_and_sets_as_typed(platform, db_url, redis_url, redis_prefix):
    env = {"AIVEDIO_DATABASE_URL": db_url, "AIVEDIO_REDIS_URL": redis_url, "AIVEDIO_REDIS_PREFIX": redis_prefix,
           "PATH": "/usr/bin:/bin"}
    t = new_tenant(platform, service_class="PAID_SHARED", weight=10)
    tid = str(t.tenant_id)
    rc, shown, err = _aivedio(env, "admin", "tenant", "policy", "show", "--tenant-id", tid, "--json")
    assert rc == 0, err
    assert shown["policy_version"] == 1 and shown["weight"] == 10 and set(policy.NAMES) <= set(shown)

    rc, doc, err = _aivedio(env, "admin", "tenant", "policy", "set", "--tenant-id", tid, "--weight", "3",
                            "--max-user-running-tasks", "1", "--expensive-allowed", "false", "--reason", "x", "--json")
    assert rc == 0, err
    assert (doc["policy_version"], doc["weight"], doc["max_user_running_tasks"], doc["expensive_allowed"]) == (2, 3, 1, False)
    rc, doc, err = _aivedio(env, "admin", "tenant", "policy", "set", "--tenant-id", tid, "--max-running-tasks", "50",
                            "--operator", "ops-jane", "--json")
    assert rc == 0 and doc["policy_version"] == 3, err
    with psycopg.connect(db_url, row_factory=dict_row) as c:
        audited = c.execute("select operator, reason, policy_version from audit_log where action = 'policy.set' "
                            "and tenant_id = %s order by audit_id", (t.tenant_id,)).fetchall()
        assert [(a["operator"], a["reason"], a["policy_version"]) for a in audited] == [
            (f"cli:{getpass.getuser()}", "x", 2), ("ops-jane", None, 3)]
        before = _footprint(c, t.tenant_id)

    for args, fields in [
        (("--weight", "-2"), {"weight"}),
        (("--weight", "abc", "--max-running-tasks", "999999"), {"weight", "max_running_tasks"}),
        (("--expensive-allowed", "maybe"), {"expensive_allowed"}),
        (("--service-class", "GOLD"), {"service_class"}),
        (("--reserved-units", "5000", "--max-running-units", "9000"), {"reserved_units"}),
        ((), {"changes"}),
    ]:
        rc, err_doc, stderr = _aivedio(env, "admin", "tenant", "policy", "set", "--tenant-id", tid, *args, "--json")
        assert rc == 1, (args, stderr)
        assert err_doc["error"] == "VALIDATION_ERROR" and set(err_doc["details"]["fields"]) == fields, err_doc
    rc, err_doc, _ = _aivedio(env, "admin", "tenant", "policy", "show", "--tenant-id", str(uuid.uuid4()), "--json")
    assert rc == 1 and err_doc["error"] == "NOT_FOUND"
    rc, err_doc, _ = _aivedio(env, "admin", "tenant", "policy", "set", "--tenant-id", "nope", "--weight", "2", "--json")
    assert rc == 1 and err_doc["error"] == "NOT_FOUND"
    with psycopg.connect(db_url, row_factory=dict_row) as c:
        assert _footprint(c, t.tenant_id) == before
