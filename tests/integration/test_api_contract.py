"""The tenant API against its contract (docs/tenant-api.md), over real HTTP: the real
`api` handler behind a LocalRuntime, on the module's PostgreSQL database and Redis.

Every response a test reads is also checked against /openapi.json: its status must be documented
for that operation, and its body must match the documented schema."""
from __future__ import annotations

import json
import re
import uuid
from datetime import datetime

import httpx
import jsonschema_rs
import pytest

from aivedio.admin.tenants import create_tenant
from aivedio.config import PlatformConfig, ProviderConfig, Settings
from aivedio.context import build_platform
from aivedio_tools.local.runtime import LocalRuntime

# The default provider offers video-model-x up to 4k and 60 s; a second one offers a smaller model,
# so "a duration or resolution the model can't do" has a model to be said of.
CONFIG = PlatformConfig(providers=[
    ProviderConfig(name="provider-a"),
    ProviderConfig(name="provider-lite", models=["video-model-lite"], max_resolution="720p", max_duration_seconds=10),
])

BODY = {"model": "video-model-x", "mode": "text_to_video", "prompt": "a red fox in snow",
        "duration_seconds": 5, "resolution": "720p", "with_audio": False, "interactive": True}

GENEROUS = dict(user_submit_rate_per_minute=100_000, tenant_submit_rate_per_minute=100_000, cancel_rate_per_minute=100_000,
                max_user_queued_tasks=100_000, max_user_queued_units=10_000_000, max_queued_tasks=100_000,
                max_queued_units=10_000_000, max_cost_per_minute=10**12, max_cost_per_day=10**12, max_wait_seconds=86_400)

WRITE_TABLES = ("generation_task", "ledger_transaction", "credit_reservation", "outbox_event", "idempotency_record")

# (method, OpenAPI path) of every tenant route in the contract.
CONTRACT_OPERATIONS = [
    ("post", "/v1/generations"),
    ("get", "/v1/generations"),
    ("get", "/v1/generations/{task_id}"),
    ("post", "/v1/generations/{task_id}/cancel"),
    ("post", "/v1/quotes"),
    ("get", "/v1/wallet"),
    ("get", "/v1/wallet/ledger"),
]


# --- fixtures and helpers ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rt(db_url, redis_url):
    """One runtime for the module (each test makes its own tenants). No loops: without the relay,
    outbox rows stay as admission wrote them, and counting them means something."""
    from tests.conftest import TEST_HOME, drop_redis_prefix

    prefix = f"t{uuid.uuid4().hex[:10]}"
    platform = build_platform(Settings(database_url=db_url, redis_url=redis_url, redis_prefix=prefix, home=TEST_HOME), CONFIG)
    rt = LocalRuntime(platform, port=0, loops=[]).start()
    yield rt
    rt.stop()
    platform.close()
    drop_redis_prefix(redis_url, prefix)


@pytest.fixture(scope="module")
def spec(rt) -> dict:
    r = httpx.get(f"{rt.base_url}/openapi.json", timeout=30)
    assert r.status_code == 200
    return r.json()


class Api:
    """An HTTP client that checks every response against the OpenAPI document."""

    def __init__(self, base_url: str, spec: dict):
        self.http = httpx.Client(base_url=base_url, timeout=30)
        self.spec = spec

    def request(self, method: str, url: str, *, key: str | None = None, op: str | None = None, **kw) -> httpx.Response:
        headers = dict(kw.pop("headers", {}) or {})
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        r = self.http.request(method, url, headers=headers, **kw)
        assert r.status_code < 500, f"{method} {url} -> {r.status_code} {r.text}"
        assert_documented(self.spec, method.lower(), op or _template(url), r)
        return r

    def get(self, url, **kw):
        return self.request("GET", url, **kw)

    def post(self, url, **kw):
        return self.request("POST", url, **kw)

    def submit(self, key: str, body: dict | None = None, idem: str | None = "", **kw) -> httpx.Response:
        headers = dict(kw.pop("headers", {}) or {})
        if idem is not None:
            headers["Idempotency-Key"] = idem or f"k-{uuid.uuid4()}"
        return self.post("/v1/generations", key=key, json=BODY if body is None else body, headers=headers, **kw)

    def close(self):
        self.http.close()


@pytest.fixture(scope="module")
def api(rt, spec):
    a = Api(rt.base_url, spec)
    yield a
    a.close()


def _template(url: str) -> str:
    path = url.split("?", 1)[0]
    if m := re.fullmatch(r"/v1/generations/([^/]+)/cancel", path):
        return "/v1/generations/{task_id}/cancel"
    if path.startswith("/v1/generations/") and m is None:
        return "/v1/generations/{task_id}"
    return path


