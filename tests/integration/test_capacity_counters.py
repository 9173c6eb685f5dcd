"""Room service `capacity-counters` (aivedio.reconcile.capacity_counters), driven alone: a shard counter
that disagrees with its ACTIVE reservations is found, reset to them under its row lock, and the audit
log shows each repair; the capacity_counters degraded mode lasts until the repair has committed."""
from __future__ import annotations

import psycopg
import pytest

from aivedio import degraded
from aivedio.config import LaneConfig, Limits, MaintenanceService, PlatformConfig, ProviderAccount, ProviderConfig
from aivedio.reconcile import capacity_counters, room
from aivedio.scheduling.resources import ensure_platform_pools, rebuild_counters
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import new_tenant
from tests.conftest import create_test_database, drop_test_database
from tests.scheduler_support import OPEN, UNCAPPED, submit

pytestmark = pytest.mark.timeout(120)
NAME = capacity_counters.NAME


@pytest.fixture
def db_url():
    """A database per test: the service reads every shard of the platform."""
    url = create_test_database("capacity")
    yield url
    drop_test_database(url)


def running_platform(make_platform, batch_size: int | None = None):
    """A platform with four claimed tasks, so shards carry ACTIVE reservations."""
    cfg = PlatformConfig(providers=[ProviderConfig(name="sim-a", accounts=[ProviderAccount(account_id="a1", max_concurrency=20)])],
                         lanes={"PAID_SHARED": LaneConfig(capacity_units=20)}, limits=Limits(pool_shards=2),
                         maintenance={NAME: MaintenanceService(batch_size=batch_size)} if batch_size else {})
    p = make_platform(cfg)
    with p.db.connection() as c:
        ensure_platform_pools(c, cfg)
    t = new_tenant(p, weight=1, credits=1_000_000, **{**OPEN, **UNCAPPED})
    submit(p, t.tenant_id, t.user_id, n=4)
    Scheduler(p).tick(2)
    return p


def busy_shards(conn, n: int) -> list[tuple[str, int, int]]:
    rows = conn.execute("""select resource_key, shard_no, used_units from resource_pool_shard where used_units > 0
                            order by resource_key, shard_no limit %s""", (n,)).fetchall()
    assert len(rows) == n
    return [(r["resource_key"], r["shard_no"], r["used_units"]) for r in rows]


def corrupt(conn, key: str, shard: int, delta: int) -> None:
    conn.execute("""update resource_pool_shard set used_units = used_units + %s, capacity_units = greatest(capacity_units, used_units + %s)
                     where resource_key = %s and shard_no = %s""", (delta, delta, key, shard))


def used(conn, key: str, shard: int) -> int:
    return conn.execute("select used_units from resource_pool_shard where resource_key = %s and shard_no = %s",
                        (key, shard)).fetchone()["used_units"]


def repairs(conn) -> list[dict]:
    return conn.execute("""select operator, target, old_value, new_value, reason from audit_log
                            where action = 'capacity.counter.repair' order by target""").fetchall()


def stored_mode(conn) -> bool:
    return conn.execute("select 1 from degraded_mode where mode = %s", (degraded.CAPACITY_COUNTERS,)).fetchone() is not None


def test_a_corrupted_counter_is_detected_repaired_to_its_reservations_and_audited(make_platform, conn):
    p = running_platform(make_platform)
    assert capacity_counters.run_once(p).repaired == 0  # consistent to begin with: nothing to do
    (k1, s1, u1), (k2, s2, u2) = busy_shards(conn, 2)
    corrupt(conn, k1, s1, +3)  # counts capacity that nothing holds: it would be lost until repaired
    corrupt(conn, k2, s2, -1)  # counts less than is held: it would be oversubscribed
    report = capacity_counters.run_once(p)
    assert (report.repaired, report.complete, report.details["mismatches_found"]) == (2, True, 2)
    assert report.details["shards_compared"] >= 2
    assert (used(conn, k1, s1), used(conn, k2, s2)) == (u1, u2)
    with conn.transaction():
        assert rebuild_counters(conn) == 0  # every counter equals its reservations again
    audit = {a["target"]: a for a in repairs(conn)}
    assert set(audit) == {f"shard:{k1}#{s1}", f"shard:{k2}#{s2}"}
    a1 = audit[f"shard:{k1}#{s1}"]
    assert a1["operator"] == "system:capacity-counters" and "ACTIVE reservations" in a1["reason"]
    assert (a1["old_value"]["used_units"], a1["new_value"]["used_units"]) == (u1 + 3, u1)
    assert (audit[f"shard:{k2}#{s2}"]["old_value"]["used_units"], audit[f"shard:{k2}#{s2}"]["new_value"]["used_units"]) == (u2 - 1, u2)
    assert not stored_mode(conn)  # the mode ended with the repair
    assert capacity_counters.run_once(p).repaired == 0  # a second run adds nothing


def test_repairs_cross_a_batch_boundary(make_platform, conn):
    p = running_platform(make_platform, batch_size=2)
    assert room.tuning(p, NAME).batch_size == 2
    shards = busy_shards(conn, 3)
    for key, shard, _ in shards:
        corrupt(conn, key, shard, +1)
    report = capacity_counters.run_once(p)
    assert (report.repaired, report.batches, report.complete) == (3, 2, True)  # 2 + 1: the short batch ends it
    assert [used(conn, k, s) for k, s, _ in shards] == [u for _, _, u in shards]
    assert len(repairs(conn)) == 3


def test_a_shard_locked_by_a_claim_keeps_the_mode_until_a_later_run_repairs_it(make_platform, conn, db_url):
    p = running_platform(make_platform)
    (k1, s1, u1), (k2, s2, u2) = busy_shards(conn, 2)
    corrupt(conn, k1, s1, +2)
    corrupt(conn, k2, s2, +2)
    with psycopg.connect(db_url) as other:  # a claim in flight holds one shard's row
        other.execute("select 1 from resource_pool_shard where resource_key = %s and shard_no = %s for update", (k2, s2))
        report = capacity_counters.run_once(p)
        assert (report.repaired, report.complete) == (1, False)
        assert report.details["skipped_locked"] == [f"{k2}#{s2}"]
        assert used(conn, k1, s1) == u1 and stored_mode(conn)  # still degraded: one counter is still wrong
        other.rollback()
    report = capacity_counters.run_once(p)
    assert (report.repaired, report.complete) == (1, True)
    assert used(conn, k2, s2) == u2 and not stored_mode(conn)


def test_a_mode_left_by_a_run_that_died_ends_once_nothing_is_wrong(make_platform, conn):
    p = running_platform(make_platform)
    (key, shard, _), = busy_shards(conn, 1)
    corrupt(conn, key, shard, +1)
    assert len(capacity_counters.detect(p)) == 1 and stored_mode(conn)  # found; the repair never ran (the run died)
    corrupt(conn, key, shard, -1)  # meanwhile right again (say, an operator's rebuild)
    report = capacity_counters.run_once(p)
    assert report.repaired == 0 and report.details["degraded_mode_ended"] == 1 and not stored_mode(conn)
