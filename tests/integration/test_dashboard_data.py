"""The operations dashboard's data and its HTTP edge (issue 16 part 6, docs/admin-api.md "The
dashboard"): aivedio.admin.dashboard.snapshot's shape, that its figures move when work is admitted
and claimed, and the routes: GET /admin/v1/dashboard behind dashboard.read (bearer or the session
cookie), GET /dashboard showing only a sign-in form without a valid token, and the sign-in setting
an HttpOnly SameSite=Strict cookie (Secure over https) that logout clears."""
from __future__ import annotations

import json
import re
import uuid

import httpx
import pytest

from aivedio.admin.dashboard import AUDIT_ROWS, snapshot
from aivedio.admin.operators import create_operator, revoke_operator
from aivedio_tools.local.runtime import LocalRuntime
from aivedio.scheduling.resources import ensure_platform_pools
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import new_tenant
from tests.scheduler_support import BODY_1U, OPEN, UNCAPPED, submit

LANE_KEYS = {"lane", "capacity_units", "used_units", "utilisation_percent", "borrowable_units", "lent_units", "queued_tasks",
             "queued_units", "running_tasks", "running_units", "borrowed_units", "oldest_wait_seconds", "admission_open"}
TENANT_KEYS = {"tenant_id", "name", "service_class", "lane", "weight", "delivered_units", "claims", "entitled_units",
               "queued_tasks", "queued_units", "share", "entitled_share", "usage_ratio"}
PROVIDER_KEYS = {"provider", "running", "capacity", "utilisation_percent", "samples", "success_rate", "failure_rate",
                 "mean_latency_seconds", "breaker", "health", "submit_unknown_open", "manual_review_open", "accounts"}
SESSION = "aivedio_admin_session"


def _lane(doc: dict, lane: str) -> dict:
    return next(lane_doc for lane_doc in doc["lanes"] if lane_doc["lane"] == lane)


def _tenant_rows(doc: dict, tenant_id) -> list[dict]:
    return [t for t in doc["tenants"]["items"] if t["tenant_id"] == str(tenant_id)]


@pytest.fixture(autouse=True)
def pools(platform):
    """The lane and provider pools the scheduler claims from (LocalRuntime.start makes them too)."""
    with platform.db.connection() as c:
        ensure_platform_pools(c, platform.config)


def _operator(platform, role: str = "viewer"):
    return platform.db.transaction(lambda c: create_operator(c, actor="test", name=f"dash-{role}-{uuid.uuid4().hex[:6]}",
                                                             role=role))


def _session_cookie(http, op) -> dict[str, str]:
    """Signs in as the page's form does; the Cookie header a browser would then send."""
    r = http.post("/dashboard/session", json={"token": op.token})
    assert r.status_code == 200, r.text
    sid = r.cookies[SESSION]
    assert sid.startswith("avds_") and op.token not in r.headers["set-cookie"]
    return {"Cookie": f"{SESSION}={sid}"}