def assert_documented(spec: dict, method: str, path: str, r: httpx.Response) -> None:
    op = spec["paths"].get(path, {}).get(method)
    if op is None:
        return  # not an operation of the document (e.g. an unknown path)
    responses = op["responses"]
    assert str(r.status_code) in responses, f"{method.upper()} {path}: status {r.status_code} is not documented ({sorted(responses)})"
    content = responses[str(r.status_code)].get("content", {})
    schema = content.get("application/json", {}).get("schema")
    assert schema is not None, f"{method.upper()} {path} {r.status_code}: no JSON schema documented"
    assert r.headers["content-type"].startswith("application/json")
    validator = jsonschema_rs.Draft202012Validator({**schema, "components": spec["components"]})
    errors = [f"{e.instance_path}: {e.message}" for e in validator.iter_errors(r.json())]
    assert not errors, f"{method.upper()} {path} {r.status_code} does not match its schema: {errors}\n{r.text}"


def assert_error(r: httpx.Response, status: int, code: str, field: str | None = None) -> dict:
    assert r.status_code == status, r.text
    doc = r.json()
    assert {"error", "message", "details"} <= set(doc), doc
    assert doc["error"] == code, doc
    assert isinstance(doc["message"], str) and doc["message"]
    assert isinstance(doc["details"], dict)
    if field is not None:
        fields = doc["details"]["fields"]
        assert field in fields, f"{field} not named in {fields}"
        assert isinstance(doc["details"]["errors"], list) and doc["details"]["errors"]
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in fields.items())
    return doc


def new_tenant(platform, service_class: str = "PAID_SHARED", credits: int = 1_000_000, **policy):
    return create_tenant(platform, name=f"t-{uuid.uuid4().hex[:12]}", service_class=service_class, weight=10,
                         credits=credits, policy_overrides={**GENEROUS, **policy})


@pytest.fixture
def tenant(rt):
    return new_tenant(rt.platform)


def counts(conn) -> dict[str, int]:
    return {t: conn.execute(f"select count(*) as n from {t}").fetchone()["n"] for t in WRITE_TABLES}


def is_uuid(s: str) -> bool:
    try:
        uuid.UUID(s)
        return True
    except (TypeError, ValueError):
        return False


# --- the document --------------------------------------------------------------------------------

def test_openapi_is_3_1_and_lists_every_contract_path(api, spec):
    assert spec["openapi"].startswith("3.1")
    for method, path in CONTRACT_OPERATIONS:
        op = spec["paths"].get(path, {}).get(method)
        assert op is not None, f"{method.upper()} {path} missing from /openapi.json"
        assert op.get("security") == [{"bearerAuth": []}], f"{method.upper()} {path} does not declare bearer auth"
        for status in ("401", "413", "422"):
            assert status in op["responses"], f"{method.upper()} {path} does not document {status}"
    idem = [p for p in spec["paths"]["/v1/generations"]["post"]["parameters"] if p["name"].lower() == "idempotency-key"]
    assert idem and idem[0]["in"] == "header" and idem[0]["required"] is True
    assert spec["components"]["securitySchemes"]["bearerAuth"]["scheme"].lower() == "bearer"


# --- every route ---------------------------------------------------------------------------------

def test_create_accepts_with_the_contract_fields_and_ignores_client_prices(api, tenant, conn):
    before = counts(conn)
    body = {**BODY, "priority": 0, "price": 1, "queue_class": "ENTERPRISE_RESERVED", "weight": 1000}
    r = api.submit(tenant.api_key, body)
    assert r.status_code == 202, r.text
    doc = r.json()
    assert is_uuid(doc["task_id"]) and doc["state"] == "QUEUED" and doc["decision"] == "ACCEPTED"
    assert doc["queue_class"] == "PAID_SHARED"  # derived from the tenant's contract, not the body
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["estimated_start_at"])
    assert doc["queue_position_level"] in ("LOW", "MEDIUM", "HIGH")
    q = doc["quote"]
    assert is_uuid(q["price_version_id"]) and q["unit"] == "CREDIT" and 0 < q["quoted_amount"] <= q["max_reserve_amount"]
    quoted = api.post("/v1/quotes", key=tenant.api_key, json=BODY).json()
    assert (quoted["quoted_amount"], quoted["max_reserve_amount"]) == (q["quoted_amount"], q["max_reserve_amount"])

    after = counts(conn)
    assert {t: after[t] - before[t] for t in WRITE_TABLES} == {
        "generation_task": 1, "ledger_transaction": 1, "credit_reservation": 1, "outbox_event": 1, "idempotency_record": 1}
    task = conn.execute("select * from generation_task where task_id = %s", (doc["task_id"],)).fetchone()
    assert task["tenant_id"] == tenant.tenant_id and task["state"] == "QUEUED" and task["queue_class"] == "PAID_SHARED"
    assert conn.execute("select event_type from outbox_event where aggregate_id = %s", (doc["task_id"],)).fetchone()["event_type"] == "TaskQueued"


