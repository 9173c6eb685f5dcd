"""`aivedio rebuild redis` as an operator types it (docs/operations.md: rebuilds every Redis
structure from PostgreSQL; RBAC redis.rebuild, audited): the platform's keys dropped, each lane's
ring rebuilt to exactly PostgreSQL's set of tenants with QUEUED tasks, its index_built marker set,
and the audit log naming who did it and what was rebuilt."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aivedio.config import LaneConfig, PlatformConfig, ProviderAccount, ProviderConfig
from aivedio.scheduling.resources import ensure_platform_pools
from aivedio.scheduling.ring import Ring, active_tenants_pg, built_key
from tests.admission_support import new_tenant
from tests.scheduler_support import BODY_1U, OPEN, UNCAPPED, submit

pytestmark = [pytest.mark.timeout(180), pytest.mark.redis_cluster]
PAID, STD = "PAID_SHARED", "STANDARD"


def cli(db_url, redis_url, prefix):
    env = {"AIVEDIO_DATABASE_URL": db_url, "AIVEDIO_REDIS_URL": redis_url, "AIVEDIO_REDIS_PREFIX": prefix, "PATH": "/usr/bin:/bin"}

    def aivedio(*args: str, **env_over: str) -> tuple[int, dict]:
        done = subprocess.run([sys.executable, "-m", "aivedio_tools.cli", *args], env={**env, **env_over}, capture_output=True,
                              text=True, timeout=120)
        assert done.stdout.count("\n") == 1, (done.stdout, done.stderr[-2000:])  # exactly one JSON document
        return done.returncode, json.loads(done.stdout)

    return aivedio


def test_rebuild_redis_rebuilds_every_ring_from_postgresql_and_audits_it(make_platform, conn, db_url, redis_url,
                                                                                 redis_prefix):
    p = make_platform(PlatformConfig(providers=[ProviderConfig(name="sim-a", accounts=[ProviderAccount(account_id="a1")])],
                                     lanes={PAID: LaneConfig(capacity_units=10)}))
    with p.db.connection() as c:
        ensure_platform_pools(c, p.config)
    paid = [new_tenant(p, service_class="PAID_SHARED", **OPEN, **UNCAPPED) for _ in range(3)]
    std = new_tenant(p, service_class="STANDARD", **OPEN, **UNCAPPED)
    for t in paid:
        submit(p, t.tenant_id, t.user_id, BODY_1U, n=2, ring=False)  # nobody told the ring
    submit(p, std.tenant_id, std.user_id, BODY_1U, n=1, ring=False)
    ring, cache = Ring(p), p.cache
    ring.add(PAID, paid[0].tenant_id)
    ring.add(PAID, "00000000-0000-0000-0000-00000000dead")  # a tenant with nothing queued
    cache.r.set(cache.key("rate", "junk"), "1")
    aivedio = cli(db_url, redis_url, redis_prefix)

    # The CLI is trusted with the database's credentials: no role, --operator only names who acts.
    rc, done = aivedio("rebuild", "redis", "--operator", "ops", "--json")
    assert rc == 0, done
    assert done["prefix"] == redis_prefix and done["keys_dropped"] >= 3
    assert done["lanes"][PAID] == {"tenants": 3, "ring_length": 3} and done["lanes"][STD] == {"tenants": 1, "ring_length": 1}
    assert done["tenants_indexed"] == 4 and set(done["not_rebuilt"]) == {"rate", "budget-burn", "wake"}
    for lane in p.config.lanes:
        members, listed = ring.members(lane)
        assert members == set(listed) == {str(t) for t in active_tenants_pg(conn, lane)}, lane
        assert len(listed) == len(members)
        assert cache.r.exists(built_key(cache, lane))
    assert not cache.r.exists(cache.key("rate", "junk"))
    audit = conn.execute("select operator, target, new_value from audit_log where action = 'redis.rebuild'").fetchall()
    assert [(a["operator"], a["target"]) for a in audit] == [("ops", f"redis:{redis_prefix}")]
    assert audit[0]["new_value"]["lanes"][PAID]["tenants"] == 3

    rc, err = aivedio("rebuild", "redis", "--operator", "ops", "--json", AIVEDIO_REDIS_URL="none")
    assert rc == 1 and err["error"] == "REDIS_UNAVAILABLE"
