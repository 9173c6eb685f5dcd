"""Helpers of the invoice reconciliation tests: a provider that speaks only the protocol's invoice endpoint
(`GET /v1/invoices?date=`, per account by its Bearer key) and answers what a test sets, attempts and
cost events written the way the platform writes them (aivedio.spend.costs), and invoice lines."""
from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from aivedio.spend import costs
from aivedio.config import MaintenanceService, PlatformConfig, ProviderAccount, ProviderConfig
from aivedio.providers.adapter import Usage
from tests.billing_support import make_task, new_wallet

SECRET = "whsec_c2ltLXRlc3Qtc2VjcmV0"
ACCOUNT = "account-01"
MODEL = "video-model-x"
D = date(2026, 6, 24)  # the day reconciled
NOW = datetime(2026, 6, 25, 8, 0, tzinfo=timezone.utc)  # the morning after


def at(day: date, hour: int = 10, minute: int = 0) -> datetime:
    return datetime.combine(day, time(hour, minute), timezone.utc)


class InvoiceStub:
    """answers[(account, date)] = (status, body bytes); a day nobody set answers {"lines": []}."""

    def __init__(self, keys: dict[str, str]):
        self.keys = keys  # api key -> account
        self.answers: dict[tuple[str, str], tuple[int, bytes]] = {}
        self.requests: list[tuple[str, str]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):
                url = urlsplit(self.path)
                account = stub.keys.get((self.headers.get("Authorization") or "").removeprefix("Bearer ").strip())
                day = parse_qs(url.query).get("date", [""])[0]
                if url.path != "/v1/invoices" or account is None:
                    status, body = (404 if account else 401), b'{"error": {"code": "NO"}}'
                else:
                    stub.requests.append((account, day))
                    status, body = stub.answers.get((account, day), (200, b'{"lines": []}'))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def serve(self, account: str, day: date, lines: list[dict] | None = None, *, status: int = 200,
              body: bytes | None = None) -> bytes:
        data = body if body is not None else json.dumps({"lines": lines or []}, separators=(",", ":")).encode()
        self.answers[(account, day.isoformat())] = (status, data)
        return data

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def provider_config(name: str, url: str, accounts: tuple[str, ...] = (ACCOUNT,)) -> ProviderConfig:
    return ProviderConfig(name=name, base_url=url, webhook_secret=SECRET, submit_timeout_seconds=2.0, models=[MODEL],
                          accounts=[ProviderAccount(account_id=a, api_key=f"key-{a}") for a in accounts])


def platform_config(*providers: ProviderConfig, batch_size: int | None = None) -> PlatformConfig:
    maintenance = {"invoice-reconcile": MaintenanceService(batch_size=batch_size)} if batch_size else {}
    return PlatformConfig(providers=list(providers), maintenance=maintenance)


def line(line_id: str, *, charge: str, job: str | None = None, key: str | None = None, amount: str = "0.2500",
         kind: str = "charge", currency: str = "USD", occurred: datetime | None = None, account: str = ACCOUNT,
         model: str = MODEL) -> dict:
    doc = {"line_id": line_id, "charge_id": charge, "account_id": account, "model": model, "type": kind, "amount": amount,
           "currency": currency, "occurred_at": (occurred or at(D)).isoformat().replace("+00:00", "Z")}
    if job:
        doc["job_id"] = job
    if key:
        doc["idempotency_key"] = key
    return doc


@dataclass
class Seeded:
    attempt_id: uuid.UUID
    task_id: uuid.UUID
    tenant_id: uuid.UUID
    job_id: str | None
    key: str


TERMINAL_STAGE = {"SUCCEEDED": "PROVIDER_SUCCEEDED", "FAILED": "PROVIDER_FAILED", "CANCELLED": "PROVIDER_RUNNING"}
TASK_STATES = ("DISPATCHING", "SUBMITTED", "RUNNING", "SUBMIT_UNKNOWN", "MANUAL_REVIEW", "SUCCEEDED", "FAILED", "CANCELLED")


class Seeder:
    """Tasks and attempts of one wallet, and their costs recorded as the settlement records them."""

    def __init__(self, platform, provider: str, account: str = ACCOUNT):
        self.p, self.provider, self.account = platform, provider, account
        self.wallet = new_wallet(platform, credits=1_000_000)

    def attempt(self, name: str, *, state: str = "SUCCEEDED", billable: str = "BILLABLE", job: str | None = "auto",
                cost: str | None = None, charge: str | None = "auto", currency: str = "USD", occurred: datetime | None = None,
                unknown_cost: bool = False, created: datetime | None = None, estimated: str = "0.25",
                task_state: str | None = None, stage: str | None = None) -> Seeded:
        """An attempt; with `cost`, its cost recorded from a terminal event (charge "auto" is ch-<name>, None a
        cost without a charge id: parked COST_WITHOUT_CHARGE_ID); with `unknown_cost`, a billed job whose cost was
        not reported (parked COST_UNKNOWN). The task is in `task_state` (by default the attempt's state, QUEUED for
        an attempt without a job), and the attempt ended in `stage` (by default its state's provider stage), as
        attempts.lifecycle.finish leaves them."""
        task_state = task_state or (state if state in TASK_STATES else "QUEUED")
        stage = stage or TERMINAL_STAGE.get(state)
        job_id = f"job-{name}-{uuid.uuid4().hex[:6]}" if job == "auto" else job
        key = f"{name}-{uuid.uuid4().hex[:8]}:1"
        occurred = occurred or at(D)

        def write(conn):
            task_id = make_task(conn, self.wallet)
            row = conn.execute(
                """insert into task_attempt (task_id, tenant_id, attempt_no, provider, provider_account, provider_request_key,
                                             provider_job_id, state, model_code, estimated_cost_amount, estimated_cost_currency,
                                             billable_state, final_reason, created_at, updated_at)
                   values (%s, %s, 1, %s, %s, %s, %s, %s, %s, %s, 'USD', %s, %s, %s, %s) returning attempt_id""",
                (task_id, self.wallet.tenant_id, self.provider, self.account, key, job_id, state, MODEL, Decimal(estimated),
                 billable, stage, created or occurred - timedelta(days=5), occurred)).fetchone()
            conn.execute("update generation_task set state = %s where task_id = %s", (task_state, task_id))
            s = Seeded(row["attempt_id"], task_id, self.wallet.tenant_id, job_id, key)
            if cost is not None or unknown_cost:
                usage = Usage(seconds=5.0, cost_amount=Decimal(cost), currency=currency) if cost is not None else None
                costs.record_provider_cost(
                    conn, payload={"seeded": name}, state=task_state, stage=stage, tenant_id=s.tenant_id,
                    task_id=task_id, attempt_id=s.attempt_id, provider=self.provider, provider_account=self.account,
                    provider_job_id=job_id, charge_id=f"ch-{name}" if charge == "auto" else charge, provider_charged=True,
                    usage=usage, occurred_at=occurred)
            return s

        return self.p.db.transaction(write)


def items_of(conn, provider: str) -> list[dict]:
    return conn.execute("select * from reconciliation_item where provider = %s order by created_at, item_id",
                        (provider,)).fetchall()


def invoice_costs(conn, provider: str) -> list[dict]:
    return conn.execute("select * from provider_cost_event where provider = %s and source = 'INVOICE' order by created_at",
                        (provider,)).fetchall()
