"""Admission under concurrency, over the real PostgreSQL and Redis (issue 3, "Done means").

Several API server processes (multiprocessing 'spawn', each the real `api` handler behind its own
local HTTP server, as several Lambda execution environments would be) share one database. Client
threads fire at all of them at once, and threads in this process call the core directly beside
them, so admissions really race at the database:

- 50 concurrent submits with one Idempotency-Key give one task and one RESERVE;
- 200 concurrent submits against a small balance never take the wallet below zero, and each is
  either 202 with a reservation or 402 REJECT_INSUFFICIENT_CREDIT;
- after a mixed run (accepts, rejects, cancels, replays) the wallet snapshot equals the ledger
  aggregate per bucket, the lots sum to the wallet, and every ledger transaction sums to zero."""
from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import queue
import random
import threading
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from urllib.parse import urlsplit

import pytest

from aivedio.billing.lots import grant_credits
from aivedio.admission.decisions import Rejected
from aivedio.admission.models import GenerationRequest
from aivedio.admission.service import IdempotencyInProgress, admit
from aivedio.billing.ledger import ledger_aggregate
from aivedio.config import PlatformConfig, Settings
from tests.admission_support import BODY, PRICE, Tenant, new_tenant, wallet_row
from tests.conftest import TEST_HOME, drop_redis_prefix

SERVERS = 3
pytestmark = pytest.mark.timeout(180)


# --- the server processes ------------------------------------------------------------------------------

def _serve_api(db_url: str, redis_url: str, prefix: str, ready, stop) -> None:
    """Child process: the real `api` handler behind a local HTTP server, until `stop` is set."""
    from aivedio.context import build_platform
    from aivedio_tools.local.runtime import LocalRuntime

    try:
        settings = Settings(database_url=db_url, redis_url=redis_url, redis_prefix=prefix, home=TEST_HOME)
        platform = build_platform(settings, PlatformConfig(), pool_size=3)
        rt = LocalRuntime(platform, port=0, loops=[]).start()
    except BaseException as e:  # tell the parent instead of leaving it waiting
        ready.put(("error", repr(e)))
        raise
    ready.put(("ok", rt.base_url))
    stop.wait()
    rt.stop()
    platform.close()


@dataclass
class Fleet:
    platform: object  # this process's own Platform, for the core calls and the checks
    urls: list[str]


@pytest.fixture(scope="module")
def fleet(db_url, redis_url):
    from aivedio.context import build_platform

    prefix = f"t{uuid.uuid4().hex[:10]}"
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_serve_api, args=(db_url, redis_url, prefix, ready, stop), daemon=True)
             for _ in range(SERVERS)]
    for p in procs:
        p.start()
    platform = None
    try:
        urls = []
        for _ in procs:
            status, value = ready.get(timeout=90)
            assert status == "ok", f"an API server process failed to start: {value}"
            urls.append(value)
        platform = build_platform(Settings(database_url=db_url, redis_url=redis_url, redis_prefix=prefix, home=TEST_HOME),
                                  PlatformConfig(), pool_size=8)
        yield Fleet(platform, urls)
    finally:
        stop.set()
        for p in procs:
            p.join(15)
            if p.is_alive():
                p.kill()
                p.join(5)
        if platform is not None:
            platform.close()
        drop_redis_prefix(redis_url, prefix)


# --- firing requests together ------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    via: str  # "http" or "core"
    status: int
    body: bytes

    @property
    def json(self) -> dict:
        return json.loads(self.body)


def storm(n: int, fn) -> list:
    """Run fn(i) for i in range(n) on n threads released together by a barrier."""
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait(timeout=60)
        return fn(i)

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(run, range(n)))


class Clients:
    """Plain HTTP/1.1 connections (cheap to open on any thread), round-robin across the server processes."""

    def __init__(self, urls: list[str]):
        self.addrs = [urlsplit(u).netloc for u in urls]

    def request(self, i: int, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.addrs[i % len(self.addrs)], timeout=60)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()


@pytest.fixture
def clients(fleet):
    return Clients(fleet.urls)


def submit_http(clients: Clients, i: int, t: Tenant, key: str, body: dict = BODY) -> Outcome:
    status, content = clients.request(i, "POST", "/v1/generations", body,
                                      {"Authorization": f"Bearer {t.api_key}", "Idempotency-Key": key})
    return Outcome("http", status, content)


