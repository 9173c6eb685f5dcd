"""The admin API (docs/admin-api.md) through its Lambda handler on the real PostgreSQL and
Redis: who gets in (401, 403, the tenant key, the admin token on the tenant API), every role
against every admin route (iterated from the app, so each route module's routes are covered as they
are added), and the tenants, keys, lanes and operations routes. One test goes through the real local
HTTP server: the tenant API and the admin API on one port."""
from __future__ import annotations

import json
import re
import uuid
from urllib.parse import urlencode

import httpx
import pytest

from aivedio import auth, outbox
from aivedio.admin import operators
from aivedio.policy import roles
from aivedio_tools.local.apigw import to_event
from aivedio_tools.local.lambda_context import FakeLambdaContext
from tests.admission_support import new_tenant

ROLES = roles.ROLES


def call(method: str, path: str, token: str | None = None, body=None, query: dict | None = None,
         headers: dict | None = None) -> tuple[int, dict | str]:
    """One request through functions/admin_api/handler.py, as API Gateway sends it."""
    from functions.admin_api.handler import lambda_handler

    hs = dict(headers or {})
    if token is not None:
        hs["Authorization"] = f"Bearer {token}"
    raw = b""
    if body is not None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        hs.setdefault("Content-Type", "application/json")
    resp = lambda_handler(to_event(method, path, urlencode(query or {}), list(hs.items()), raw),
                          FakeLambdaContext("aivedio-admin-api"))
    text = resp.get("body") or ""
    try:
        return resp["statusCode"], json.loads(text)
    except ValueError:
        return resp["statusCode"], text


def tenant_call(method: str, path: str, token: str) -> tuple[int, dict]:
    from functions.api.handler import lambda_handler

    resp = lambda_handler(to_event(method, path, "", [("Authorization", f"Bearer {token}")], b""),
                          FakeLambdaContext("aivedio-api"))
    return resp["statusCode"], json.loads(resp["body"])


def make_operator(platform, role: str, name: str | None = None) -> operators.IssuedOperator:
    name = name or f"{role}-{uuid.uuid4().hex[:8]}"
    return platform.db.transaction(lambda c: operators.create_operator(c, actor="test", name=name, role=role))


@pytest.fixture
def ops(platform) -> dict[str, operators.IssuedOperator]:
    return {role: make_operator(platform, role) for role in ROLES}


def admin_routes():
    from functions.admin_api.handler import app

    return [r for r in app._static_routes + app._dynamic_routes]


def concrete_path(rule: re.Pattern) -> str:
    """A path the rule matches: each path parameter a fresh UUID (which no row has)."""
    pattern = rule.pattern.removeprefix("^").removesuffix("$").removesuffix("/*")
    # A parameter is (?P<name>[...]+): its character class holds ")" and an escaped "]", and ends at "]+)".
    return re.sub(r"\(\?P<\w+>\[.*?\]\+\)", lambda _: str(uuid.uuid4()), pattern).replace("\\", "")


# --- who gets in ------------------------------------------------------------------------------------

def test_a_missing_or_unknown_token_is_401_and_a_tenant_key_403(platform):
    tenant = new_tenant(platform)
    status, body = call("GET", "/admin/v1/tenants")
    assert status == 401 and body["error"] == "UNAUTHENTICATED"
    for bad in ("avop_" + "x" * 43, "nonsense", ""):
        status, body = call("GET", "/admin/v1/tenants", token=bad)
        assert status == 401 and body["error"] == "UNAUTHENTICATED", bad
    status, body = call("GET", "/admin/v1/tenants", token=tenant.api_key)
    assert status == 403 and body["error"] == "FORBIDDEN"
    # The gate refuses before the body is read: an unauthenticated caller learns nothing of its shape.
    status, body = call("POST", "/admin/v1/tenants", body=b"{not json")
    assert status == 401


def test_an_admin_token_is_unknown_to_the_tenant_api(platform, ops):
    status, body = tenant_call("GET", "/v1/generations", ops["admin"].token)
    assert status == 401 and body["error"] == "UNAUTHENTICATED"


def test_a_revoked_or_rotated_token_stops_working_at_once(platform, ops):
    viewer = ops["viewer"]
    assert call("GET", "/admin/v1/tenants", token=viewer.token)[0] == 200
    rotated = platform.db.transaction(lambda c: operators.rotate_operator_token(c, actor="test", operator_id=viewer.operator_id))
    assert call("GET", "/admin/v1/tenants", token=viewer.token)[0] == 401
    assert call("GET", "/admin/v1/tenants", token=rotated.token)[0] == 200
    platform.db.transaction(lambda c: operators.revoke_operator(c, actor="test", operator_id=viewer.operator_id))
    assert call("GET", "/admin/v1/tenants", token=rotated.token)[0] == 401