def test_snapshot_shape_and_it_moves_when_work_is_admitted_and_claimed(platform):
    before = snapshot(platform, fresh=True)
    assert set(before) >= {"generated_at", "lanes", "tenants", "providers", "submit_unknown", "manual_review",
                           "reconciliation", "outbox", "degraded", "audit"}
    assert [lane["lane"] for lane in before["lanes"]] == list(platform.config.lanes)
    for lane in before["lanes"]:
        assert set(lane) == LANE_KEYS
    assert [p["provider"] for p in before["providers"]] == [p.name for p in platform.config.providers]
    for p in before["providers"]:
        assert set(p) == PROVIDER_KEYS and p["breaker"] in ("open", "closed") and p["accounts"]
    assert {"open", "by_provider"} <= set(before["submit_unknown"]) and {"open", "by_reason"} <= set(before["manual_review"])
    recon = before["reconciliation"]
    assert {"providers", "open_items", "wallet_discrepancies_open"} <= set(recon)
    assert [r["provider"] for r in recon["providers"]] == [p.name for p in platform.config.providers]
    assert all(r["status"] == "NEVER_RUN" and not r["healthy"] for r in recon["providers"])  # never green without a run
    assert before["tenants"]["window_seconds"] > 0

    heavy = new_tenant(platform, weight=3, **OPEN, **UNCAPPED)
    light = new_tenant(platform, weight=1, **OPEN, **UNCAPPED)
    submit(platform, heavy.tenant_id, heavy.user_id, BODY_1U, n=4)
    submit(platform, light.tenant_id, light.user_id, BODY_1U, n=2)
    queued = snapshot(platform, fresh=True)
    lane, lane0 = _lane(queued, "PAID_SHARED"), _lane(before, "PAID_SHARED")
    assert lane["queued_tasks"] == lane0["queued_tasks"] + 6
    assert lane["queued_units"] > lane0["queued_units"]
    assert lane["oldest_wait_seconds"] >= 0 and queued["generated_at"] >= before["generated_at"]
    (h,) = _tenant_rows(queued, heavy.tenant_id)
    (lt,) = _tenant_rows(queued, light.tenant_id)
    assert set(h) == TENANT_KEYS and h["lane"] == "PAID_SHARED" and h["weight"] == 3 and h["queued_tasks"] == 4
    assert (h["entitled_share"], lt["entitled_share"]) == (0.75, 0.25)  # weights 3:1, both active in the lane
    assert h["delivered_units"] == 0 and h["usage_ratio"] is None

    Scheduler(platform).tick(5)
    claimed = snapshot(platform, fresh=True)
    lane = _lane(claimed, "PAID_SHARED")
    assert lane["running_tasks"] > 0 and lane["running_units"] > 0
    assert lane["queued_tasks"] + lane["running_tasks"] == lane0["queued_tasks"] + 6
    assert lane["used_units"] >= lane["running_units"] - lane["borrowed_units"]
    (h,) = _tenant_rows(claimed, heavy.tenant_id)
    assert h["delivered_units"] > 0 and 0 < h["share"] <= 1 and h["usage_ratio"] is not None
    assert sum(p["running"] for p in claimed["providers"]) == lane["running_tasks"]  # one provider slot per 720p task

    # The recent audit trail: the newest first, at most AUDIT_ROWS, no values.
    _operator(platform)
    audit = snapshot(platform, fresh=True)["audit"]
    assert 1 <= len(audit) <= AUDIT_ROWS and audit[0]["action"] == "operator.create"
    assert set(audit[0]) == {"audit_id", "operator", "action", "target", "tenant_id", "created_at"}
    assert [a["audit_id"] for a in audit] == sorted((a["audit_id"] for a in audit), reverse=True)


def test_borrowed_work_counts_in_its_own_lane_and_as_lent_by_the_enterprise_lane(make_platform):
    """PAID_SHARED full (capacity 1): its further claims run on the enterprise lane's idle capacity."""
    from aivedio.config import LaneConfig, PlatformConfig

    config = PlatformConfig(lanes={"PAID_SHARED": LaneConfig(capacity_units=1),
                                   "ENTERPRISE_RESERVED": LaneConfig(capacity_units=50, borrowable_units=10, min_headroom_units=0)})
    p = make_platform(config)
    with p.db.connection() as c:
        ensure_platform_pools(c, config)
    before = {lane["lane"]: lane for lane in snapshot(p, fresh=True)["lanes"]}
    t = new_tenant(p, **OPEN, **UNCAPPED)
    submit(p, t.tenant_id, t.user_id, BODY_1U, n=3)
    Scheduler(p).tick(5)
    after = {lane["lane"]: lane for lane in snapshot(p, fresh=True)["lanes"]}
    paid, ent = after["PAID_SHARED"], after["ENTERPRISE_RESERVED"]
    borrowed = paid["borrowed_units"] - before["PAID_SHARED"]["borrowed_units"]
    assert borrowed >= 2, (paid, ent)
    assert paid["running_units"] - before["PAID_SHARED"]["running_units"] == 3  # its own tasks, wherever they run
    assert ent["lent_units"] - before["ENTERPRISE_RESERVED"]["lent_units"] == borrowed and ent["borrowable_units"] == 10
    assert ent["used_units"] - before["ENTERPRISE_RESERVED"]["used_units"] == borrowed  # the lender's pool carries them
    assert ent["running_units"] == before["ENTERPRISE_RESERVED"]["running_units"]  # none of its own


