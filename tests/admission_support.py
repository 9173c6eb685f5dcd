"""Helpers shared by the admission tests: tenants with generous limits, a client for the real
`api` handler behind the local HTTP server, and the footprint a request leaves in PostgreSQL."""
from __future__ import annotations

import uuid
from dataclasses import dataclass

import httpx
import psycopg
import pytest

from aivedio.admin.tenants import create_tenant
from aivedio.auth import Caller, issue_key
from aivedio.billing.ledger import ledger_aggregate
from aivedio_tools.local.runtime import LocalRuntime

# The contract's status for every decision code (docs/tenant-api.md, issue 3).
CONTRACT_STATUS = {
    "REJECT_USER_RATE_LIMIT": 429,
    "REJECT_TENANT_RATE_LIMIT": 429,
    "REJECT_TENANT_QUEUE_FULL": 429,
    "REJECT_USER_QUEUE_FULL": 429,
    "REJECT_LANE_QUEUE_FULL": 429,
    "REJECT_EXPECTED_WAIT_TOO_LONG": 503,
    "REJECT_COST_BUDGET": 402,
    "REJECT_INSUFFICIENT_CREDIT": 402,
    "REJECT_RESOURCE_CLASS_DISABLED": 403,
    "REJECT_PLATFORM_OVERLOADED": 503,
}

BODY = {"model": "video-model-x", "mode": "text_to_video", "prompt": "a red fox in snow", "duration_seconds": 5,
        "resolution": "720p"}
PRICE = 70  # default price book: (20 + 10 * 5 s) * 100 % * 100 %
COST_UNITS = 25  # estimated provider cost of BODY in cents: 0.05 USD/s * 5 s
# Limits high enough that only the limit a test lowers can bind.
GENEROUS = dict(user_submit_rate_per_minute=10_000, tenant_submit_rate_per_minute=10_000, cancel_rate_per_minute=10_000,
                max_user_queued_tasks=10_000, max_user_queued_units=100_000, max_queued_tasks=10_000,
                max_queued_units=100_000, max_cost_per_minute=10_000_000, max_cost_per_day=100_000_000)


@dataclass
class Tenant:
    tenant_id: uuid.UUID
    user_id: uuid.UUID
    wallet_id: uuid.UUID
    api_key: str
    project: str | None = None  # the key's project (admin api-key create)

    @property
    def caller(self) -> Caller:
        return Caller(self.tenant_id, self.user_id, "OWNER", self.project)


def new_tenant(platform, *, service_class="PAID_SHARED", credits=10_000, weight=10, account_type="PREPAID", **policy) -> Tenant:
    t = create_tenant(platform, name=f"t-{uuid.uuid4().hex[:10]}", service_class=service_class, weight=weight,
                      credits=credits, account_type=account_type, policy_overrides={**GENEROUS, **policy},
                      trusted=True)  # a test's policy may contradict itself or outgrow a small test lane on purpose
    return Tenant(t.tenant_id, t.user_id, t.wallet_id, t.api_key)


def second_user(platform, t: Tenant) -> Tenant:
    """Another user of the same tenant, with a key of its own."""
    def tx(conn):
        uid = conn.execute("insert into app_user (tenant_id, name, role) values (%s, %s, 'MEMBER') returning user_id",
                           (t.tenant_id, f"member-{uuid.uuid4().hex[:6]}")).fetchone()["user_id"]
        return Tenant(t.tenant_id, uid, t.wallet_id, issue_key(conn, t.tenant_id, uid).secret)

    return platform.db.transaction(tx)


class Api:
    def __init__(self, rt: LocalRuntime):
        self.rt = rt
        self.http = httpx.Client(base_url=rt.base_url, timeout=30)

    def submit(self, t: Tenant, body: dict | None = None, key: str | None = None) -> httpx.Response:
        return self.http.post("/v1/generations", json=BODY if body is None else body,
                              headers={"Authorization": f"Bearer {t.api_key}", "Idempotency-Key": key or uuid.uuid4().hex})

    def cancel(self, t: Tenant, task_id: str) -> httpx.Response:
        return self.http.post(f"/v1/generations/{task_id}/cancel", headers={"Authorization": f"Bearer {t.api_key}"})

    def quote(self, t: Tenant, body: dict | None = None) -> httpx.Response:
        return self.http.post("/v1/quotes", json=BODY if body is None else body, headers={"Authorization": f"Bearer {t.api_key}"})

    def wallet(self, t: Tenant) -> dict:
        r = self.http.get("/v1/wallet", headers={"Authorization": f"Bearer {t.api_key}"})
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture
def serve():
    """serve(platform) -> Api over the real `api` handler on a free port; no loops run, so the
    outbox stays as admission left it."""
    started: list[Api] = []

    def start(platform) -> Api:
        api = Api(LocalRuntime(platform, port=0, loops=[]).start())
        started.append(api)
        return api

    yield start
    for api in started:
        api.http.close()
        api.rt.stop()


def clear_cache(platform) -> None:
    """Admission caches lane stats, the outbox backlog and the price version for ~1 s per process."""
    cache = platform.extras.get("admission_cache")
    if cache is not None:
        cache.clear()


# --- what a request wrote --------------------------------------------------------------------------

def footprint(conn: psycopg.Connection, tenant_id) -> dict:
    """Everything admission could write for a tenant, counted, plus the wallet and its lots."""
    counts = {}
    for table in ("generation_task", "generation_charge", "credit_reservation", "reservation_allocation",
                  "ledger_transaction", "ledger_entry", "outbox_event", "idempotency_record"):
        counts[table] = conn.execute(f"select count(*) as n from {table} where tenant_id = %s", (tenant_id,)).fetchone()["n"]
    counts["tenant_cost_window"] = conn.execute(
        "select coalesce(sum(cost_units), 0) as n from tenant_cost_window where tenant_id = %s", (tenant_id,)).fetchone()["n"]
    w = conn.execute("""select available_amount, reserved_amount, consumed_amount, version from wallet_account
                         where tenant_id = %s""", (tenant_id,)).fetchone()
    lots = conn.execute("select lot_id, remaining_amount, reserved_amount from credit_lot where tenant_id = %s order by lot_id",
                        (tenant_id,)).fetchall()
    return {"counts": counts, "wallet": dict(w), "lots": [dict(lot) for lot in lots]}


def assert_rejected(r: httpx.Response, decision: str, conn, tenant_id, before: dict) -> dict:
    """The contract's status and body for `decision`, and nothing written by the request."""
    assert r.status_code == CONTRACT_STATUS[decision], (r.status_code, r.text)
    body = r.json()
    assert body["error"] == "REJECTED" and body["decision"] == decision, body
    assert isinstance(body["message"], str) and body["message"]
    assert footprint(conn, tenant_id) == before, f"{decision} wrote something"
    return body


def accepted(r: httpx.Response) -> dict:
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["state"] == "QUEUED" and body["decision"] in ("ACCEPTED", "ACCEPTED_BEST_EFFORT")
    return body


def wallet_row(conn, tenant_id) -> dict:
    return conn.execute("select * from wallet_account where tenant_id = %s", (tenant_id,)).fetchone()


def assert_wallet_matches_ledger(conn, tenant_id) -> None:
    w = wallet_row(conn, tenant_id)
    agg = ledger_aggregate(conn, w["wallet_id"])
    assert (w["available_amount"], w["reserved_amount"], w["consumed_amount"]) == (
        agg.get("AVAILABLE", 0), agg.get("RESERVED", 0), agg.get("CONSUMED", 0))