def test_get_returns_the_task_view(api, tenant):
    created = api.submit(tenant.api_key).json()
    r = api.get(f"/v1/generations/{created['task_id']}", key=tenant.api_key)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["task_id"] == created["task_id"] and doc["state"] == "QUEUED" and doc["queue_class"] == "PAID_SHARED"
    assert datetime.fromisoformat(doc["created_at"].replace("Z", "+00:00"))
    assert doc["started_at"] is None and doc["finished_at"] is None
    assert doc["attempts"] == [] and doc["outputs"] == []
    assert doc["charge"]["quoted_amount"] == created["quote"]["quoted_amount"]
    assert doc["charge"]["reserved_amount"] == created["quote"]["max_reserve_amount"]
    assert doc["charge"]["final_charge_amount"] is None
    assert "error" not in doc or doc["error"] is None


def test_list_is_newest_first_with_cursor_pagination_and_a_state_filter(api, tenant):
    ids = [api.submit(tenant.api_key).json()["task_id"] for _ in range(5)]
    for t in ids[1:3]:
        assert api.post(f"/v1/generations/{t}/cancel", key=tenant.api_key).json()["state"] == "CANCELLED"

    seen, cursor, pages = [], None, 0
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = api.get("/v1/generations", key=tenant.api_key, params=params)
        assert page.status_code == 200, page.text
        doc = page.json()
        assert len(doc["items"]) <= 2
        seen += [i["task_id"] for i in doc["items"]]
        pages += 1
        cursor = doc["next_cursor"]
        if cursor is None:
            break
        assert pages < 10
    assert seen == list(reversed(ids)) and pages == 3

    item = api.get("/v1/generations", key=tenant.api_key, params={"limit": 1}).json()["items"][0]
    assert {"task_id", "state", "queue_class", "created_at"} <= set(item)

    cancelled = api.get("/v1/generations", key=tenant.api_key, params={"state": "CANCELLED"}).json()
    assert [i["task_id"] for i in cancelled["items"]] == [ids[2], ids[1]] and cancelled["next_cursor"] is None
    assert all(i["state"] == "CANCELLED" for i in cancelled["items"])
    queued = api.get("/v1/generations", key=tenant.api_key, params={"state": "QUEUED", "limit": 100}).json()
    assert [i["task_id"] for i in queued["items"]] == [ids[4], ids[3], ids[0]]
    # the filter and the cursor together
    first = api.get("/v1/generations", key=tenant.api_key, params={"state": "QUEUED", "limit": 2}).json()
    rest = api.get("/v1/generations", key=tenant.api_key, params={"state": "QUEUED", "limit": 2, "cursor": first["next_cursor"]}).json()
    assert [i["task_id"] for i in first["items"] + rest["items"]] == [ids[4], ids[3], ids[0]] and rest["next_cursor"] is None


def test_list_sees_only_the_callers_tasks(api, rt, tenant):
    mine = api.submit(tenant.api_key).json()["task_id"]
    other = new_tenant(rt.platform)
    theirs = api.submit(other.api_key).json()["task_id"]
    listed = [i["task_id"] for i in api.get("/v1/generations", key=tenant.api_key, params={"limit": 100}).json()["items"]]
    assert mine in listed and theirs not in listed


@pytest.mark.parametrize("params, field", [
    ({"state": "NOT_A_STATE"}, "query.state"),
    ({"state": "queued"}, "query.state"),
    ({"cursor": "not-a-cursor"}, "query.cursor"),
    ({"cursor": "%%%"}, "query.cursor"),
    ({"cursor": "MjAyNi0wMS0wMVQwMDowMDowMHxub3QtYS11dWlk"}, "query.cursor"),  # base64 of "2026-01-01T00:00:00|not-a-uuid"
    ({"limit": 0}, "query.limit"),
    ({"limit": 101}, "query.limit"),
    ({"limit": -1}, "query.limit"),
    ({"limit": "ten"}, "query.limit"),
    ({"limit": "99999999999999999999999999999"}, "query.limit"),
    ({"limit": "1.5"}, "query.limit"),
])
def test_list_rejects_bad_query_parameters_with_their_path(api, tenant, params, field):
    assert_error(api.get("/v1/generations", key=tenant.api_key, params=params), 422, "VALIDATION_ERROR", field)