def test_an_operators_switch_and_capacity_change_show_at_once(platform):
    from aivedio.admin import capacity
    from aivedio.policy import capacity as policy_capacity

    platform.db.transaction(lambda c: capacity.set_switch(c, platform.config, operator="op:test", open=False,
                                                          reason="maintenance", lane="BEST_EFFORT"))
    platform.db.transaction(lambda c: capacity.set_lane(c, platform.config, operator="op:test", lane="STANDARD",
                                                        reason="more room", capacity_units=700))
    policy_capacity.invalidate(platform)
    try:
        doc = snapshot(platform, fresh=True)
        assert _lane(doc, "BEST_EFFORT")["admission_open"] is False and _lane(doc, "STANDARD")["capacity_units"] == 700
        assert {a["operator"] for a in doc["audit"][:2]} == {"op:test"}  # both changes, audited
    finally:
        platform.db.transaction(lambda c: capacity.set_switch(c, platform.config, operator="op:test", open=True,
                                                              reason="done", lane="BEST_EFFORT"))
        platform.db.transaction(lambda c: capacity.set_lane(c, platform.config, operator="op:test", lane="STANDARD",
                                                            reason="back", capacity_units=600))
        policy_capacity.invalidate(platform)


def test_review_and_unknown_counts_come_from_the_attempts(platform):
    t = new_tenant(platform, **OPEN, **UNCAPPED)
    submit(platform, t.tenant_id, t.user_id, BODY_1U, n=2)
    Scheduler(platform).tick(5)
    rows = platform.db.fetchall("select attempt_id, task_id, provider from task_attempt where tenant_id = %s", (t.tenant_id,))
    assert len(rows) == 2
    unknown, review = rows
    # Straight to the states (the attempt workflow's paths there are tested elsewhere).
    platform.db.fetchone("update task_attempt set state = 'SUBMIT_UNKNOWN' where attempt_id = %s returning 1", (unknown["attempt_id"],))
    platform.db.fetchone("update task_attempt set state = 'MANUAL_REVIEW' where attempt_id = %s returning 1", (review["attempt_id"],))
    platform.db.fetchone("""update generation_task set state = 'MANUAL_REVIEW', error_code = 'RECOVERY_EXHAUSTED'
                             where task_id = %s returning 1""", (review["task_id"],))
    doc = snapshot(platform, fresh=True)
    assert doc["submit_unknown"]["open"] == 1 and doc["submit_unknown"]["by_provider"] == {unknown["provider"]: 1}
    assert doc["manual_review"]["open"] == 1
    assert doc["manual_review"]["by_reason"][0]["reason"] == "RECOVERY_EXHAUSTED"
    p = next(p for p in doc["providers"] if p["provider"] == unknown["provider"])
    assert (p["submit_unknown_open"], p["manual_review_open"]) == (1, 1)


def test_reconciliation_health_per_provider_and_the_document_is_json(platform):
    provider = platform.config.providers[0].name
    run = platform.db.fetchone(
        """insert into reconciliation_run (provider, billing_period, source_object_key, source_checksum, status, finished_at)
           values (%s, daterange('2026-11-29', '2026-11-30'), 'k', %s, 'COMPLETE', now()) returning run_id""",
        (provider, uuid.uuid4().hex))["run_id"]
    doc = snapshot(platform, fresh=True)
    (r,) = [r for r in doc["reconciliation"]["providers"] if r["provider"] == provider]
    assert (r["status"], r["billing_date"], r["open_items"], r["healthy"]) == ("COMPLETE", "2026-11-29", 0, True)

    platform.db.fetchone("""insert into reconciliation_item (run_id, discrepancy_type, currency, provider, billing_date, item_key)
                            values (%s, 'MISSING_INTERNAL', 'USD', %s, '2026-11-29', %s) returning 1""",
                         (run, provider, f"MISSING_INTERNAL:line:{uuid.uuid4().hex}"))
    # A later day's INCOMPLETE run is the latest: never green, whatever came before.
    platform.db.fetchone(
        """insert into reconciliation_run (provider, billing_period, source_object_key, source_checksum, status,
                                           incomplete_reasons)
           values (%s, daterange('2026-11-30', '2026-12-01'), 'k', %s, 'INCOMPLETE', '["source empty"]') returning 1""",
        (provider, uuid.uuid4().hex))
    doc = snapshot(platform, fresh=True)
    json.dumps(doc)  # every value is JSON as it stands (dates included)
    (r,) = [r for r in doc["reconciliation"]["providers"] if r["provider"] == provider]
    assert (r["status"], r["billing_date"], r["incomplete_reasons"], r["healthy"]) == (
        "INCOMPLETE", "2026-11-30", ["source empty"], False)
    assert (r["open_items"], r["oldest_open_day"]) == (1, "2026-11-29") and doc["reconciliation"]["open_items"] >= 1


