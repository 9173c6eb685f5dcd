"""Project budgets (ch. 20.9.4 "租户或项目周期预算") on the real PostgreSQL and Redis.

A project is an attribute of an API key, chosen by the operator (`aivedio admin api-key create
--project`), never by the request. Admission stamps the key's project on the task and answers to
the PROJECT budget as it does to the TENANT budget; the claim reserves the attempt's provider cost
against it and settlement settles it. The scope id is tenant-qualified, so another tenant's project
of the same name is another budget."""
from __future__ import annotations

import json
import uuid
from datetime import timedelta
from decimal import Decimal

import psycopg
import pytest

from aivedio.admin.api_keys import create_api_key
from aivedio.auth import authenticate, hash_key
from aivedio.spend import budgets
from aivedio.billing.settlement import settle
from aivedio.errors import InvalidRequest, NotFound
from aivedio.scheduling.resources import ensure_platform_pools
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import Tenant, accepted, assert_rejected, clear_cache, footprint, new_tenant, second_user, serve
from tests.billing_support import ADMIN, Cli, terminal
from tests.scheduler_support import UNCAPPED, submit

_ = serve  # a fixture, imported for the tests that request it


@pytest.fixture
def p(platform):
    with platform.db.connection() as conn:
        ensure_platform_pools(conn, platform.config)
    return platform


def project_key(p, t: Tenant, project: str) -> Tenant:
    """Another key of the tenant's owner, bound to `project`, issued as the operator issues it."""
    k = p.db.transaction(lambda c: create_api_key(c, operator=ADMIN, tenant_id=t.tenant_id, project=project))
    return Tenant(t.tenant_id, k.user_id, t.wallet_id, k.api_key, project)


def project_budget(p, tenant_id, project: str, limit: str, *, consumed: str = "0") -> uuid.UUID:
    now = p.clock.now()
    b = p.db.transaction(lambda c: budgets.set_budget(
        c, operator=ADMIN, scope_type="PROJECT", scope_id=budgets.project_scope_id(tenant_id, project),
        period_start=now - timedelta(hours=1), period_end=now + timedelta(days=1), limit_amount=Decimal(limit), currency="USD"))
    with p.db.connection() as conn:
        conn.execute("update budget_account set consumed_amount = %s where budget_id = %s", (Decimal(consumed), b["budget_id"]))
    clear_cache(p)
    return b["budget_id"]


def budget_state(conn, budget_id) -> tuple:
    b = conn.execute("select reserved_amount, consumed_amount from budget_account where budget_id = %s", (budget_id,)).fetchone()
    n = conn.execute("select count(*) as n from budget_reservation where budget_id = %s", (budget_id,)).fetchone()["n"]
    return b["reserved_amount"], b["consumed_amount"], n


def task_project(conn, task_id):
    return conn.execute("select project_id from generation_task where task_id = %s", (task_id,)).fetchone()["project_id"]


# --- admission ----------------------------------------------------------------------------------------

def test_a_project_keys_task_carries_its_project_and_the_request_cannot_choose_one(p, conn, serve):
    api = serve(p)
    t = new_tenant(p)
    trailers = project_key(p, t, "trailers")
    with p.db.connection() as c:
        assert authenticate(c, f"Bearer {trailers.api_key}").project == "trailers"
    smuggled = {"model": "video-model-x", "mode": "text_to_video", "prompt": "a fox", "duration_seconds": 5,
                "resolution": "720p", "project": "ads", "project_id": "ads"}
    assert task_project(conn, accepted(api.submit(trailers))["task_id"]) == "trailers"
    assert task_project(conn, accepted(api.submit(trailers, smuggled))["task_id"]) == "trailers"
    assert task_project(conn, accepted(api.submit(t))["task_id"]) is None  # the tenant's first key has no project
    assert task_project(conn, accepted(api.submit(t, smuggled))["task_id"]) is None


