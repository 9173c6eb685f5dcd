"""Helpers shared by the billing tests: tasks with a credit reservation and a charge snapshot made
the way admission makes them (same reserve(), same rows), terminal event payloads of the contract,
operators with roles, and the ledger invariants every billing test checks."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal

import psycopg

from aivedio.admin.tenants import create_tenant
from aivedio.billing.lots import grant_credits
from aivedio.billing.ledger import ledger_aggregate, lock_wallet
from aivedio.billing.reservations import reserve
from aivedio.config import PlatformConfig
from aivedio.pricing import price_book
from aivedio.pricing.price_book import amount_for_seconds

T0 = datetime(2026, 6, 24, 8, 0, 0, tzinfo=timezone.utc)
MODEL = "video-model-x"
PARAMS = {"model": MODEL, "mode": "text_to_video", "resolution": "720p", "with_audio": False, "duration_seconds": 5}
PRICE = 70  # 5 s at 720p under the default rules
# Operators by name, as the audit log and the money controls (another operator approves) know them.
ADMIN, SUPPORT, APPROVER_1, APPROVER_2, NOBODY = "op:admin", "op:support", "op:approver-1", "op:approver-2", "op:nobody"


@dataclass
class Wallet:
    tenant_id: uuid.UUID
    user_id: uuid.UUID
    wallet_id: uuid.UUID


def price_version(conn: psycopg.Connection, now: datetime = T0) -> uuid.UUID:
    return price_book.ensure_price_book(conn, PlatformConfig(), now)


def quote_for(seconds: int | Decimal, resolution: str = "720p") -> int:
    rules = price_book.default_rules(PlatformConfig())["models"][MODEL]
    return amount_for_seconds(rules, seconds=seconds, resolution=resolution, mode="text_to_video", with_audio=False)


def new_wallet(platform, *, credits: int = 10_000, account_type: str = "PREPAID") -> Wallet:
    t = create_tenant(platform, name=f"b-{uuid.uuid4().hex[:12]}", service_class="PAID_SHARED", weight=1, credits=credits,
                      account_type=account_type)
    return Wallet(t.tenant_id, t.user_id, t.wallet_id)


def add_lot(conn: psycopg.Connection, w: Wallet, amount: int, *, kind: str = "PROMOTIONAL", expires_at=None,
            key: str | None = None) -> uuid.UUID:
    wallet = lock_wallet(conn, w.tenant_id, w.wallet_id)
    grant_credits(conn, wallet, amount, kind=kind, business_key=key or f"grant:test:{uuid.uuid4()}", expires_at=expires_at)
    return conn.execute("select lot_id from credit_lot where wallet_id = %s order by created_at desc, lot_id limit 1",
                        (w.wallet_id,)).fetchone()["lot_id"]


def make_task(conn: psycopg.Connection, w: Wallet, *, policy: str = "SUCCESS_ONLY", seconds: int = 5,
              reserve_amount: int | None = None, quoted: int | None = None, now: datetime = T0,
              price_version_id: uuid.UUID | None = None, resolution: str = "720p") -> uuid.UUID:
    """A QUEUED task with its reservation and charge snapshot, in the caller's transaction, written
    as admission writes them. Raises InsufficientCredit / LotsExhausted like admission would."""
    pv = price_version_id or price_version(conn, now)
    quoted = quote_for(seconds, resolution) if quoted is None else quoted
    amount = quoted if reserve_amount is None else reserve_amount
    task_id = uuid.uuid4()
    params = {**PARAMS, "duration_seconds": seconds, "resolution": resolution}
    wallet = lock_wallet(conn, w.tenant_id, w.wallet_id)
    conn.execute(
        """insert into generation_task (task_id, tenant_id, user_id, queue_class, priority_band, base_priority_band, resource_class,
                                        state, model_code, fairness_units, provider_slot_units, estimated_cost_units, policy_version,
                                        estimate_version, idempotency_key, mode, duration_seconds, resolution, normalized_params,
                                        created_at, updated_at, enqueue_at, next_eligible_at)
           values (%s, %s, %s, 'PAID_SHARED', 2, 2, 'STANDARD', 'QUEUED', %s, 1, 1, 25, 1, 1, %s, 'text_to_video', %s, %s, %s,
                   %s, %s, %s, %s)""",
        (task_id, w.tenant_id, w.user_id, MODEL, f"k-{task_id}", seconds, resolution, json.dumps(params), now, now, now, now))
    reserve(conn, wallet=wallet, task_id=task_id, quoted_amount=quoted, amount=amount, price_version_id=pv,
            charge_policy_code=policy, now=now)
    conn.execute(
        """insert into generation_charge (task_id, tenant_id, price_version_id, normalized_params, quoted_amount,
                                          max_reserve_amount, charge_policy_code, created_at)
           values (%s, %s, %s, %s, %s, %s, %s, %s)""",
        (task_id, w.tenant_id, pv, json.dumps(params), quoted, max(amount, quoted), policy, now))
    return task_id


def make_attempt(conn: psycopg.Connection, w: Wallet, task_id: uuid.UUID, *, attempt_no: int = 1, provider: str = "provider-a",
                 account: str = "account-01", job_id: str | None = None, estimated: str = "0.25") -> uuid.UUID:
    row = conn.execute(
        """insert into task_attempt (task_id, tenant_id, attempt_no, provider, provider_account, provider_request_key,
                                     provider_job_id, state, model_code, estimated_cost_amount, estimated_cost_currency)
           values (%s, %s, %s, %s, %s, %s, %s, 'SUCCEEDED', %s, %s, 'USD') returning attempt_id""",
        (task_id, w.tenant_id, attempt_no, provider, account, f"{task_id}:{attempt_no}", job_id or f"job-{uuid.uuid4().hex[:12]}",
         MODEL, Decimal(estimated))).fetchone()
    return row["attempt_id"]


def terminal(task_id, tenant_id=None, *, state: str = "SUCCEEDED", stage: str = "PROVIDER_SUCCEEDED", attempt_id=None,
             provider_charged: bool | None = None, seconds: str | None = "5.0", cost: str | None = "0.25",
             currency: str = "USD", charge_id: str | None = "auto", output_seconds: int | None = None,
             job_id: str | None = None, finished_at: datetime = T0) -> dict:
    """A terminal event payload of the contract."""
    charged = provider_charged if provider_charged is not None else state == "SUCCEEDED"
    usage = None if cost is None and seconds is None else {"seconds": seconds, "cost_amount": cost, "currency": currency}
    return {"task_id": str(task_id), "tenant_id": str(tenant_id) if tenant_id else None,
            "attempt_id": str(attempt_id) if attempt_id else None, "state": state, "stage": stage,
            "provider": "provider-a", "provider_account": "account-01", "provider_job_id": job_id or f"job-{task_id}",
            "charge_id": (f"ch-{task_id}" if charged else None) if charge_id == "auto" else charge_id,
            "provider_charged": charged, "usage": usage,
            "output_seconds": output_seconds if output_seconds is not None else (5 if state == "SUCCEEDED" else 0),
            "error_code": None if state == "SUCCEEDED" else "E", "finished_at": finished_at.isoformat()}


EVENT_TYPE = {"SUCCEEDED": "TaskSucceeded", "FAILED": "TaskFailed", "CANCELLED": "TaskCancelled"}


# --- invariants ----------------------------------------------------------------------------------------

def unbalanced_transactions(conn: psycopg.Connection, wallet_id) -> int:
    return conn.execute("""select count(*) as n from (select ledger_txn_id from ledger_entry where wallet_id = %s
                                                   group by ledger_txn_id having sum(amount_delta) <> 0) u""",
                        (wallet_id,)).fetchone()["n"]


def assert_invariants(conn: psycopg.Connection, wallet_id) -> dict:
    """Every transaction sums to zero; the snapshot equals the ledger per bucket; the lots sum to the
    snapshot; every reservation has settled + released <= reserved and refunded <= settled; the
    snapshot's reserved equals the reservations' open parts. Returns the wallet row."""
    w = conn.execute("select * from wallet_account where wallet_id = %s", (wallet_id,)).fetchone()
    assert unbalanced_transactions(conn, wallet_id) == 0
    agg = ledger_aggregate(conn, wallet_id)
    assert (w["available_amount"], w["reserved_amount"], w["consumed_amount"]) == (
        agg.get("AVAILABLE", 0), agg.get("RESERVED", 0), agg.get("CONSUMED", 0)), (dict(w), agg)
    if w["account_type"] != "POSTPAID":
        lots = conn.execute("""select coalesce(sum(remaining_amount), 0)::bigint as rem, coalesce(sum(reserved_amount), 0)::bigint as res
                                 from credit_lot where wallet_id = %s""", (wallet_id,)).fetchone()
        assert lots["rem"] == w["available_amount"], (lots, dict(w))
        assert lots["res"] == w["reserved_amount"], (lots, dict(w))
    bad = conn.execute("""select count(*) as n from credit_reservation where wallet_id = %s
                            and (settled_amount + released_amount > reserved_amount or refunded_amount > settled_amount)""",
                       (wallet_id,)).fetchone()["n"]
    assert bad == 0
    open_ = conn.execute("""select coalesce(sum(reserved_amount - settled_amount - released_amount), 0)::bigint as n
                              from credit_reservation where wallet_id = %s""", (wallet_id,)).fetchone()["n"]
    assert open_ == w["reserved_amount"]
    return w


def footprint(conn: psycopg.Connection, tenant_id, wallet_id) -> dict:
    """Everything a billing operation could write for a tenant: counts per table, the wallet and its lots."""
    out = {}
    for table in ("ledger_transaction", "ledger_entry", "credit_reservation", "reservation_allocation", "settlement_allocation",
                  "refund_request", "compensation_case", "credit_lot", "outbox_event", "audit_log", "provider_cost_event",
                  "contract_budget", "media_cost_event"):
        out[table] = conn.execute(f"select count(*) as n from {table} where tenant_id = %s", (tenant_id,)).fetchone()["n"]
    out["parked"] = conn.execute("select count(*) as n from billing_parked_event where tenant_id = %s", (tenant_id,)).fetchone()["n"]
    w = conn.execute("select available_amount, reserved_amount, consumed_amount, version, frozen from wallet_account where wallet_id = %s",
                     (wallet_id,)).fetchone()
    out["wallet"] = dict(w)
    out["lots"] = [dict(r) for r in conn.execute(
        "select lot_id, remaining_amount, reserved_amount, expired_amount from credit_lot where wallet_id = %s order by lot_id",
        (wallet_id,)).fetchall()]
    out["reservations"] = [dict(r) for r in conn.execute(
        "select reservation_id, settled_amount, released_amount, refunded_amount, state from credit_reservation where wallet_id = %s "
        "order by reservation_id", (wallet_id,)).fetchall()]
    return out


class Cli:
    """The `aivedio` command line in this process, as a user types it (aivedio_tools.cli.main builds
    its parser anew on each call). `monkeypatch` is kept for the tests that set the environment."""

    def __init__(self, monkeypatch):
        from aivedio_tools import cli

        self.cli, self.monkeypatch = cli, monkeypatch

    def main(self, argv: list[str]) -> int:
        return self.cli.main(argv)