@pytest.fixture
def http(platform):
    rt = LocalRuntime(platform, port=0, loops=[]).start()
    try:
        with httpx.Client(base_url=rt.base_url, timeout=30, follow_redirects=False) as client:
            yield client
    finally:
        rt.stop()


def test_the_json_needs_an_operator_token_or_the_session_cookie(platform, http):
    op = _operator(platform)
    tenant = new_tenant(platform)
    assert http.get("/admin/v1/dashboard").status_code == 401
    assert http.get("/admin/v1/dashboard", headers={"Authorization": "Bearer avop_nope"}).json()["error"] == "UNAUTHENTICATED"
    r = http.get("/admin/v1/dashboard", headers={"Authorization": f"Bearer {tenant.api_key}"})
    assert r.status_code == 403 and r.json()["error"] == "FORBIDDEN"

    r = http.get("/admin/v1/dashboard", headers={"Authorization": f"Bearer {op.token}"})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["viewer"] == {"name": op.name, "role": "viewer"} and doc["lanes"] and "generated_at" in doc
    assert r.headers["cache-control"] == "no-store"
    cookie = _session_cookie(http, op)
    r = http.get("/admin/v1/dashboard", headers=cookie)
    assert r.status_code == 200 and r.json()["viewer"]["name"] == op.name
    assert http.get("/admin/v1/dashboard", headers={"Cookie": f"{SESSION}={op.token}"}).status_code == 401  # a token is no session

    platform.db.transaction(lambda c: revoke_operator(c, actor="test", operator_id=op.operator_id))
    assert http.get("/admin/v1/dashboard", headers=cookie).status_code == 401


@pytest.mark.parametrize("role", ["viewer", "operator", "finance", "admin"])
def test_every_role_may_read_the_dashboard(platform, http, role):
    op = _operator(platform, role)
    r = http.get("/admin/v1/dashboard", headers={"Authorization": f"Bearer {op.token}"})
    assert r.status_code == 200 and r.json()["viewer"]["role"] == role
    assert http.get("/dashboard", headers={"Authorization": f"Bearer {op.token}"}).status_code == 200


def test_the_json_route_is_in_the_admin_openapi_and_the_pages_are_not(http):
    paths = http.get("/admin/v1/openapi.json").json()["paths"]
    assert "get" in paths["/admin/v1/dashboard"]
    assert not [p for p in paths if p.startswith("/dashboard")]


