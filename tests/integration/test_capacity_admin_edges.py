"""The two edges over aivedio.admin.capacity and the price book (issue 16): `aivedio admin lane|pool|
provider-account|switch|price ...` as a person types them (subprocesses, trusted, audited as
--operator or cli:<os user>), and the admin API routes of functions/admin_api/routes/capacity.py
through the admin Lambda handler: who may, 422 naming the field with nothing written, a closed
resource class answering 403 REJECT_RESOURCE_CLASS_DISABLED on the tenant API, price versions and
budgets."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from urllib.parse import quote, urlencode

import psycopg
import pytest

from aivedio.admin import operators
from aivedio_tools.local.apigw import to_event
from aivedio_tools.local.lambda_context import FakeLambdaContext
from aivedio.pricing import price_book
from tests.admission_support import BODY, new_tenant

pytestmark = pytest.mark.timeout(300)


def _aivedio(env: dict, *args: str) -> tuple[int, dict | None, str]:
    done = subprocess.run([sys.executable, "-m", "aivedio_tools.cli", *args], env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout.strip()
    try:
        return done.returncode, (json.loads(out) if out else None), done.stderr
    except ValueError:
        return done.returncode, {"text": out}, done.stderr


def _audit(db_url: str, action: str) -> list[tuple]:
    with psycopg.connect(db_url) as c:
        return c.execute("select operator, target, old_value, new_value, reason from audit_log where action = %s "
                         "order by audit_id", (action,)).fetchall()


def _count(db_url: str, table: str) -> int:
    with psycopg.connect(db_url) as c:
        return c.execute(f"select count(*) from {table}").fetchone()[0]


# --- the command line ---------------------------------------------------------------------------------

def test_the_cli_changes_capacities_switches_and_prices_and_audits_each(db_url, redis_url, redis_prefix):
    env = {"AIVEDIO_DATABASE_URL": db_url, "AIVEDIO_REDIS_URL": redis_url, "AIVEDIO_REDIS_PREFIX": redis_prefix,
           "PATH": "/usr/bin:/bin"}
    rc, lanes, err = _aivedio(env, "admin", "lane", "list", "--json")
    assert rc == 0, err
    paid = next(x for x in lanes["items"] if x["lane"] == "PAID_SHARED")
    assert (paid["capacity_units"], paid["admission_open"]) == (1200, True)

    rc, doc, err = _aivedio(env, "admin", "lane", "set", "--lane", "PAID_SHARED", "--capacity-units", "900",
                            "--reason", "smaller fleet", "--json")
    assert rc == 0 and (doc["capacity_units"], doc["override_version"]) == (900, 1), err
    rc, lanes, _ = _aivedio(env, "admin", "lane", "list", "--json")
    paid = next(x for x in lanes["items"] if x["lane"] == "PAID_SHARED")
    assert (paid["capacity_units"], paid["in_force_units"]) == (900, 900)
    rc, text, _ = _aivedio(env, "admin", "lane", "list")  # for a person: a table, not a repr
    assert rc == 0 and text["text"].splitlines()[0].split()[:2] == ["lane", "capacity_units"]

    audits_before = _count(db_url, "audit_log")
    for args, field in ((("--capacity-units", "-5"), "capacity_units"), (("--capacity-units", "1.5"), "capacity_units"),
                        (("--capacity-units", "10", "--borrowable-units", "11"), "borrowable_units")):
        rc, e, _ = _aivedio(env, "admin", "lane", "set", "--lane", "PAID_SHARED", *args, "--reason", "bad", "--json")
        assert rc == 1 and e["error"] == "VALIDATION_ERROR" and field in e["details"]["fields"], (args, e)
    rc, e, _ = _aivedio(env, "admin", "lane", "set", "--lane", "GOLD", "--capacity-units", "5", "--reason", "x", "--json")
    assert rc == 1 and "lane" in e["details"]["fields"]
    assert _count(db_url, "audit_log") == audits_before

    rc, doc, err = _aivedio(env, "admin", "pool", "set", "--key", "worker:gpu", "--capacity-units", "8", "--reason", "gpus",
                            "--operator", "ops-jane", "--json")
    assert rc == 0 and doc["capacity_units"] == 8, err
    rc, pools, _ = _aivedio(env, "admin", "pool", "list", "--json")
    assert next(x for x in pools["items"] if x["key"] == "worker:gpu")["in_force_units"] == 8

    rc, doc, err = _aivedio(env, "admin", "provider-account", "set", "--provider", "provider-a", "--account-id",
                            "account-01", "--max-concurrency", "50", "--reason", "provider quota", "--json")
    assert rc == 0 and (doc["max_concurrency"], doc["configured_max_concurrency"]) == (50, 200), err
    rc, doc, err = _aivedio(env, "admin", "provider-account", "set", "--provider", "provider-a", "--account-id",
                            "account-01", "--max-concurrency", "60", "--json")  # --reason is optional
    assert rc == 0 and doc["max_concurrency"] == 60, err
    rc, e, _ = _aivedio(env, "admin", "provider-account", "set", "--provider", "provider-z", "--account-id", "account-01",
                        "--max-concurrency", "5", "--reason", "x", "--json")
    assert rc == 1 and "provider" in e["details"]["fields"]

    rc, doc, err = _aivedio(env, "admin", "switch", "set", "--resource-class", "video-4k", "--closed", "--reason",
                            "4k incident", "--json")
    assert rc == 0 and doc["open"] is False, err
    rc, sw, _ = _aivedio(env, "admin", "switch", "list", "--json")
    assert {x["switch"]: x["open"] for x in sw["items"]}["resource_class:video-4k"] is False
    rc, e, _ = _aivedio(env, "admin", "switch", "set", "--resource-class", "video-8k", "--open", "--reason", "x", "--json")
    assert rc == 1 and "resource_class" in e["details"]["fields"]

    start = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
    rules = json.dumps({"models": {"video-model-x": {"per_second_amount": 11}}})
    rc, v1, err = _aivedio(env, "admin", "price", "create", "--effective-from", start, "--rules", rules, "--reason",
                           "new rates", "--json")
    assert rc == 0 and v1["rules"]["models"]["video-model-x"]["per_second_amount"] == 11, err
    rc, e, _ = _aivedio(env, "admin", "price", "create", "--effective-from", start, "--rules", "{}", "--reason", "again",
                        "--json")
    assert rc == 1 and "effective_from" in e["details"]["fields"]
    rc, listed, _ = _aivedio(env, "admin", "price", "list", "--json")
    assert listed["items"][0]["price_version_id"] == v1["price_version_id"]

    [lane] = _audit(db_url, "lane.set")
    assert lane[0].startswith("cli:") and lane[1] == "lane:PAID_SHARED" and lane[4] == "smaller fleet"
    assert (lane[2]["capacity_units"], lane[3]["capacity_units"]) == (1200, 900)
    assert _audit(db_url, "pool.set")[0][:2] == ("ops-jane", "pool:worker:gpu")
    assert _audit(db_url, "provider_account.set")[0][2:4] == ({"max_concurrency": 200}, {"max_concurrency": 50})
    assert _audit(db_url, "switch.set")[0][1:4] == ("switch:resource_class:video-4k", {"open": True}, {"open": False})
    assert _audit(db_url, "price.create")[0][1] == f"price_version:{v1['price_version_id']}"


# --- the admin API --------------------------------------------------------------------------------------

def call(method: str, path: str, token: str | None = None, body=None, query: dict | None = None) -> tuple[int, dict]:
    from functions.admin_api.handler import lambda_handler

    hs = {"Authorization": f"Bearer {token}"} if token else {}
    raw = b""
    if body is not None:
        raw = json.dumps(body).encode()
        hs["Content-Type"] = "application/json"
    resp = lambda_handler(to_event(method, path, urlencode(query or {}), list(hs.items()), raw),
                          FakeLambdaContext("aivedio-admin-api"))
    return resp["statusCode"], json.loads(resp.get("body") or "null")


def generate(api_key: str) -> tuple[int, dict]:
    from functions.api.handler import lambda_handler

    hs = [("Authorization", f"Bearer {api_key}"), ("Idempotency-Key", uuid.uuid4().hex), ("Content-Type", "application/json")]
    resp = lambda_handler(to_event("POST", "/v1/generations", "", hs, json.dumps(BODY).encode()),
                          FakeLambdaContext("aivedio-api"))
    return resp["statusCode"], json.loads(resp["body"])


@pytest.fixture
def tokens(platform) -> dict[str, str]:
    return {role: platform.db.transaction(lambda c, r=role: operators.create_operator(
        c, actor="test", name=f"{r}-{uuid.uuid4().hex[:6]}", role=r)).token for role in operators.ROLES}


def test_lanes_pools_and_accounts_through_the_admin_api(platform, tokens, conn):
    status, body = call("PATCH", "/admin/v1/lanes/STANDARD", tokens["viewer"], {"capacity_units": 500, "reason": "x"})
    assert status == 403 and body["error"] == "FORBIDDEN"
    status, body = call("PATCH", "/admin/v1/lanes/STANDARD", tokens["operator"], {"capacity_units": 500, "reason": "peak"})
    assert status == 200 and body["capacity_units"] == 500, body
    row = conn.execute("select operator, old_value, new_value from audit_log where action = 'lane.set' "
                       "and target = 'lane:STANDARD'").fetchone()
    assert row["operator"].startswith("op:operator-") and row["new_value"]["capacity_units"] == 500

    before = conn.execute("select count(*) as n from audit_log").fetchone()["n"]
    for bad, field in (({"capacity_units": -1, "reason": "x"}, "capacity_units"),
                       ({"capacity_units": "many", "reason": "x"}, "capacity_units"),
                       ({"capacity_units": 100, "borrowable_units": 101, "reason": "x"}, "borrowable_units"),
                       ({"capacity_units": 100, "reason": " "}, "reason")):
        status, body = call("PATCH", "/admin/v1/lanes/STANDARD", tokens["admin"], bad)
        assert status == 422 and field in body["details"]["fields"], (bad, body)
    status, body = call("PATCH", "/admin/v1/lanes/GOLD", tokens["admin"], {"capacity_units": 1, "reason": "x"})
    assert status == 422 and "lane" in body["details"]["fields"]
    assert conn.execute("select count(*) as n from audit_log").fetchone()["n"] == before

    for path in ("/admin/v1/pools/worker:cpu", "/admin/v1/pools/" + quote("worker:cpu", safe="")):
        status, body = call("GET", path, tokens["viewer"])
        assert status == 200 and body["key"] == "worker:cpu", (path, body)
    status, body = call("PATCH", "/admin/v1/pools/worker:cpu", tokens["operator"], {"capacity_units": 100, "reason": "cpu"})
    assert status == 200 and body["capacity_units"] == 100
    status, body = call("GET", "/admin/v1/pools", tokens["viewer"])
    assert {p["key"]: p["in_force_units"] for p in body["items"]}["worker:cpu"] == 100
    status, body = call("PATCH", "/admin/v1/pools/worker:tpu", tokens["operator"], {"capacity_units": 1, "reason": "x"})
    assert status == 422 and "key" in body["details"]["fields"]

    status, body = call("PATCH", "/admin/v1/providers/provider-a/accounts/account-01", tokens["operator"],
                        {"max_concurrency": 20, "reason": "quota"})
    assert status == 200 and body["max_concurrency"] == 20, body
    status, body = call("GET", "/admin/v1/providers/provider-a/accounts", tokens["viewer"])
    assert status == 200 and body["items"][0]["max_concurrency"] == 20
    status, body = call("PATCH", "/admin/v1/providers/provider-a/accounts/nope", tokens["operator"],
                        {"max_concurrency": 2, "reason": "x"})
    assert status == 422 and "account_id" in body["details"]["fields"]
    status, body = call("PATCH", "/admin/v1/providers/provider-a/accounts/account-01", tokens["finance"],
                        {"max_concurrency": 2, "reason": "x"})
    assert status == 403  # capacities are the operators'

    status, body = call("GET", "/admin/v1/lanes", tokens["viewer"])  # routes/lanes.py over lane_report
    assert status == 200 and {x["lane"]: x["capacity_units"] for x in body["items"]}["STANDARD"] == 500


def test_a_switch_closes_a_resource_class_on_the_tenant_api_and_reopens(platform, tokens):
    tenant = new_tenant(platform, credits=100_000)
    assert generate(tenant.api_key)[0] == 202
    status, body = call("PUT", "/admin/v1/switches", tokens["operator"],
                        {"resource_class": "video-standard", "open": False, "reason": "incident"})
    assert status == 200 and body["open"] is False, body
    status, body = generate(tenant.api_key)
    assert (status, body["error"], body["decision"]) == (403, "REJECTED", "REJECT_RESOURCE_CLASS_DISABLED")
    status, body = call("GET", "/admin/v1/switches", tokens["viewer"])
    assert {x["switch"]: x["open"] for x in body["items"]}["resource_class:video-standard"] is False
    status, body = call("PUT", "/admin/v1/switches", tokens["operator"], {"lane": "PAID_SHARED", "resource_class": "video-4k",
                                                                         "open": False, "reason": "x"})
    assert status == 422
    status, _ = call("PUT", "/admin/v1/switches", tokens["finance"], {"lane": "PAID_SHARED", "open": False, "reason": "x"})
    assert status == 403
    assert call("PUT", "/admin/v1/switches", tokens["operator"],
                {"resource_class": "video-standard", "open": True, "reason": "resolved"})[0] == 200
    assert generate(tenant.api_key)[0] == 202


def test_price_versions_and_budgets_through_the_admin_api(platform, tokens, conn):
    # The configured version in force, as at any platform start: the new one supersedes it. (Made
    # here so the test does not depend on another test of the module having started a platform.)
    platform.db.transaction(lambda c: price_book.ensure_price_book(c, platform.config, platform.clock.now()))
    start = (platform.clock.now() + timedelta(hours=2)).isoformat()
    body = {"effective_from": start, "rules": {"models": {"video-model-x": {"base_amount": 25}}}, "reason": "Q3 prices"}
    assert call("POST", "/admin/v1/prices", tokens["operator"], body)[0] == 403  # prices are finance's
    status, v = call("POST", "/admin/v1/prices", tokens["finance"], body)
    assert status == 201 and v["rules"]["models"]["video-model-x"]["base_amount"] == 25, v
    prices_before = conn.execute("select count(*) as n from price_book").fetchone()["n"]
    status, e = call("POST", "/admin/v1/prices", tokens["finance"], {**body, "reason": "again"})
    assert status == 422 and "effective_from" in e["details"]["fields"], e
    status, e = call("POST", "/admin/v1/prices", tokens["finance"],
                     {**body, "effective_from": (platform.clock.now() + timedelta(hours=3)).isoformat(),
                      "rules": {"models": {"video-model-q": {}}}})
    assert status == 422 and "rules.models.video-model-q" in e["details"]["fields"]
    assert conn.execute("select count(*) as n from price_book").fetchone()["n"] == prices_before
    status, page = call("GET", "/admin/v1/prices", tokens["viewer"], query={"limit": 1})
    assert status == 200 and page["items"][0]["price_version_id"] == v["price_version_id"] and page["next_cursor"]
    status, page2 = call("GET", "/admin/v1/prices", tokens["viewer"], query={"limit": 1, "cursor": page["next_cursor"]})
    assert status == 200 and page2["items"][0]["price_version_id"] != v["price_version_id"]

    now = platform.clock.now()
    budget = {"scope_type": "GLOBAL", "scope_id": "*", "period_start": (now - timedelta(days=1)).isoformat(),
              "period_end": (now + timedelta(days=30)).isoformat(), "limit_amount": "1000.00", "currency": "USD"}
    assert call("PUT", "/admin/v1/budgets", tokens["operator"], budget)[0] == 403
    status, b = call("PUT", "/admin/v1/budgets", tokens["finance"], budget)
    assert status == 200 and b["scope_type"] == "GLOBAL", b
    status, e = call("PUT", "/admin/v1/budgets", tokens["finance"], {**budget, "scope_type": "PLANET"})
    assert status == 422 and "scope_type" in e["details"]["fields"]
    status, listed = call("GET", "/admin/v1/budgets", tokens["viewer"])
    assert status == 200 and [x["scope"] for x in listed["items"]] == ["GLOBAL:*"]
    row = conn.execute("select operator from audit_log where action = 'budget.set'").fetchone()
    assert row["operator"].startswith("op:finance-")