def test_a_spent_project_budget_refuses_that_projects_tasks_and_no_one_elses(p, conn, serve):
    api = serve(p)
    t = new_tenant(p, **UNCAPPED)
    trailers, ads = project_key(p, t, "trailers"), project_key(p, t, "ads")
    spent = project_budget(p, t.tenant_id, "trailers", "10.00", consumed="10.00")
    before = footprint(conn, t.tenant_id)
    body = assert_rejected(api.submit(trailers), "REJECT_COST_BUDGET", conn, t.tenant_id, before)
    assert "project budget" in body["message"] and body["retry_after_seconds"] >= 1
    assert budget_state(conn, spent) == (Decimal(0), Decimal("10.00"), 0)
    # The tenant's other project and its project-less key come in; so does another tenant's "trailers".
    accepted(api.submit(ads))
    accepted(api.submit(t))
    other = new_tenant(p, **UNCAPPED)
    assert task_project(conn, accepted(api.submit(project_key(p, other, "trailers")))["task_id"]) == "trailers"
    # The Redis mirror holds the project's burn rate too: spent for "trailers", clear for "ads".
    cfg = p.config.billing
    assert not budgets.mirror_clear(p.cache, t.tenant_id, cfg, project="trailers")
    assert budgets.mirror_clear(p.cache, t.tenant_id, cfg, project="ads")
    assert_rejected(api.submit(trailers), "REJECT_COST_BUDGET", conn, t.tenant_id, footprint(conn, t.tenant_id))


# --- the claim and settlement -----------------------------------------------------------------------------

def test_the_claim_reserves_against_the_project_budget_and_settlement_settles_it(p, conn):
    t, other = new_tenant(p, **UNCAPPED), new_tenant(p, **UNCAPPED)
    mine = project_budget(p, t.tenant_id, "trailers", "100.00")
    theirs = project_budget(p, other.tenant_id, "trailers", "100.00")
    [task_id] = submit(p, t.tenant_id, t.user_id, project="trailers")
    assert Scheduler(p).tick(3.0).claims >= 1  # the module's earlier tests left tasks queued too
    attempt = conn.execute("select * from task_attempt where task_id = %s", (task_id,)).fetchone()
    res = conn.execute("select amount, state from budget_reservation where budget_id = %s", (mine,)).fetchone()
    assert res["state"] == "ACTIVE" and res["amount"] == attempt["estimated_cost_amount"] > 0
    assert budget_state(conn, mine) == (res["amount"], Decimal(0), 1)
    assert budget_state(conn, theirs) == (Decimal(0), Decimal(0), 0)

    payload = {**terminal(task_id, t.tenant_id, attempt_id=attempt["attempt_id"], cost="0.30"),
               "provider": attempt["provider"], "provider_account": attempt["provider_account"]}
    with p.db.connection() as c:
        settle(c, payload, p.clock.now(), event_type="TaskSucceeded", event_id=uuid.uuid4())
    assert budget_state(conn, mine) == (Decimal(0), Decimal("0.30"), 1)
    assert conn.execute("select state from budget_reservation where budget_id = %s", (mine,)).fetchone()["state"] == "SETTLED"
    assert budget_state(conn, theirs) == (Decimal(0), Decimal(0), 0)


def test_a_project_budget_without_room_defers_that_projects_task_only(p, conn):
    t, other = new_tenant(p, **UNCAPPED), new_tenant(p, **UNCAPPED)
    tiny = project_budget(p, t.tenant_id, "trailers", "0.00000001")  # admits (0 % used), but no attempt fits
    [capped] = submit(p, t.tenant_id, t.user_id, project="trailers")
    [behind] = submit(p, t.tenant_id, t.user_id, project="ads")  # the same tenant's other project, queued after it
    [theirs] = submit(p, other.tenant_id, other.user_id, project="trailers")
    Scheduler(p).tick(3.0)
    rows = conn.execute("select task_id, state, next_eligible_at from generation_task where task_id = any(%s)",
                        ([capped, behind, theirs],)).fetchall()
    assert {r["task_id"]: r["state"] for r in rows} == {capped: "QUEUED", behind: "DISPATCHING", theirs: "DISPATCHING"}
    deferred = next(r["next_eligible_at"] for r in rows if r["task_id"] == capped)
    assert deferred > p.clock.now()  # looked at again later, not on every visit
    assert conn.execute("select count(*) as n from task_attempt where task_id = %s", (capped,)).fetchone()["n"] == 0
    assert budget_state(conn, tiny) == (Decimal(0), Decimal(0), 0)


# --- budgets: one spelling of a project's scope ---------------------------------------------------------------