def test_the_page_shows_only_a_sign_in_form_without_a_valid_token(platform, http):
    op = _operator(platform)
    tenant = new_tenant(platform)
    r = http.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert 'id="signin"' in r.text and 'name="token"' in r.text
    assert 'id="lanes"' not in r.text and "dashboard.js" not in r.text  # no data, no code that fetches it
    assert "default-src 'self'" in r.headers["content-security-policy"]

    r = http.get("/dashboard", headers={"Cookie": f"{SESSION}=avop_unknown"})
    assert r.status_code == 401 and 'id="signin"' in r.text and f"{SESSION}=;" in r.headers["set-cookie"]  # stale cookie dropped
    r = http.get("/dashboard", headers={"Authorization": f"Bearer {tenant.api_key}"})
    assert r.status_code == 403 and 'id="signin"' in r.text and 'id="lanes"' not in r.text

    r = http.get("/dashboard", headers={"Cookie": f"{SESSION}={op.token}"})  # the token itself is no session
    assert r.status_code == 401 and 'id="signin"' in r.text and 'id="lanes"' not in r.text
    for headers in ({"Authorization": f"Bearer {op.token}"}, _session_cookie(http, op)):
        r = http.get("/dashboard", headers=headers)
        assert r.status_code == 200 and 'id="lanes"' in r.text and 'id="signin"' not in r.text
        assert "default-src 'self'" in r.headers["content-security-policy"]
        assert not re.search(r"<script(?![^>]*\bsrc=)", r.text)  # no inline script
    js = http.get("/dashboard/assets/dashboard.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("application/javascript")
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write", js.text) and "credentials: \"same-origin\"" in js.text
    assert http.get("/dashboard/assets/dashboard.css").status_code == 200
    assert http.get("/dashboard/assets/other.js").status_code == 404


def test_sign_in_sets_an_httponly_strict_cookie_and_logout_ends_the_session(platform, http):
    op = _operator(platform)
    r = http.post("/dashboard/session", data={"token": op.token})
    assert r.status_code == 303 and r.headers["location"] == "/dashboard"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{SESSION}=avds_") and op.token not in cookie  # a session id, never the token
    session = {"Cookie": cookie.split(";", 1)[0]}
    http.cookies.clear()  # the next sign-ins come from other browsers: one that sends this cookie ends its session
    attrs = {a.strip().lower() for a in cookie.split(";")[1:]}
    assert {"httponly", "samesite=strict", "path=/"} <= attrs and "secure" not in attrs  # plain http here

    r = http.post("/dashboard/session", data={"token": op.token}, headers={"X-Forwarded-Proto": "https"})
    assert "secure" in {a.strip().lower() for a in r.headers["set-cookie"].split(";")}
    http.cookies.clear()

    r = http.post("/dashboard/session", json={"token": op.token})
    assert r.status_code == 200 and r.json() == {"signed_in": True, "operator": op.name, "role": "viewer"}
    assert r.headers["set-cookie"].startswith(f"{SESSION}=avds_") and op.token not in r.headers["set-cookie"]
    json_session = {"Cookie": r.headers["set-cookie"].split(";", 1)[0]}
    assert session != json_session  # each sign-in is its own session

    deep = {"content": "[" * 30_000 + "]" * 30_000, "headers": {"Content-Type": "application/json"}}  # past json's depth
    for bad in ({"data": {"token": "avop_wrong"}}, {"data": {}}, {"json": {"token": "avop_wrong"}}, {"json": ["x"]}, deep):
        r = http.post("/dashboard/session", **bad)
        assert r.status_code == 401 and "set-cookie" not in r.headers, bad
    r = http.post("/dashboard/session", data={"token": "avop_wrong"})
    assert 'id="signin"' in r.text and "not accepted" in r.text
    assert 'action="/dashboard/session"' in r.text  # served from /dashboard/session, its links still lead home

    assert http.get("/admin/v1/dashboard", headers=session).status_code == 200
    r = http.post("/dashboard/logout", headers=session)
    assert r.status_code == 303 and r.headers["set-cookie"].startswith(f"{SESSION}=;") and "Max-Age=0" in r.headers["set-cookie"]
    # Signed out means signed out: the old cookie, replayed, is refused; the other session lives on.
    assert http.get("/admin/v1/dashboard", headers=session).status_code == 401
    assert http.get("/dashboard", headers=session).status_code == 401
    assert http.get("/admin/v1/dashboard", headers=json_session).status_code == 200
    assert http.post("/dashboard/logout").status_code == 303  # without a session: nothing to end, still signed out


def test_signing_in_again_ends_the_session_the_browser_held(platform, http):
    op = _operator(platform)
    first = _session_cookie(http, op)
    r = http.post("/dashboard/session", data={"token": op.token}, headers=first)
    assert r.status_code == 303
    second = {"Cookie": r.headers["set-cookie"].split(";", 1)[0]}
    assert second != first
    assert http.get("/admin/v1/dashboard", headers=first).status_code == 401
    assert http.get("/admin/v1/dashboard", headers=second).status_code == 200


def test_the_session_cookie_expires(platform, http):
    """A browser keeps the session cookie SESSION_MAX_AGE_SECONDS, and the database ends the session
    then too (tests/integration/test_operators.py)."""
    from functions.admin_api.routes.dashboard import SESSION_MAX_AGE_SECONDS

    op = _operator(platform)
    for kw in ({"data": {"token": op.token}}, {"json": {"token": op.token}}):
        cookie = http.post("/dashboard/session", **kw).headers["set-cookie"]
        attrs = {a.strip().lower() for a in cookie.split(";")[1:]}
        assert f"max-age={SESSION_MAX_AGE_SECONDS}" in attrs, cookie
    assert 3600 <= SESSION_MAX_AGE_SECONDS <= 24 * 3600


def test_a_cross_site_sign_in_is_refused_and_sets_nothing(platform, http):
    """Login CSRF: a page elsewhere must not sign the browser in (to the attacker's token)."""
    op = _operator(platform)
    host = http.base_url.netloc.decode()
    for headers in ({"Origin": "https://evil.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Origin": f"http://{host}", "Sec-Fetch-Site": "cross-site"}):
        for kw in ({"data": {"token": op.token}}, {"json": {"token": op.token}}):
            r = http.post("/dashboard/session", headers=headers, **kw)
            assert r.status_code == 403 and "set-cookie" not in r.headers, (headers, kw, r.status_code)
    r = http.post("/dashboard/session", data={"token": op.token}, headers={"Origin": "https://evil.example"})
    assert 'id="signin"' in r.text and "refused" in r.text
    # The page's own form: same origin (and what a browser says of it), and a client without either header.
    for headers in ({"Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"}, {"Origin": "null", "Sec-Fetch-Site": "same-origin"},
                    {"Sec-Fetch-Site": "none"}, {}):
        r = http.post("/dashboard/session", data={"token": op.token}, headers=headers)
        assert r.status_code == 303 and r.headers["set-cookie"].startswith(f"{SESSION}=avds_"), headers


def test_the_page_with_a_trailing_slash_redirects_to_the_page(platform, http):
    """Under /dashboard/ the script's relative data URL and the links would resolve elsewhere."""
    op = _operator(platform)
    for headers in ({}, {"Authorization": f"Bearer {op.token}"}):
        r = http.get("/dashboard/", headers=headers)
        assert r.status_code in (301, 302, 307, 308) and r.headers["location"] == "/dashboard", r.status_code
    r = http.get("/dashboard/", headers={"Authorization": f"Bearer {op.token}"}, follow_redirects=True)
    assert r.status_code == 200 and 'id="lanes"' in r.text and 'src="/dashboard/assets/dashboard.js"' in r.text


def test_what_a_tenant_typed_reaches_the_page_only_as_data(platform, http):
    """A tenant name with markup is a JSON string; the page's script writes it with textContent."""
    op = _operator(platform)
    from aivedio.admin.tenants import create_tenant

    name = f"<img src=x onerror=alert(1)>-{uuid.uuid4().hex[:6]}"
    t = create_tenant(platform, name=name, service_class="PAID_SHARED", weight=1, credits=1000,
                      policy_overrides={**OPEN, **UNCAPPED})
    submit(platform, t.tenant_id, t.user_id, BODY_1U, n=1)
    r = http.get("/admin/v1/dashboard", headers={"Authorization": f"Bearer {op.token}"})
    assert r.headers["content-type"].startswith("application/json")
    assert any(row["name"] == name for row in r.json()["tenants"]["items"])
    page = http.get("/dashboard", headers={"Authorization": f"Bearer {op.token}"}).text
    assert name not in page  # the page itself carries no data


def test_behind_an_api_gateway_stage_links_and_redirects_keep_the_stage_prefix(platform):
    """In AWS the browser sees /<stage>/dashboard (requestContext.path); the event's path has no stage."""
    from aivedio_tools.local import apigw
    from aivedio_tools.local.lambda_context import FakeLambdaContext
    from functions.admin_api.handler import lambda_handler

    op = _operator(platform)

    def call(method: str, path: str, body: bytes = b"", headers: tuple = ()) -> dict:
        event = apigw.to_event(method, path, "", [("X-Forwarded-Proto", "https"), *headers], body)
        event["requestContext"]["path"] = "/prod" + path
        return lambda_handler(event, FakeLambdaContext("aivedio-admin-api"))

    page = call("GET", "/dashboard")
    assert page["statusCode"] == 200 and 'action="/prod/dashboard/session"' in page["body"]
    assert 'href="/prod/dashboard/assets/dashboard.css"' in page["body"]
    r = call("POST", "/dashboard/session", f"token={op.token}".encode(),
             (("Content-Type", "application/x-www-form-urlencoded"),))
    headers = {k.lower(): v for k, v in (r.get("multiValueHeaders") or {}).items()}
    assert r["statusCode"] == 303 and headers["location"] == ["/prod/dashboard"]
    (cookie,) = headers["set-cookie"]
    assert cookie.startswith(f"{SESSION}=avds_") and "Secure" in cookie and "HttpOnly" in cookie
    page = call("GET", "/dashboard", headers=(("Cookie", cookie.split(";", 1)[0]),))
    assert page["statusCode"] == 200 and 'src="/prod/dashboard/assets/dashboard.js"' in page["body"]
    moved = call("GET", "/dashboard/")
    headers = {k.lower(): v for k, v in (moved.get("multiValueHeaders") or {}).items()}
    assert moved["statusCode"] == 308 and headers["location"] == ["/prod/dashboard"]