@pytest.mark.parametrize("params, field", [
    ({"cursor": "bm9wZQ=="}, "query.cursor"),
    ({"limit": 0}, "query.limit"),
    ({"limit": "2147483648"}, "query.limit"),
])
def test_ledger_rejects_bad_query_parameters_with_their_path(api, tenant, params, field):
    assert_error(api.get("/v1/wallet/ledger", key=tenant.api_key, params=params), 422, "VALIDATION_ERROR", field)


def test_cancel_before_dispatch_releases_the_reservation(api, tenant, conn):
    created = api.submit(tenant.api_key).json()
    reserved = created["quote"]["max_reserve_amount"]
    w = api.get("/v1/wallet", key=tenant.api_key).json()
    assert w["reserved_amount"] == reserved and w["available_amount"] == 1_000_000 - reserved

    r = api.post(f"/v1/generations/{created['task_id']}/cancel", key=tenant.api_key)
    assert r.status_code == 202, r.text
    assert r.json() == {"task_id": created["task_id"], "state": "CANCELLED"}
    w = api.get("/v1/wallet", key=tenant.api_key).json()
    assert w["reserved_amount"] == 0 and w["available_amount"] == 1_000_000
    task = api.get(f"/v1/generations/{created['task_id']}", key=tenant.api_key).json()
    assert task["state"] == "CANCELLED" and task["finished_at"] is not None

    again = api.post(f"/v1/generations/{created['task_id']}/cancel", key=tenant.api_key)
    doc = assert_error(again, 409, "TASK_TERMINAL")
    assert doc["details"]["state"] == "CANCELLED"
    assert conn.execute("select count(*) as n from ledger_transaction where task_id = %s and event_type = 'RELEASE'",
                        (created["task_id"],)).fetchone()["n"] == 1


def test_quote_returns_the_quote_and_writes_nothing(api, tenant, conn):
    before = counts(conn)
    r = api.post("/v1/quotes", key=tenant.api_key, json={**BODY, "resolution": "1080p", "price": 0})
    assert r.status_code == 200, r.text
    q = r.json()
    assert is_uuid(q["price_version_id"]) and q["unit"] == "CREDIT" and 0 < q["quoted_amount"] <= q["max_reserve_amount"]
    assert q["charge_policy_code"] and q["queue_class"] == "PAID_SHARED" and q["fairness_units"] >= 1
    assert counts(conn) == before
    assert api.get("/v1/wallet", key=tenant.api_key).json()["reserved_amount"] == 0


def test_wallet_shows_balances_and_lots(api, tenant):
    w = api.get("/v1/wallet", key=tenant.api_key)
    assert w.status_code == 200, w.text
    doc = w.json()
    assert doc["wallet_id"] == str(tenant.wallet_id) and doc["account_type"] == "PREPAID" and doc["unit"] == "CREDIT"
    assert (doc["available_amount"], doc["reserved_amount"], doc["consumed_amount"], doc["credit_limit_amount"]) == (1_000_000, 0, 0, 0)
    assert len(doc["lots"]) == 1
    lot = doc["lots"][0]
    assert is_uuid(lot["lot_id"]) and lot["kind"] == "PAID" and lot["remaining_amount"] == 1_000_000 and lot["expires_at"] is None


def test_ledger_is_newest_first_with_entries_and_a_cursor(api, tenant):
    tasks = [api.submit(tenant.api_key).json()["task_id"] for _ in range(4)]
    seen, cursor = [], None
    for _ in range(10):
        doc = api.get("/v1/wallet/ledger", key=tenant.api_key, params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        assert len(doc["items"]) <= 2
        seen += doc["items"]
        cursor = doc["next_cursor"]
        if cursor is None:
            break
    assert [t["event_type"] for t in seen] == ["RESERVE"] * 4 + ["GRANT"]
    assert [t["task_id"] for t in seen[:4]] == list(reversed(tasks))
    assert len({t["ledger_txn_id"] for t in seen}) == 5
    for t in seen:
        assert t["entries"] and sum(e["amount_delta"] for e in t["entries"]) == 0  # double entry
    reserve = {e["bucket"]: e["amount_delta"] for e in seen[0]["entries"]}
    assert reserve["AVAILABLE"] < 0 and reserve["RESERVED"] == -reserve["AVAILABLE"]


# --- authentication and tenancy ------------------------------------------------------------------

ROUTE_CALLS = [
    ("POST", "/v1/generations", {"json": BODY, "headers": {"Idempotency-Key": "k1"}}),
    ("GET", "/v1/generations", {}),
    ("GET", f"/v1/generations/{uuid.uuid4()}", {}),
    ("POST", f"/v1/generations/{uuid.uuid4()}/cancel", {}),
    ("POST", "/v1/quotes", {"json": BODY}),
    ("GET", "/v1/wallet", {}),
    ("GET", "/v1/wallet/ledger", {}),
]


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer av_not-a-key", "Bearer nope", "Basic dXNlcjpwYXNz",
                                           "bearer av_x", "Bearer " + "a" * 5000])
