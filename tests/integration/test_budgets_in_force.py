"""Budgets act on admission and on the claim (issue 6, "Budgets"): a spent tenant or platform
budget refuses new work at the door, a budget at its restrict level refuses costly and
low-priority work, and the claim reserves the attempt's estimated provider cost against every
scope, taking the claim back when a budget refuses."""
from __future__ import annotations

import json
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest

from aivedio.admission.decisions import Rejected
from aivedio.admission.models import GenerationRequest
from aivedio.admission.service import admit
from aivedio.spend import budgets
from aivedio.scheduling.resources import ensure_platform_pools
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import clear_cache, new_tenant
from tests.billing_support import ADMIN
from tests.scheduler_support import BODY_1U, UNCAPPED, submit


@pytest.fixture
def p(platform):
    with platform.db.connection() as conn:
        ensure_platform_pools(conn, platform.config)
    return platform


def budget(p, scope_type: str, scope_id: str, limit: str, *, consumed: str = "0") -> uuid.UUID:
    now = p.clock.now()
    b = p.db.transaction(lambda c: budgets.set_budget(c, operator=ADMIN, scope_type=scope_type, scope_id=scope_id,
                                                      period_start=now - timedelta(hours=1), period_end=now + timedelta(days=1),
                                                      limit_amount=Decimal(limit), currency="USD"))
    with p.db.connection() as conn:
        conn.execute("update budget_account set consumed_amount = %s where budget_id = %s", (Decimal(consumed), b["budget_id"]))
    clear_cache(p)
    return b["budget_id"]


def try_admit(p, t, body=BODY_1U):
    return json.loads(admit(p, t.caller, GenerationRequest(**body), body, uuid.uuid4().hex).body)


def test_a_spent_tenant_budget_refuses_at_admission(p):
    t = new_tenant(p, **UNCAPPED)
    budget(p, "TENANT", str(t.tenant_id), "10.00", consumed="10.00")
    with pytest.raises(Rejected) as e:
        try_admit(p, t)
    assert e.value.decision == "REJECT_COST_BUDGET" and e.value.status == 402
    other = new_tenant(p, **UNCAPPED)
    assert try_admit(p, other)["decision"] == "ACCEPTED"  # another tenant's budget is not this one's


def test_a_budget_at_its_restrict_level_refuses_only_costly_and_low_priority_work(p):
    t = new_tenant(p, **UNCAPPED, expensive_allowed=True)
    budget(p, "TENANT", str(t.tenant_id), "10.00", consumed="9.20")
    assert try_admit(p, t)["decision"] == "ACCEPTED"  # P3 work still comes in
    with pytest.raises(Rejected) as e:
        try_admit(p, t, {**BODY_1U, "resolution": "4k"})  # the EXPENSIVE lane
    assert e.value.decision == "REJECT_COST_BUDGET"


def test_the_claim_reserves_provider_cost_and_a_refusing_budget_takes_the_claim_back(p):
    t = new_tenant(p, **UNCAPPED)
    [task_id] = submit(p, t.tenant_id, t.user_id)
    acct = budget(p, "PROVIDER_ACCOUNT", "provider-a:account-01", "0.00000001")  # less than any attempt costs
    assert Scheduler(p).tick(3.0).claims == 0
    with p.db.connection() as conn:
        row = conn.execute("select state, current_attempt_id from generation_task where task_id = %s", (task_id,)).fetchone()
        assert (row["state"], row["current_attempt_id"]) == ("QUEUED", None)
        assert conn.execute("select count(*) as n from task_attempt where task_id = %s", (task_id,)).fetchone()["n"] == 0
        assert conn.execute("select count(*) as n from budget_reservation").fetchone()["n"] == 0
        conn.execute("update budget_account set limit_amount = 100 where budget_id = %s", (acct,))
    clear_cache(p)
    assert Scheduler(p).tick(3.0).claims >= 1
    with p.db.connection() as conn:
        attempt = conn.execute("select attempt_id, estimated_cost_amount from task_attempt where task_id = %s", (task_id,)).fetchone()
        res = conn.execute("select amount, state from budget_reservation where attempt_id = %s and budget_id = %s",
                           (attempt["attempt_id"], acct)).fetchone()
        assert res["state"] == "ACTIVE" and res["amount"] == attempt["estimated_cost_amount"] > 0
        total = conn.execute("select sum(amount) as s from budget_reservation where budget_id = %s and state = 'ACTIVE'",
                             (acct,)).fetchone()["s"]
        assert conn.execute("select reserved_amount from budget_account where budget_id = %s", (acct,)).fetchone()["reserved_amount"] == total


def test_a_tenant_budget_caps_the_tenant_at_the_claim(p):
    t = new_tenant(p, **UNCAPPED)
    [task_id] = submit(p, t.tenant_id, t.user_id)
    budget(p, "TENANT", str(t.tenant_id), "0.00000001")
    # The module's database still holds other tenants' queued work from the tests above, and the
    # tick may claim it when it rebuilds the ring: only this tenant's claims must be none.
    Scheduler(p).tick(3.0)
    with p.db.connection() as conn:
        assert conn.execute("select state from generation_task where task_id = %s", (task_id,)).fetchone()["state"] == "QUEUED"
        assert conn.execute("select count(*) as n from task_attempt where tenant_id = %s",
                            (t.tenant_id,)).fetchone()["n"] == 0


def test_the_burn_rate_mirror_speeds_admission_up_but_postgresql_decides(p):
    t = new_tenant(p, **UNCAPPED)
    b = budget(p, "TENANT", str(t.tenant_id), "10.00", consumed="1.00")
    budget(p, "GLOBAL", budgets.GLOBAL_SCOPE_ID, "1000000.00")
    assert try_admit(p, t)["decision"] == "ACCEPTED"  # PostgreSQL answered and filled the mirror
    mirrored = p.cache.r.get(p.cache.key("budget-burn", "TENANT", str(t.tenant_id)))
    assert mirrored is not None and float(mirrored) == 10.0
    assert budgets.mirror_clear(p.cache, t.tenant_id, p.config.billing)
    # The budget is spent behind the mirror's back: a fresh mirror lets a request through (the claim
    # would still refuse it); once the mirror is gone, PostgreSQL refuses at the door.
    with p.db.connection() as conn:
        conn.execute("update budget_account set consumed_amount = 10 where budget_id = %s", (b,))
    assert try_admit(p, t)["decision"] == "ACCEPTED"
    p.cache.r.delete(p.cache.key("budget-burn", "TENANT", str(t.tenant_id)))
    with pytest.raises(Rejected) as e:
        try_admit(p, t)
    assert e.value.decision == "REJECT_COST_BUDGET"
    assert float(p.cache.r.get(p.cache.key("budget-burn", "TENANT", str(t.tenant_id)))) == 100.0
    assert not budgets.mirror_clear(p.cache, t.tenant_id, p.config.billing)
