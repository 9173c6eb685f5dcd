"""The attempt lifecycle end to end in one process: admission through the HTTP API, the scheduler
tick, dispatch, the workflow runner executing the project's workflow definition, the provider
simulator (with webhooks back to the API), and the terminal transition."""
from __future__ import annotations

import pytest

from aivedio.config import PlatformConfig, ProviderConfig, SimulatorBehaviour, Timers
from aivedio_tools.local.runtime import LocalRuntime
from tests.admission_support import Api, new_tenant
from tests.scheduler_support import UNCAPPED
from tests.waiting import wait_for

pytestmark = pytest.mark.xdist_group("attempts")


def fast_config(**behaviour) -> PlatformConfig:
    sim = SimulatorBehaviour(queue_seconds_min=0, queue_seconds_max=1, latency_seconds_min=2, latency_seconds_max=6,
                             failure_rate=0.0, **behaviour)
    return PlatformConfig(
        time_scale=20.0,
        providers=[ProviderConfig(name="provider-a", submit_timeout_seconds=1.0, simulator=sim)],
        timers=Timers(scheduler_tick_seconds=0.5, outbox_relay_seconds=0.1, poll_first_seconds=4, poll_min_seconds=4,
                      poll_max_seconds=8, unknown_first_check_seconds=2, lease_seconds=60),
    )


def states(conn, tenant_id) -> dict[str, int]:
    rows = conn.execute("select state, count(*) as n from generation_task where tenant_id = %s group by state",
                        (tenant_id,)).fetchall()
    return {r["state"]: r["n"] for r in rows}


def test_tasks_run_to_success_through_the_workflow(make_platform, conn):
    from aivedio.context import set_platform

    p = make_platform(fast_config())
    set_platform(p)
    rt = LocalRuntime(p, port=0).start()
    try:
        api = Api(rt)
        t = new_tenant(p, **UNCAPPED)
        ids = []
        for _ in range(6):
            r = api.submit(t)
            assert r.status_code == 202, r.text
            ids.append(r.json()["task_id"])
        wait_for(lambda: states(conn, t.tenant_id).get("SUCCEEDED") == 6, timeout=90)
        active = conn.execute("select count(*) as n from resource_reservation where tenant_id = %s and state = 'ACTIVE'",
                              (t.tenant_id,)).fetchone()["n"]
        assert active == 0
        events = conn.execute("""select aggregate_id, count(*) as n from outbox_event where tenant_id = %s
                                  and event_type = 'TaskSucceeded' group by aggregate_id""", (t.tenant_id,)).fetchall()
        assert sorted(str(e["aggregate_id"]) for e in events) == sorted(ids) and all(e["n"] == 1 for e in events)
        truth = p.extras["provider_simulators"]["provider-a"].truth
        keys = [j["idempotency_key"] for j in truth["jobs"]]
        assert len(keys) == len(set(keys)) == 6
        got = api.http.get(f"/v1/generations/{ids[0]}", headers={"Authorization": f"Bearer {t.api_key}"}).json()
        assert got["state"] == "SUCCEEDED" and got["outputs"], got
    finally:
        rt.stop()
        set_platform(None)