@pytest.mark.parametrize("method, url, kw", ROUTE_CALLS, ids=[f"{m} {u.split('/')[2]}" for m, u, _ in ROUTE_CALLS])
def test_a_missing_or_unknown_key_is_401(api, tenant, conn, method, url, kw, authorization):
    before = counts(conn)
    headers = dict(kw.get("headers", {}))
    if authorization is not None:
        headers["Authorization"] = authorization
    r = api.request(method, url, **{**kw, "headers": headers})
    assert_error(r, 401, "UNAUTHENTICATED")
    assert counts(conn) == before


def test_a_revoked_key_is_401(api, tenant, conn):
    conn.execute("update api_key set revoked_at = now() where tenant_id = %s", (tenant.tenant_id,))
    assert_error(api.get("/v1/wallet", key=tenant.api_key), 401, "UNAUTHENTICATED")


def test_unauthenticated_bad_input_is_401_not_422(api, conn):
    before = counts(conn)
    r = api.post("/v1/generations", content=b"{not json", headers={"Content-Type": "application/json"})
    assert_error(r, 401, "UNAUTHENTICATED")
    assert counts(conn) == before


def test_another_tenants_task_answers_404_exactly_like_a_missing_one(api, rt, tenant, conn):
    theirs = api.submit(tenant.api_key).json()["task_id"]
    me = new_tenant(rt.platform)
    missing = str(uuid.uuid4())

    for method, suffix in (("GET", ""), ("POST", "/cancel")):
        other = api.request(method, f"/v1/generations/{theirs}{suffix}", key=me.api_key)
        absent = api.request(method, f"/v1/generations/{missing}{suffix}", key=me.api_key)
        malformed = api.request(method, f"/v1/generations/not-a-uuid{suffix}", key=me.api_key)
        assert_error(other, 404, "NOT_FOUND")
        assert other.content == absent.content == malformed.content
        assert other.headers["content-type"] == absent.headers["content-type"]
    # the owner's task is untouched
    assert conn.execute("select state from generation_task where task_id = %s", (theirs,)).fetchone()["state"] == "QUEUED"
    assert api.get(f"/v1/generations/{theirs}", key=tenant.api_key).status_code == 200


@pytest.mark.parametrize("task_id", ["x", "0" * 2000, "%00", "%2e%2e", "%F0%9F%A6%8A", "123e4567-e89b-12d3-a456-42661417400Z",
                                     "{00000000-0000-0000-0000-000000000000}"])
def test_a_task_id_that_is_not_a_uuid_is_404(api, tenant, task_id):
    for method, suffix in (("GET", ""), ("POST", "/cancel")):
        r = api.request(method, f"/v1/generations/{task_id}{suffix}", key=tenant.api_key)
        assert_error(r, 404, "NOT_FOUND")


# --- idempotency ---------------------------------------------------------------------------------

def test_the_same_key_and_body_replays_the_first_response_byte_for_byte(api, tenant, conn):
    first = api.submit(tenant.api_key, idem="order-1")
    assert first.status_code == 202
    before = counts(conn)
    for body in (BODY, dict(reversed(list(BODY.items())))):  # the same body, keys in another order
        again = api.submit(tenant.api_key, body, idem="order-1")
        assert again.status_code == first.status_code
        assert again.content == first.content
        assert again.headers["content-type"] == first.headers["content-type"]
    assert counts(conn) == before


def test_the_same_key_with_another_body_is_422_key_reused(api, tenant, conn):
    first = api.submit(tenant.api_key, idem="order-2")
    assert first.status_code == 202
    before = counts(conn)
    r = api.submit(tenant.api_key, {**BODY, "duration_seconds": 6}, idem="order-2")
    assert_error(r, 422, "IDEMPOTENCY_KEY_REUSED", "header.Idempotency-Key")
    assert counts(conn) == before
    # and the first response is still what the key replays
    assert api.submit(tenant.api_key, idem="order-2").content == first.content


def test_idempotency_keys_belong_to_one_tenant(api, rt, tenant):
    other = new_tenant(rt.platform)
    a = api.submit(tenant.api_key, idem="shared-key").json()
    b = api.submit(other.api_key, idem="shared-key").json()
    assert a["task_id"] != b["task_id"]