def test_a_project_budget_is_set_only_under_the_tenant_qualified_scope_id(p, conn):
    t = new_tenant(p)
    good = project_budget(p, t.tenant_id, "trailers", "5")
    assert conn.execute("select tenant_id from budget_account where budget_id = %s", (good,)).fetchone()["tenant_id"] == t.tenant_id

    def set_project(scope_id, tenant_id=None):
        now = p.clock.now()
        return p.db.transaction(lambda c: budgets.set_budget(
            c, operator=ADMIN, scope_type="PROJECT", scope_id=scope_id, period_start=now, period_end=now + timedelta(days=1),
            limit_amount=Decimal(5), currency="USD", tenant_id=tenant_id))

    n = conn.execute("select count(*) as n from budget_account").fetchone()["n"]
    for bad in ("trailers", f"{t.tenant_id}:", f"{t.tenant_id}:bad name", f"{str(t.tenant_id).upper()}:trailers"):
        with pytest.raises(InvalidRequest) as e:
            set_project(bad)
        assert "TENANT_ID:PROJECT" in e.value.fields["scope_id"]
    with pytest.raises(InvalidRequest) as e:
        set_project(budgets.project_scope_id(t.tenant_id, "trailers"), tenant_id=uuid.uuid4())
    assert "tenant_id" in e.value.fields
    with pytest.raises(NotFound):
        set_project(budgets.project_scope_id(uuid.uuid4(), "trailers"))
    assert conn.execute("select count(*) as n from budget_account").fetchone()["n"] == n


# --- the operator command ---------------------------------------------------------------------------------------

def test_the_cli_issues_a_project_key_and_audits_it(p, conn, db_url, monkeypatch, capsys):
    monkeypatch.setenv("AIVEDIO_DATABASE_URL", db_url)
    monkeypatch.setenv("AIVEDIO_REDIS_URL", "none")
    cli = Cli(monkeypatch)
    t = new_tenant(p)
    member = second_user(p, t)

    def run(*args, operator=ADMIN):
        code = cli.main(["admin", "api-key", "create", *args, "--json", "--operator", operator])
        return code, json.loads(capsys.readouterr().out)

    def keys_and_audits():
        return (conn.execute("select count(*) as n from api_key where tenant_id = %s", (t.tenant_id,)).fetchone()["n"],
                conn.execute("select count(*) as n from audit_log where action = 'api_key.create'").fetchone()["n"])

    before = keys_and_audits()
    for bad in ("", "has space", "a" * 65, "ünicode", "a/b", "a:b"):
        code, doc = run("--tenant-id", str(t.tenant_id), "--project", bad)
        assert (code, doc["error"]) == (1, "VALIDATION_ERROR") and "project" in doc["details"]["fields"], bad
    code, doc = run("--tenant-id", str(uuid.uuid4()), "--project", "trailers")
    assert (code, doc["error"]) == (1, "NOT_FOUND") and "no tenant" in doc["message"]
    code, doc = run("--tenant-id", str(t.tenant_id), "--user-id", str(uuid.uuid4()), "--project", "trailers")
    assert (code, doc["error"]) == (1, "NOT_FOUND") and "no user" in doc["message"]
    with pytest.raises(SystemExit):  # argparse: not a UUID
        cli.main(["admin", "api-key", "create", "--tenant-id", "acme", "--project", "trailers", "--operator", ADMIN])
    assert keys_and_audits() == before

    code, doc = run("--tenant-id", str(t.tenant_id), "--project", "a" * 64)
    assert code == 0 and doc["user_id"] == str(t.user_id)  # the tenant's owner by default
    code, doc = run("--tenant-id", str(t.tenant_id), "--user-id", str(member.user_id), "--project", "trailers.v2_x-1")
    assert code == 0 and doc["api_key"].startswith("av_")
    assert {k: doc[k] for k in ("tenant_id", "user_id", "project", "budget_scope_id")} == {
        "tenant_id": str(t.tenant_id), "user_id": str(member.user_id), "project": "trailers.v2_x-1",
        "budget_scope_id": f"{t.tenant_id}:trailers.v2_x-1"}
    key = conn.execute("select * from api_key where key_id = %s", (doc["key_id"],)).fetchone()
    assert (key["project"], key["key_hash"], key["user_id"]) == ("trailers.v2_x-1", hash_key(doc["api_key"]), member.user_id)
    with p.db.connection() as c:
        assert authenticate(c, f"Bearer {doc['api_key']}").project == "trailers.v2_x-1"
    audit = conn.execute("select * from audit_log where target = %s", (f"api_key:{doc['key_id']}",)).fetchone()
    assert (audit["operator"], audit["action"], audit["tenant_id"]) == (ADMIN, "api_key.create", t.tenant_id)
    assert audit["new_value"]["project"] == "trailers.v2_x-1" and audit["new_value"]["user_id"] == str(member.user_id)
    assert doc["api_key"] not in json.dumps(audit, default=str)  # the secret is shown once, never recorded


def test_the_schema_refuses_a_bad_project_on_a_key(p, conn):
    t = new_tenant(p)
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("insert into api_key (tenant_id, user_id, key_hash, project) values (%s, %s, %s, 'no spaces')",
                     (t.tenant_id, t.user_id, "0" * 64))