def cancel_http(clients: Clients, i: int, t: Tenant, task_id: str) -> tuple[int, dict]:
    status, content = clients.request(i, "POST", f"/v1/generations/{task_id}/cancel", None,
                                      {"Authorization": f"Bearer {t.api_key}"})
    return status, json.loads(content)


def submit_core(platform, t: Tenant, key: str, body: dict = BODY) -> Outcome:
    try:
        a = admit(platform, t.caller, GenerationRequest(**body), body, key)
        return Outcome("core", a.status, a.body.encode())
    except Rejected as r:
        return Outcome("core", r.status, json.dumps(r.body()).encode())
    except IdempotencyInProgress as e:
        return Outcome("core", 409, json.dumps({"error": e.code, "message": e.message}).encode())


class WalletWatch:
    """Samples the wallet while a storm runs: the lowest available amount it ever saw."""

    def __init__(self, platform, tenant_id):
        self.platform, self.tenant_id = platform, tenant_id
        self.lowest: int | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            with self.platform.db.connection() as c:
                a = c.execute("select available_amount from wallet_account where tenant_id = %s", (self.tenant_id,)).fetchone()
            self.lowest = a["available_amount"] if self.lowest is None else min(self.lowest, a["available_amount"])
            self.samples += 1
            self._stop.wait(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


# --- the checks ---------------------------------------------------------------------------------------

def count(conn, sql: str, *args) -> int:
    return conn.execute(sql, args).fetchone()["n"]


def assert_money_invariants(conn, tenant_id) -> dict:
    """The wallet snapshot equals the ledger per bucket; the lots hold exactly the wallet; every
    transaction balances; every reservation is what its task's state says it should be."""
    w = wallet_row(conn, tenant_id)
    agg = ledger_aggregate(conn, w["wallet_id"])
    assert (w["available_amount"], w["reserved_amount"], w["consumed_amount"]) == (
        agg.get("AVAILABLE", 0), agg.get("RESERVED", 0), agg.get("CONSUMED", 0)), (dict(w), agg)
    lots = conn.execute("""select coalesce(sum(remaining_amount), 0)::bigint as remaining,
                                  coalesce(sum(reserved_amount), 0)::bigint as reserved
                             from credit_lot where wallet_id = %s""", (w["wallet_id"],)).fetchone()
    if w["account_type"] != "POSTPAID":
        assert (lots["remaining"], lots["reserved"]) == (w["available_amount"], w["reserved_amount"])
        assert w["available_amount"] >= 0
    unbalanced = conn.execute("""select t.ledger_txn_id, sum(e.amount_delta) as total from ledger_transaction t
                                   join ledger_entry e using (ledger_txn_id)
                                  where t.wallet_id = %s group by t.ledger_txn_id having sum(e.amount_delta) <> 0""",
                              (w["wallet_id"],)).fetchall()
    assert unbalanced == []
    # Per task: QUEUED holds an ACTIVE reservation and one RESERVE; CANCELLED released all of it.
    rows = conn.execute(
        """select t.task_id, t.state, r.state as res_state, r.reserved_amount, r.released_amount,
                  (select count(*) from ledger_transaction l where l.task_id = t.task_id and l.event_type = 'RESERVE') as reserves,
                  (select count(*) from ledger_transaction l where l.task_id = t.task_id and l.event_type = 'RELEASE') as releases,
                  (select coalesce(sum(a.amount), 0) from reservation_allocation a where a.reservation_id = r.reservation_id) as allocated
             from generation_task t left join credit_reservation r using (task_id) where t.tenant_id = %s""",
        (tenant_id,)).fetchall()
    for r in rows:
        assert r["reserves"] == 1 and r["reserved_amount"] == PRICE and r["allocated"] == PRICE, dict(r)
        if r["state"] == "QUEUED":
            assert (r["res_state"], r["released_amount"], r["releases"]) == ("ACTIVE", 0, 0), dict(r)
        else:
            assert r["state"] == "CANCELLED" and (r["res_state"], r["released_amount"], r["releases"]) == (
                "RELEASED", PRICE, 1), dict(r)
    queued = sum(1 for r in rows if r["state"] == "QUEUED")
    assert w["reserved_amount"] == queued * PRICE
    return {"wallet": dict(w), "tasks": Counter(r["state"] for r in rows)}


# --- the tests -----------------------------------------------------------------------------------------

def test_fifty_concurrent_submits_with_one_key_give_one_task_and_one_reserve(fleet, clients, conn):
    t = new_tenant(fleet.platform, credits=10_000)
    key = "one-key-for-fifty"
    # 40 through the HTTP servers (3 processes), 10 straight into the core from this process.
    outcomes = storm(50, lambda i: submit_http(clients, i, t, key) if i % 5 else submit_core(fleet.platform, t, key))

    record = conn.execute("select * from idempotency_record where tenant_id = %s and idempotency_key = %s",
                          (t.tenant_id, key)).fetchone()
    assert record["status"] == "COMPLETED" and record["response_status"] == 202
    stored = record["response_body"].encode()
    by_status = Counter(o.status for o in outcomes)
    assert set(by_status) <= {202, 409}, by_status
    assert by_status[202] >= 1
    for o in outcomes:
        if o.status == 202:
            assert o.body == stored, "a replay differs from the first response"
        else:
            assert o.json["error"] == "IDEMPOTENCY_IN_PROGRESS", o
    assert count(conn, "select count(*) as n from generation_task where tenant_id = %s", t.tenant_id) == 1
    assert count(conn, "select count(*) as n from ledger_transaction where tenant_id = %s and event_type = 'RESERVE'",
                 t.tenant_id) == 1
    assert count(conn, "select count(*) as n from credit_reservation where tenant_id = %s", t.tenant_id) == 1
    assert count(conn, "select count(*) as n from outbox_event where tenant_id = %s and event_type = 'TaskQueued'",
                 t.tenant_id) == 1
    task_id = json.loads(stored)["task_id"]
    assert str(record["task_id"]) == task_id
    assert wallet_row(conn, t.tenant_id)["available_amount"] == 10_000 - PRICE
    # Once it is done, the same key replays the same bytes, whichever process answers.
    for i in range(SERVERS):
        assert submit_http(clients, i, t, key).body == stored
    assert_money_invariants(conn, t.tenant_id)


def test_two_hundred_concurrent_submits_never_overdraw_a_small_balance(fleet, clients, conn):
    affordable = 10
    credits = affordable * PRICE + PRICE // 2
    t = new_tenant(fleet.platform, credits=credits)  # rate, queue and cost limits high: only credit binds
    with WalletWatch(fleet.platform, t.tenant_id) as watch:
        outcomes = storm(200, lambda i: submit_http(clients, i, t, f"k{i}") if i % 4 else
                         submit_core(fleet.platform, t, f"k{i}"))

    by_status = Counter(o.status for o in outcomes)
    assert set(by_status) <= {202, 402}, by_status
    assert by_status[202] == affordable and by_status[402] == 200 - affordable, by_status
    for o in outcomes:
        if o.status == 402:
            assert o.json["error"] == "REJECTED" and o.json["decision"] == "REJECT_INSUFFICIENT_CREDIT", o
    accepted_ids = {o.json["task_id"] for o in outcomes if o.status == 202}
    assert len(accepted_ids) == affordable
    res = conn.execute("select task_id, state, reserved_amount from credit_reservation where tenant_id = %s",
                       (t.tenant_id,)).fetchall()
    assert {str(r["task_id"]) for r in res} == accepted_ids
    assert all(r["state"] == "ACTIVE" and r["reserved_amount"] == PRICE for r in res)
    w = wallet_row(conn, t.tenant_id)
    assert (w["available_amount"], w["reserved_amount"]) == (credits - affordable * PRICE, affordable * PRICE)
    assert watch.samples > 0 and watch.lowest >= 0
    # Rejections left nothing behind: one idempotency record per accepted task, no others.
    assert count(conn, "select count(*) as n from idempotency_record where tenant_id = %s", t.tenant_id) == affordable
    assert count(conn, "select count(*) as n from generation_task where tenant_id = %s", t.tenant_id) == affordable
    assert_money_invariants(conn, t.tenant_id)


def test_after_a_mixed_run_the_wallet_equals_the_ledger(fleet, clients, conn):
    platform = fleet.platform
    rich = new_tenant(platform, credits=40 * PRICE)
    poor = new_tenant(platform, credits=6 * PRICE + 5)
    now = datetime.now(timezone.utc)

    def more_lots(c):  # the rich tenant also holds lots that expire, so reservations span lots
        w = wallet_row(c, rich.tenant_id)
        grant_credits(c, w, 5 * PRICE + 3, kind="PROMOTIONAL", business_key="mixed:promo", expires_at=now + timedelta(days=3))
        grant_credits(c, w, 7 * PRICE + 11, kind="SUBSCRIPTION", business_key="mixed:sub", expires_at=now + timedelta(days=9))

    platform.db.transaction(more_lots)
    start = {t.tenant_id: wallet_row(conn, t.tenant_id)["available_amount"] for t in (rich, poor)}

    to_cancel: queue.Queue = queue.Queue()
    cancels: list[tuple[int, dict]] = []
    cancel_lock = threading.Lock()
    queued_for_cancel: set[str] = set()
    plan = []  # (tenant, key): some keys are used twice, so replays race with first requests
    for i in range(120):
        t = rich if i % 3 else poor
        plan.append((t, f"m{i}"))
        if i % 10 == 0:
            plan.append((t, f"m{i}"))
    random.Random(7).shuffle(plan)
    done = threading.Event()

    def submitter(i):
        t, key = plan[i]
        o = submit_http(clients, i, t, key) if i % 4 else submit_core(platform, t, key)
        if o.status == 202 and int(key[1:]) % 2:  # odd keys' tasks are cancelled (once each, twice over)
            task_id = o.json["task_id"]
            with cancel_lock:
                first = task_id not in queued_for_cancel
                queued_for_cancel.add(task_id)
            if first:
                to_cancel.put((t, task_id))
        return o

    def canceller(j):
        while not (done.is_set() and to_cancel.empty()):
            try:
                t, task_id = to_cancel.get(timeout=0.05)
            except queue.Empty:
                continue
            for k in range(2):  # the second cancel of a task is refused as terminal
                got = cancel_http(clients, j + k, t, task_id)
                with cancel_lock:
                    cancels.append(got)

    cancel_threads = [threading.Thread(target=canceller, args=(j,)) for j in range(4)]
    for th in cancel_threads:
        th.start()
    try:
        outcomes = storm(len(plan), submitter)
    finally:
        done.set()
        for th in cancel_threads:
            th.join(60)

    by_status = Counter(o.status for o in outcomes)
    assert set(by_status) <= {202, 402, 409}, by_status
    assert by_status[202] > 0 and by_status[402] > 0, by_status  # both outcomes happened
    for o in outcomes:
        if o.status == 402:
            assert o.json["decision"] == "REJECT_INSUFFICIENT_CREDIT"
        elif o.status == 409:
            assert o.json["error"] == "IDEMPOTENCY_IN_PROGRESS"
    cancel_status = Counter((s, b.get("state") or b.get("error")) for s, b in cancels)
    assert set(cancel_status) <= {(202, "CANCELLED"), (409, "TASK_TERMINAL")}, cancel_status
    assert cancel_status[(202, "CANCELLED")] == cancel_status[(409, "TASK_TERMINAL")] > 0, cancel_status

    for t in (rich, poor):
        summary = assert_money_invariants(conn, t.tenant_id)
        w = summary["wallet"]
        queued, cancelled = summary["tasks"]["QUEUED"], summary["tasks"]["CANCELLED"]
        assert w["available_amount"] == start[t.tenant_id] - queued * PRICE
        assert w["consumed_amount"] == 0
        assert count(conn, "select count(*) as n from ledger_transaction where tenant_id = %s and event_type = 'RELEASE'",
                     t.tenant_id) == cancelled
        # One idempotency record per task, so a repeated key never made a second task.
        assert count(conn, "select count(*) as n from idempotency_record where tenant_id = %s", t.tenant_id) == queued + cancelled
    # The poor tenant's even keys are never cancelled, so at most 6 of them hold credit: its balance bound.
    assert count(conn, "select count(*) as n from generation_task where tenant_id = %s and state = 'QUEUED'", poor.tenant_id) <= 6


def test_admission_never_waits_for_a_pool_connection_while_holding_the_wallet_lock(make_platform, conn, monkeypatch):
    """Regression: the expected-wait figures were read on a second pool connection inside the
    admission transaction, under the wallet's row lock. Concurrent admissions of one tenant that
    filled the pool then waited on the wallet lock while its holder waited for a connection: a
    deadlock until the pool's 30 s timeout. With every lookup a cache miss and a pool of two,
    eight concurrent admissions must all finish promptly."""
    from aivedio import caching

    monkeypatch.setattr(caching, "CACHE_SECONDS", 0.0)
    platform = make_platform(pool_size=2)
    t = new_tenant(platform, credits=100 * PRICE)
    results: list = []

    def one(i):
        try:
            results.append(submit_core(platform, t, f"pool-{i}").status)
        except Exception as e:  # psycopg_pool.PoolTimeout when it deadlocks
            results.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    assert not any(th.is_alive() for th in threads), "admissions deadlocked on the connection pool"
    assert results == [202] * 8
    assert_money_invariants(conn, t.tenant_id)