def test_a_key_of_255_characters_is_accepted(api, tenant):
    assert api.submit(tenant.api_key, idem="k" * 255).status_code == 202


@pytest.mark.parametrize("idem", [None, "k" * 256, "k" * 5000], ids=["missing", "256", "5000"])
def test_a_missing_or_overlong_idempotency_key_is_422(api, tenant, conn, idem):
    before = counts(conn)
    r = api.submit(tenant.api_key, idem=idem)
    assert_error(r, 422, "VALIDATION_ERROR", "header.Idempotency-Key")
    assert counts(conn) == before


@pytest.mark.parametrize("raw", [b"", b" ", b"\x00abc", b"key\x7f", b"a\x01b", "\u00e9-key".encode("latin-1"), b"a\tb", b"\xff" * 10],
                         ids=["empty", "blank", "nul", "del", "ctrl", "latin1", "tab", "high-bytes"])
def test_odd_idempotency_keys_are_a_4xx_never_a_500(rt, spec, tenant, conn, raw):
    """Sent with http.client, which passes bytes that httpx refuses to put in a header."""
    before = counts(conn)
    status, body = raw_request(rt, "POST", "/v1/generations", json.dumps(BODY).encode(),
                               [("Authorization", f"Bearer {tenant.api_key}"), ("Content-Type", "application/json"),
                                ("Idempotency-Key", raw)])
    r = httpx.Response(status, content=body, headers={"content-type": "application/json"})
    assert_documented(spec, "post", "/v1/generations", r)
    if raw.strip(b" ") == b"" or any(b < 0x20 or b == 0x7f for b in raw):
        assert_error(r, 422, "VALIDATION_ERROR", "header.Idempotency-Key")
        assert counts(conn) == before
    else:
        assert status == 202, body