def test_the_session_cookie_authenticates_reads_only(platform, ops):
    from functions.admin_api.access import SESSION_COOKIE

    admin = ops["admin"]
    sid = platform.db.transaction(lambda c: operators.open_session(
        c, operators.Operator(admin.operator_id, admin.name, admin.role), admin.token, max_age_seconds=600))
    cookie = {"Cookie": f"other=1; {SESSION_COOKIE}={sid}"}
    assert call("GET", "/admin/v1/tenants", headers=cookie)[0] == 200
    # The cookie holds a session id: the operator token itself in it is unknown.
    assert call("GET", "/admin/v1/tenants", headers={"Cookie": f"{SESSION_COOKIE}={admin.token}"})[0] == 401
    # A cookie rides along on a cross-site POST; a write needs the bearer header.
    status, body = call("POST", "/admin/v1/tenants", headers=cookie,
                        body={"name": "by-cookie", "service_class": "STANDARD", "weight": 1})
    assert status == 401 and body["error"] == "UNAUTHENTICATED"


def test_openapi_is_public_and_names_the_bearer_scheme(platform):
    status, doc = call("GET", "/admin/v1/openapi.json")
    assert status == 200
    assert doc["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    assert {"get", "post"} <= set(doc["paths"]["/admin/v1/tenants"])
    assert "/admin/v1/lanes" in doc["paths"] and "/admin/v1/tenants/{tenant_id}/api-keys" in doc["paths"]


def test_an_unknown_admin_route_is_404_to_anyone(platform):
    status, body = call("GET", "/admin/v1/no-such-thing")
    assert status == 404 and body["error"] == "NOT_FOUND"


# --- every role against every route -----------------------------------------------------------------

def test_every_admin_route_declares_a_known_permission_or_is_public():
    routes = admin_routes()
    assert len(routes) >= 10
    for r in routes:
        public = getattr(r.func, "admin_public", False)
        perm = getattr(r.func, "admin_permission", None)
        assert public != bool(perm), f"{r.method} {r.rule.pattern}: exactly one of @requires or @public"
        if perm:
            assert perm in roles.ALL_PERMISSIONS, f"{r.method} {r.rule.pattern}: unknown permission {perm}"
        else:  # the sign-in and the document describing the API, nothing that reads or changes data
            assert r.rule.match("/admin/v1/openapi.json") or r.rule.pattern.startswith("^/dashboard"), r.rule.pattern


def test_a_route_without_a_permission_is_refused_as_a_programming_error(platform):
    from aws_lambda_powertools.event_handler.api_gateway import Router

    from functions.admin_api import access
    from functions._edge.resolver import ThreadLocalRestResolver

    app, router = ThreadLocalRestResolver(), Router()

    @router.get("/admin/v1/forgotten")
    def forgotten() -> dict:
        return {"leaked": True}

    app.include_router(router)
    refused = access.gate(app, to_event("GET", "/admin/v1/forgotten"))
    assert refused["statusCode"] == 500 and json.loads(refused["body"])["error"] == "INTERNAL"


def test_each_role_gets_403_exactly_where_it_lacks_the_permission_and_is_audited(platform, ops, conn):
    routes = [r for r in admin_routes() if not getattr(r.func, "admin_public", False)]
    checked = denied = tenant_denials = 0
    for r in routes:
        perm = r.func.admin_permission
        path = concrete_path(r.rule)
        assert r.rule.match(path), (r.rule.pattern, path)
        for role in ROLES:
            op = ops[role]
            body = {} if r.method in ("POST", "PUT", "PATCH") else None
            status, doc = call(r.method, path, token=op.token, body=body)
            may = roles.allowed(role, perm)
            checked += 1
            if may:
                # Neither the gate nor the core's own check refuses a role that holds the permission.
                assert status != 403, (role, r.method, path, perm, doc)
                continue
            denied += 1
            assert status == 403 and doc["error"] == "FORBIDDEN", (role, r.method, path, perm, status, doc)
            row = conn.execute(
                "select action, reason, tenant_id from audit_log where operator = %s and target = %s order by audit_id desc limit 1",
                (f"op:{op.name}", f"{r.method} {path}")).fetchone()
            assert row is not None and perm in row["action"] and row["action"].endswith("denied"), (role, r.method, path, row)
            # Filed with the tenant the path names, so that tenant's audit trail shows the denial too.
            named = r.rule.match(path).groupdict().get("tenant_id")
            assert str(row["tenant_id"]) == named if named else row["tenant_id"] is None, (r.method, path, row)
            tenant_denials += bool(named)
    assert checked == 4 * len(routes) and denied > 0 and tenant_denials > 0
    print(f"role matrix: {len(routes)} routes x {len(ROLES)} roles, {denied} denials, {tenant_denials} on a tenant's path")
    assert all(roles.allowed("admin", r.func.admin_permission) for r in routes)


# --- tenants, users, keys ------------------------------------------------------------------------------

def test_tenants_list_pages_with_an_opaque_cursor(platform, ops, conn):
    for _ in range(3):
        new_tenant(platform)
    total = conn.execute("select count(*) as n from tenant").fetchone()["n"]
    token, seen, cursor, pages = ops["viewer"].token, [], None, 0
    while True:
        status, page = call("GET", "/admin/v1/tenants", token=token, query={"limit": 2, **({"cursor": cursor} if cursor else {})})
        assert status == 200, page
        pages += 1
        assert len(page["items"]) <= 2
        for item in page["items"]:
            assert {"tenant_id", "name", "service_class", "weight", "policy_version"} <= set(item)
        seen += [i["tenant_id"] for i in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == len(set(seen)) == total and pages == -(-total // 2)
    status, body = call("GET", "/admin/v1/tenants", token=token, query={"cursor": "not-a-cursor"})
    assert status == 422 and body["error"] == "VALIDATION_ERROR"
    status, body = call("GET", "/admin/v1/tenants", token=token, query={"limit": 0})
    assert status == 422 and "query.limit" in body["details"]["fields"]


def test_tenant_user_and_key_lifecycle_and_a_revoked_key_stops_working(platform, ops, conn):
    admin = ops["admin"].token
    status, tenant = call("POST", "/admin/v1/tenants", token=admin,
                          body={"name": f"acme-{uuid.uuid4().hex[:6]}", "service_class": "PAID_SHARED", "weight": 3,
                                "credits": 500})
    assert status == 201 and {"tenant_id", "user_id", "api_key", "wallet_id"} <= set(tenant), tenant
    tid = tenant["tenant_id"]
    name = conn.execute("select name from tenant where tenant_id = %s", (tid,)).fetchone()["name"]
    status, dup = call("POST", "/admin/v1/tenants", token=admin, body={"name": name, "service_class": "PAID_SHARED", "weight": 3})
    assert status == 409 and dup["error"] == "TENANT_EXISTS"
    status, bad = call("POST", "/admin/v1/tenants", token=admin, body={"name": "x", "service_class": "STANDARD", "weight": -1})
    assert status == 422 and "body.weight" in bad["details"]["fields"], bad
    status, bad = call("POST", "/admin/v1/tenants", token=admin, body={"name": "x", "service_class": "GOLD", "weight": 1})
    assert status == 422 and "service_class" in bad["details"]["fields"], bad

    status, user = call("POST", f"/admin/v1/tenants/{tid}/users", token=admin, body={"role": "MEMBER"})
    assert status == 201 and user["api_key"].startswith("av_") and user["user_id"]
    status, key = call("POST", f"/admin/v1/tenants/{tid}/api-keys", token=admin,
                       body={"user_id": user["user_id"], "project": "film-1"})
    assert status == 201 and key["api_key"].startswith("av_") and key["project"] == "film-1"
    assert tenant_call("GET", "/v1/wallet", key["api_key"])[0] == 200

    status, listed = call("GET", f"/admin/v1/tenants/{tid}/api-keys", token=ops["viewer"].token)
    assert status == 200 and {k["key_id"] for k in listed["items"]} >= {key["key_id"], user["key_id"]}
    text = json.dumps(listed)
    assert key["api_key"] not in text and auth.hash_key(key["api_key"]) not in text and "key_hash" not in text
    assert all(k["key_prefix"] and key["api_key"].startswith(k["key_prefix"]) for k in listed["items"] if k["key_id"] == key["key_id"])

    # Another tenant's user or key reads like one that does not exist.
    other = new_tenant(platform)
    status, body = call("POST", f"/admin/v1/tenants/{other.tenant_id}/api-keys", token=admin, body={"user_id": user["user_id"]})
    assert status == 404
    status, body = call("DELETE", f"/admin/v1/api-keys/{key['key_id']}", token=admin, query={"tenant_id": str(other.tenant_id)})
    assert status == 404
    assert call("DELETE", f"/admin/v1/api-keys/{uuid.uuid4()}", token=admin)[0] == 404
    assert call("DELETE", "/admin/v1/api-keys/not-a-uuid", token=admin)[0] == 404

    status, revoked = call("DELETE", f"/admin/v1/api-keys/{key['key_id']}", token=admin)
    assert status == 200 and revoked["revoked"] is True and revoked["status"] == "REVOKED"
    status, body = tenant_call("GET", "/v1/wallet", key["api_key"])
    assert status == 401 and body["error"] == "UNAUTHENTICATED"
    status, again = call("DELETE", f"/admin/v1/api-keys/{key['key_id']}", token=admin)
    assert status == 200 and again["revoked"] is False

    status, rotated = call("POST", f"/admin/v1/api-keys/{user['key_id']}/rotate", token=admin)
    assert status == 201 and rotated["key_id"] != user["key_id"] and rotated["user_id"] == user["user_id"]
    assert tenant_call("GET", "/v1/wallet", user["api_key"])[0] == 401
    assert tenant_call("GET", "/v1/wallet", rotated["api_key"])[0] == 200

    actor = f"op:{ops['admin'].name}"
    audited = [r["action"] for r in conn.execute(
        "select action from audit_log where operator = %s and tenant_id = %s order by audit_id", (actor, tid)).fetchall()]
    assert audited == ["tenant.create", "user.create", "api_key.create", "api_key.revoke", "api_key.rotate"]
    secrets = [tenant["api_key"], user["api_key"], key["api_key"], rotated["api_key"]]
    dumped = json.dumps([dict(r) for r in conn.execute("select * from audit_log where tenant_id = %s", (tid,)).fetchall()],
                        default=str)
    assert not [s for s in secrets if s in dumped]


def test_a_tenant_is_created_only_with_a_policy_a_change_could_set(platform, ops, conn):
    """The created policy is held to the rules of a policy change (aivedio.policy.tenant_policy): out of
    bounds, contradicting caps, a reservation above the lane, a negative or wrongly typed value are
    422 naming each field, and nothing is written; a valid one is 201 and can be PATCHed after."""
    admin = ops["admin"].token
    before = conn.execute("select count(*) as n from tenant").fetchone()["n"]
    cases = [
        ({"max_running_tasks": 500, "max_queued_tasks": 10}, {"policy.max_running_tasks", "policy.max_queued_tasks"}),
        ({"reserved_units": 10**9, "max_running_units": 10**10}, {"policy.reserved_units", "policy.max_running_units"}),
        ({"max_cost_per_minute": 7, "max_cost_per_day": 3}, {"policy.max_cost_per_minute", "policy.max_cost_per_day"}),
        ({"reserved_units": 1500, "max_running_units": 2000, "max_queued_units": 20000}, {"policy.reserved_units"}),
        ({"max_running_tasks": -1}, {"policy.max_running_tasks"}),
        ({"max_wait_seconds": 2**31}, {"policy.max_wait_seconds"}),
        ({"expensive_allowed": 1}, {"policy.expensive_allowed"}),
        ({"burst_units": True}, {"policy.burst_units"}),
    ]
    for pol, fields in cases:
        status, body = call("POST", "/admin/v1/tenants", token=admin,
                            body={"name": f"bad-{uuid.uuid4().hex[:6]}", "service_class": "PAID_SHARED", "weight": 5,
                                  "policy": pol})
        assert status == 422 and body["error"] == "VALIDATION_ERROR", (pol, status, body)
        assert set(body["details"]["fields"]) >= fields, (pol, body)
    assert conn.execute("select count(*) as n from tenant").fetchone()["n"] == before

    status, made = call("POST", "/admin/v1/tenants", token=admin,
                        body={"name": f"ok-{uuid.uuid4().hex[:6]}", "service_class": "PAID_SHARED", "weight": 5,
                              "policy": {"max_running_tasks": 50, "reserved_units": 100}})
    assert status == 201, made
    status, doc = call("PATCH", f"/admin/v1/tenants/{made['tenant_id']}/policy", token=ops["operator"].token,
                       body={"changes": {"weight": 6}, "reason": "after creation"})
    assert status == 200 and doc["weight"] == 6 and doc["max_running_tasks"] == 50, doc


@pytest.mark.parametrize("service_class", ["ENTERPRISE_RESERVED", "PAID_SHARED", "STANDARD", "BEST_EFFORT"])
def test_each_class_default_policy_is_valid_and_changeable(platform, service_class):
    from aivedio.policy import tenant_policy as policy
    from aivedio.admin.tenants import create_tenant

    t = create_tenant(platform, name=f"d-{uuid.uuid4().hex[:6]}", service_class=service_class, weight=10)
    with platform.db.connection() as c:
        assert policy.validate(policy.show_policy(c, t.tenant_id), lanes=policy.lanes_in_force(platform, c)) == {}
    assert policy.change_policy(platform, operator="op:x", tenant_id=t.tenant_id, changes={"weight": 11})["weight"] == 11


def test_lanes_show_capacity_borrowable_queued_running_and_oldest_wait(platform, ops):
    status, doc = call("GET", "/admin/v1/lanes", token=ops["viewer"].token)
    assert status == 200
    lanes = {item["lane"]: item for item in doc["items"]}
    assert set(platform.config.lanes) <= set(lanes)
    for name, lc in platform.config.lanes.items():
        item = lanes[name]
        assert {"capacity_units", "borrowable_units", "queued_units", "running_units", "oldest_wait_seconds"} <= set(item)


# --- operations ------------------------------------------------------------------------------------------

def test_outbox_dead_letters_are_listed_and_redriven_as_the_operator(platform, ops, conn):
    ids = [outbox.write_event(conn, "test.admin_api", aggregate_type="test", aggregate_id=uuid.uuid4(), tenant_id=None,
                              payload={"i": i}) for i in range(2)]
    conn.execute("update outbox_event set status = 'FAILED', attempts = 9, last_error = 'boom' where event_id = any(%s)", (ids,))
    status, listed = call("GET", "/admin/v1/outbox", token=ops["viewer"].token, query={"event_type": "test.admin_api"})
    assert status == 200 and {e["event_id"] for e in listed["events"]} == {str(i) for i in ids}
    assert call("POST", "/admin/v1/outbox/redrive", token=ops["finance"].token,
                body={"reason": "x", "event_ids": [str(ids[0])]})[0] == 403
    status, done = call("POST", "/admin/v1/outbox/redrive", token=ops["operator"].token,
                        body={"reason": "consumer fixed", "event_ids": [str(ids[0])]})
    assert status == 200 and done["redriven"] == 1, done
    row = conn.execute("select operator, reason from audit_log where action = 'outbox.redrive' and target = %s",
                       (f"outbox_event:{ids[0]}",)).fetchone()
    assert row["operator"] == f"op:{ops['operator'].name}" and row["reason"] == "consumer fixed"
    status, bad = call("POST", "/admin/v1/outbox/redrive", token=ops["operator"].token, body={"event_ids": [str(ids[1])]})
    assert status == 422 and "body.reason" in bad["details"]["fields"]


def test_reviews_list_and_unknown_task(platform, ops):
    status, doc = call("GET", "/admin/v1/reviews", token=ops["viewer"].token)
    assert status == 200 and "items" in doc and "open" in doc
    status, doc = call("POST", f"/admin/v1/reviews/{uuid.uuid4()}/resolve", token=ops["operator"].token,
                       body={"action": "fail", "reason": "gone"})
    assert status == 404, doc


def test_compensation_needs_a_second_operator_and_a_self_approval_is_refused_and_audited(platform, ops, conn):
    tenant = new_tenant(platform)
    finance_b = make_operator(platform, "finance")
    case = f"INC-{uuid.uuid4().hex[:6]}"
    body = {"tenant_id": str(tenant.tenant_id), "case_id": case, "amount": 5000, "reason_code": "SERVICE_OUTAGE",
            "evidence": {"incident": "INC-1"}}
    status, opened = call("POST", "/admin/v1/compensations", token=ops["finance"].token, body=body)
    assert status == 201 and opened["state"] == "PENDING_APPROVAL" and opened["required_approvals"] == 2, opened
    path = f"/admin/v1/tenants/{tenant.tenant_id}/compensations/{case}/approve"
    status, refused = call("POST", path, token=ops["finance"].token)
    assert status == 409 and refused["error"] == "APPROVAL_REFUSED"
    row = conn.execute("select operator from audit_log where action = 'compensation.approve.refused' and target = %s",
                       (f"compensation:{case}",)).fetchone()
    assert row is not None and row["operator"] == f"op:{ops['finance'].name}"
    assert call("POST", path, token=ops["operator"].token)[0] == 403  # no finance permission
    status, one = call("POST", path, token=finance_b.token)
    assert status == 200 and one["approvals"] == [f"op:{finance_b.name}"] and one["state"] == "PENDING_APPROVAL"
    status, applied = call("POST", path, token=ops["admin"].token)
    assert status == 200 and applied["state"] == "APPLIED", applied


def test_refund_of_an_unknown_task_is_404(platform, ops):
    tenant = new_tenant(platform)
    status, doc = call("POST", "/admin/v1/refunds", token=ops["finance"].token,
                       body={"tenant_id": str(tenant.tenant_id), "task_id": str(uuid.uuid4()), "amount": 10,
                             "reason": "late", "request_key": "r-1"})
    assert status == 404 and doc["error"] == "TASK_NOT_FOUND", doc


def test_a_wallet_is_partitioned_and_back_through_the_admin_api_audited_and_validated(platform, ops, conn):
    from aivedio.admission.models import GenerationRequest
    from aivedio.admission.service import admit
    from tests.scheduler_support import BODY_1U

    tenant = new_tenant(platform, credits=100_000)
    path = f"/admin/v1/tenants/{tenant.tenant_id}/wallet"
    assert call("POST", path + "/partition", token=ops["operator"].token, body={"chunk_amount": 500})[0] == 403
    status, bad = call("POST", path + "/partition", token=ops["finance"].token, body={"slots": 1, "chunk_amount": 0})
    assert status == 422, bad
    status, doc = call("POST", path + "/partition", token=ops["finance"].token,
                       body={"slots": 4, "chunk_amount": 500, "reason": "many users"})
    assert status == 200 and doc["slots"] == 4, doc
    wallet = conn.execute("select wallet_id from wallet_account where tenant_id = %s", (tenant.tenant_id,)).fetchone()["wallet_id"]
    assert conn.execute("select slots from wallet_partitioning where wallet_id = %s", (wallet,)).fetchone()["slots"] == 4
    admitted = json.loads(admit(platform, tenant.caller, GenerationRequest(**BODY_1U), BODY_1U, uuid.uuid4().hex).body)
    assert admitted["decision"] == "ACCEPTED"  # the partitioned wallet admits
    status, back = call("POST", path + "/unpartition", token=ops["finance"].token, body={"reason": "done"})
    assert status == 200 and back["was_partitioned"] is True, back
    assert conn.execute("select 1 from wallet_partitioning where wallet_id = %s", (wallet,)).fetchone() is None
    actions = [r["action"] for r in conn.execute(
        "select action from audit_log where tenant_id = %s and operator = %s order by audit_id",
        (tenant.tenant_id, f"op:{ops['finance'].name}")).fetchall()]
    assert actions == ["wallet.partition", "wallet.unpartition"]
    assert call("POST", f"/admin/v1/tenants/{uuid.uuid4()}/wallet/unpartition", token=ops["finance"].token, body={})[0] == 404


# --- one port for both APIs, locally ----------------------------------------------------------------

def test_aivedio_serve_answers_the_tenant_and_the_admin_api_on_one_port(platform, ops):
    from aivedio_tools.local.runtime import LocalRuntime

    tenant = new_tenant(platform)
    rt = LocalRuntime(platform, port=0, loops=[]).start()
    try:
        with httpx.Client(base_url=rt.base_url, timeout=30) as http:
            r = http.get("/admin/v1/tenants", headers={"Authorization": f"Bearer {ops['viewer'].token}"})
            assert r.status_code == 200 and r.json()["items"] and r.headers["X-Aivedio-Worker"]
            r = http.get("/v1/wallet", headers={"Authorization": f"Bearer {tenant.api_key}"})
            assert r.status_code == 200 and r.json()["wallet_id"] == str(tenant.wallet_id)
            assert http.get("/admin/v1/openapi.json").json()["info"]["title"] == "AiVedio admin API"
            assert "/admin/v1/tenants" not in http.get("/openapi.json").json()["paths"]
            # Each API keeps its own credentials: neither token opens the other's routes.
            assert http.get("/admin/v1/tenants", headers={"Authorization": f"Bearer {tenant.api_key}"}).status_code == 403
            assert http.get("/v1/wallet", headers={"Authorization": f"Bearer {ops['admin'].token}"}).status_code == 401
            assert http.get("/administer").status_code == 404  # a prefix on a segment boundary only
    finally:
        rt.stop()