def raw_request(rt, method: str, path: str, body: bytes, headers: list[tuple[str, bytes | str]]) -> tuple[int, bytes]:
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(rt.base_url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        c.putrequest(method, path, skip_accept_encoding=True)
        for k, v in headers:
            c.putheader(k, v)
        c.putheader("Content-Length", str(len(body)))
        c.endheaders(body)
        resp = c.getresponse()
        return resp.status, resp.read()
    finally:
        c.close()


# --- bad input writes nothing --------------------------------------------------------------------

def _body(**changes):
    b = {**BODY, **changes}
    return {k: v for k, v in b.items() if v is not ...}


DEEP = b"[" * 60_000 + b"]" * 10
HUGE_INT = b'{"model":"video-model-x","mode":"text_to_video","duration_seconds":' + b"9" * 5000 + b',"resolution":"720p"}'

BAD_INPUT = [
    # id, request kwargs, status, code, field path
    ("not-json", {"content": b"{not json", "headers": {"Content-Type": "application/json"}}, 422, "VALIDATION_ERROR", "body"),
    ("not-utf8", {"content": b"\xff\xfe\xfd", "headers": {"Content-Type": "application/json"}}, 422, "VALIDATION_ERROR", "body"),
    ("deeply-nested", {"content": DEEP, "headers": {"Content-Type": "application/json"}}, 422, "VALIDATION_ERROR", "body"),
    ("5000-digit-int", {"content": HUGE_INT, "headers": {"Content-Type": "application/json"}}, 422, "VALIDATION_ERROR", "body"),
    ("empty-body", {"content": b"", "headers": {"Content-Type": "application/json"}}, 422, "VALIDATION_ERROR", "body"),
    ("json-array", {"json": [BODY]}, 422, "VALIDATION_ERROR", "body"),
    ("json-string", {"json": "hello"}, 422, "VALIDATION_ERROR", "body"),
    ("over-64KiB", {"json": _body(prompt="x" * (65 * 1024))}, 413, "PAYLOAD_TOO_LARGE", "body"),
    ("text-plain", {"content": json.dumps(BODY).encode(), "headers": {"Content-Type": "text/plain"}}, 415, "UNSUPPORTED_MEDIA_TYPE", "body"),
    ("form", {"content": b"model=video-model-x", "headers": {"Content-Type": "application/x-www-form-urlencoded"}}, 415, "UNSUPPORTED_MEDIA_TYPE", "body"),
    ("multipart", {"content": b"--b\r\n\r\n--b--", "headers": {"Content-Type": "multipart/form-data; boundary=b"}}, 415, "UNSUPPORTED_MEDIA_TYPE", "body"),
    ("multipart-no-boundary", {"content": b"xx", "headers": {"Content-Type": "multipart/form-data"}}, 415, "UNSUPPORTED_MEDIA_TYPE", "body"),
    ("missing-model", {"json": _body(model=...)}, 422, "VALIDATION_ERROR", "body.model"),
    ("model-int", {"json": _body(model=7)}, 422, "VALIDATION_ERROR", "body.model"),
    ("duration-string", {"json": _body(duration_seconds="5")}, 422, "VALIDATION_ERROR", "body.duration_seconds"),
    ("duration-float", {"json": _body(duration_seconds=5.5)}, 422, "VALIDATION_ERROR", "body.duration_seconds"),
    ("duration-bool", {"json": _body(duration_seconds=True)}, 422, "VALIDATION_ERROR", "body.duration_seconds"),
    ("duration-null", {"json": _body(duration_seconds=None)}, 422, "VALIDATION_ERROR", "body.duration_seconds"),
    ("duration-negative", {"json": _body(duration_seconds=-5)}, 422, "VALIDATION_ERROR", "body.duration_seconds"),
    ("duration-zero", {"json": _body(duration_seconds=0)}, 422, "VALIDATION_ERROR", "body.duration_seconds"),
    ("duration-int32", {"json": _body(duration_seconds=2**31)}, 422, "VALIDATION_ERROR", "body.duration_seconds"),
    ("duration-int64", {"json": _body(duration_seconds=2**63)}, 422, "VALIDATION_ERROR", "body.duration_seconds"),
    ("duration-huge", {"json": _body(duration_seconds=10**40)}, 422, "VALIDATION_ERROR", "body.duration_seconds"),
    ("duration-nan", {"content": json.dumps(_body(duration_seconds=float("nan"))).encode(),
                      "headers": {"Content-Type": "application/json"}}, 422, "VALIDATION_ERROR", "body.duration_seconds"),
    ("with-audio-string", {"json": _body(with_audio="yes")}, 422, "VALIDATION_ERROR", "body.with_audio"),
    ("interactive-int", {"json": _body(interactive=1)}, 422, "VALIDATION_ERROR", "body.interactive"),
    ("prompt-int", {"json": _body(prompt=5)}, 422, "VALIDATION_ERROR", "body.prompt"),
    ("prompt-nul", {"json": _body(prompt="a\x00b")}, 422, "VALIDATION_ERROR", "body.prompt"),
    ("prompt-lone-surrogate", {"content": b'{"model":"video-model-x","mode":"text_to_video","prompt":"\\ud800",'
                                          b'"duration_seconds":5,"resolution":"720p"}',
                               "headers": {"Content-Type": "application/json"}}, 422, "VALIDATION_ERROR", "body.prompt"),
    ("prompt-too-long", {"json": _body(prompt="x" * 4001)}, 422, "VALIDATION_ERROR", "body.prompt"),
    ("inputs-string", {"json": _body(inputs="s3://b/k")}, 422, "VALIDATION_ERROR", "body.inputs"),
    ("inputs-not-a-url", {"json": _body(inputs=[{"url": "not a url", "kind": "image"}])}, 422, "VALIDATION_ERROR", "body.inputs.0.url"),
    ("inputs-file-url", {"json": _body(inputs=[{"url": "file:///etc/passwd", "kind": "image"}])}, 422, "VALIDATION_ERROR", "body.inputs.0.url"),
    ("inputs-nul-url", {"json": _body(inputs=[{"url": "https://a/\x00", "kind": "image"}])}, 422, "VALIDATION_ERROR", "body.inputs.0.url"),
    ("inputs-bad-kind", {"json": _body(inputs=[{"url": "https://example.com/a.png", "kind": "pdf"}])}, 422, "VALIDATION_ERROR", "body.inputs.0.kind"),
    ("inputs-too-many", {"json": _body(inputs=[{"url": "https://example.com/a.png", "kind": "image"}] * 9)}, 422, "VALIDATION_ERROR", "body.inputs"),
    ("unknown-model", {"json": _body(model="video-model-nope")}, 422, "VALIDATION_ERROR", "body.model"),
    ("unknown-mode", {"json": _body(mode="text_to_song")}, 422, "VALIDATION_ERROR", "body.mode"),
    ("unknown-resolution", {"json": _body(resolution="8k")}, 422, "VALIDATION_ERROR", "body.resolution"),
    ("duration-model-cannot-do", {"json": _body(duration_seconds=61)}, 422, "VALIDATION_ERROR", "body.duration_seconds"),
    ("lite-duration", {"json": _body(model="video-model-lite", duration_seconds=11)}, 422, "VALIDATION_ERROR", "body.duration_seconds"),
    ("lite-resolution", {"json": _body(model="video-model-lite", resolution="1080p")}, 422, "VALIDATION_ERROR", "body.resolution"),
    ("image-mode-without-input", {"json": _body(mode="image_to_video")}, 422, "VALIDATION_ERROR", "body.inputs"),
    ("wrong-type-and-unknown-fields", {"json": _body(priority="urgent", price=-1, duration_seconds=-1)}, 422, "VALIDATION_ERROR",
     "body.duration_seconds"),
]


@pytest.mark.parametrize("path", ["/v1/generations", "/v1/quotes"])
@pytest.mark.parametrize("kw, status, code, field", [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_a_4xx_naming_the_field_and_writes_nothing(api, tenant, conn, path, kw, status, code, field):
    before = counts(conn)
    headers = {**kw.get("headers", {}), "Idempotency-Key": f"bad-{uuid.uuid4()}"}
    r = api.post(path, key=tenant.api_key, **{**kw, "headers": headers})
    assert_error(r, status, code, field)
    assert counts(conn) == before
    assert api.get("/v1/wallet", key=tenant.api_key).json()["reserved_amount"] == 0


def test_a_bad_body_with_a_reused_key_does_not_spend_the_key(api, tenant):
    assert api.submit(tenant.api_key, _body(duration_seconds=-1), idem="bad-then-good").status_code == 422
    assert api.submit(tenant.api_key, idem="bad-then-good").status_code == 202


# --- rejections ----------------------------------------------------------------------------------

def test_a_rejection_has_its_decision_and_retry_after(api, rt, conn):
    t = new_tenant(rt.platform, user_submit_rate_per_minute=1)
    assert api.submit(t.api_key).status_code == 202
    before = counts(conn)
    r = api.submit(t.api_key)
    doc = assert_error(r, 429, "REJECTED")
    assert doc["decision"] == "REJECT_USER_RATE_LIMIT"
    assert isinstance(doc["retry_after_seconds"], int) and doc["retry_after_seconds"] >= 1
    assert r.headers["Retry-After"] == str(doc["retry_after_seconds"])
    assert counts(conn) == before


def test_insufficient_credit_is_402_and_writes_nothing(api, rt, conn):
    t = new_tenant(rt.platform, credits=10)
    before = counts(conn)
    r = api.submit(t.api_key)
    doc = assert_error(r, 402, "REJECTED")
    assert doc["decision"] == "REJECT_INSUFFICIENT_CREDIT"
    if doc.get("retry_after_seconds") is None:
        assert "Retry-After" not in r.headers
    assert counts(conn) == before
    assert api.get("/v1/wallet", key=t.api_key).json()["available_amount"] == 10


def test_expensive_work_outside_the_contract_is_403(api, rt, conn):
    t = new_tenant(rt.platform, service_class="STANDARD")
    before = counts(conn)
    doc = assert_error(api.submit(t.api_key, _body(resolution="4k")), 403, "REJECTED")
    assert doc["decision"] == "REJECT_RESOURCE_CLASS_DISABLED"
    assert counts(conn) == before


def test_cancel_rate_limit_is_a_documented_429(api, rt):
    t = new_tenant(rt.platform, cancel_rate_per_minute=1)
    ids = [api.submit(t.api_key).json()["task_id"] for _ in range(2)]
    assert api.post(f"/v1/generations/{ids[0]}/cancel", key=t.api_key).status_code == 202
    r = api.post(f"/v1/generations/{ids[1]}/cancel", key=t.api_key)
    doc = assert_error(r, 429, "REJECTED")
    assert doc["decision"] == "REJECT_CANCEL_RATE_LIMIT" and r.headers["Retry-After"] == str(doc["retry_after_seconds"])
    assert api.get(f"/v1/generations/{ids[1]}", key=t.api_key).json()["state"] == "QUEUED"


# --- edges ---------------------------------------------------------------------------------------

def test_an_unknown_route_is_a_json_404(api, tenant):
    r = api.get("/v1/nothing-here", key=tenant.api_key)
    assert_error(r, 404, "NOT_FOUND")


def test_a_large_body_on_a_get_is_413_not_a_500(api, tenant):
    r = api.request("GET", "/v1/wallet", key=tenant.api_key, content=b"x" * (70 * 1024))
    assert_error(r, 413, "PAYLOAD_TOO_LARGE")


def test_a_body_on_cancel_is_ignored_or_refused_but_never_a_500(api, tenant):
    task = api.submit(tenant.api_key).json()["task_id"]
    r = api.post(f"/v1/generations/{task}/cancel", key=tenant.api_key, content=b"\xff\x00garbage",
                 headers={"Content-Type": "application/octet-stream"})
    assert r.status_code in (202, 415, 422)
