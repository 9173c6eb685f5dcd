"""Hot wallets (issue 15, part 4; migration 0195, aivedio.billing.allowances): a partitioned wallet's
admissions spend allowances carved for their slots, over the real PostgreSQL and Redis.

- several processes of admissions on one wallet holding credit for exactly K tasks: exactly K are
  accepted, the wallet never goes below zero, the snapshot equals the ledger and the wallet check
  passes afterwards, and the allowance-return service leaves no allowance stranded;
- a tenant's queue limit stays exact with many slots admitting at once;
- a task admitted through a slot is cancelled like any other, back to its lot;
- an allowance of an expired lot is not spent, and goes back to the lot for the expiry sweep;
- unpartitioning gives every allowance back;
- a POSTPAID wallet (no credit lots) partitions too: its slots spend its credit line, exactly within
  the credit limit under concurrent processes, and within the period's contract budget."""
from __future__ import annotations

import json
import multiprocessing as mp
import threading
import uuid
from collections import Counter
from datetime import datetime, timedelta, timezone

import pytest

from aivedio.admission.decisions import Rejected
from aivedio.admission.models import GenerationRequest
from aivedio.admission.service import admit
from aivedio.auth import Caller
from aivedio import invariants
from aivedio.billing import allowances, wallet_checks
from aivedio.billing.ledger import ledger_aggregate
from aivedio.config import PlatformConfig, Settings
from aivedio.reconcile import allowance_return
from tests.admission_support import BODY, PRICE, new_tenant, second_user, wallet_row
from tests.conftest import TEST_HOME

pytestmark = [pytest.mark.timeout(300), pytest.mark.redis_cluster]
OPERATOR = "test-finance"


@pytest.fixture
def finance():
    """Who partitions, as the audit log names them."""
    return OPERATOR


def partitioned(platform, conn, finance, *, credits: int, users: int, slots: int, chunk: int, **policy):
    t = new_tenant(platform, credits=credits, **policy)
    members = [t] + [second_user(platform, t) for _ in range(users - 1)]
    platform.db.transaction(lambda c: allowances.partition(c, operator=finance, tenant_id=t.tenant_id, slots=slots,
                                                           chunk_amount=chunk))
    return t, members


def assert_consistent(conn, wallet_id) -> dict:
    """Snapshot = ledger; the wallet check (reservations + allowances, lots) finds nothing; the
    balance within its floor (zero, or minus a POSTPAID wallet's credit limit)."""
    w = conn.execute("select * from wallet_account where wallet_id = %s", (wallet_id,)).fetchone()
    agg = ledger_aggregate(conn, wallet_id)
    assert (w["available_amount"], w["reserved_amount"], w["consumed_amount"]) == (
        agg.get("AVAILABLE", 0), agg.get("RESERVED", 0), agg.get("CONSUMED", 0)), (dict(w), agg)
    assert w["available_amount"] >= (-w["credit_limit_amount"] if w["account_type"] == "POSTPAID" else 0)
    with conn.transaction():
        assert invariants.wallet_findings(conn, wallet_checks._lock(conn, wallet_id)) == []
    return w


# --- several processes against one wallet ----------------------------------------------------------------

def _admitter(db_url: str, redis_url: str, prefix: str, callers: list[tuple[str, str]], tries: int, tag: str, go, out) -> None:
    from aivedio.context import build_platform

    p = build_platform(Settings(database_url=db_url, redis_url=redis_url, redis_prefix=prefix, home=TEST_HOME),
                       PlatformConfig(), pool_size=4)
    try:
        req = GenerationRequest(**BODY)
        got: list = []

        def one(i: int) -> None:
            t, u = callers[i % len(callers)]
            try:
                a = admit(p, Caller(uuid.UUID(t), uuid.UUID(u), "OWNER", None), req, BODY, f"{tag}-{i}")
                got.append((a.status, json.loads(a.body)["task_id"]))
            except Rejected as r:
                got.append((r.status, r.decision))

        go.wait(60)
        threads = [threading.Thread(target=lambda k=k: [one(k + 3 * j) for j in range(tries // 3)]) for k in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        out.put(got)
    except BaseException as e:
        out.put([("error", repr(e))])
        raise
    finally:
        p.close()


def storm(db_url, redis_url, prefix, members, *, processes: int, tries: int, tag: str) -> list:
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    callers = [(str(m.tenant_id), str(m.user_id)) for m in members]
    procs = [ctx.Process(target=_admitter, args=(db_url, redis_url, prefix, callers[i:] + callers[:i], tries, f"{tag}{i}", go, out))
             for i in range(processes)]
    for pr in procs:
        pr.start()
    go.set()
    results = [x for _ in procs for x in out.get(timeout=240)]
    for pr in procs:
        pr.join(30)
    assert not [r for r in results if r[0] == "error"], results
    return results


class Watch:
    """The wallet's available amount and its allowances, sampled while admissions run."""

    def __init__(self, platform, wallet_id):
        self.platform, self.wallet_id = platform, wallet_id
        self.lowest, self.lowest_allowance, self.samples = None, None, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            with self.platform.db.connection() as c:
                r = c.execute("""select available_amount,
                                        (select coalesce(min(amount), 0) from wallet_allowance where wallet_id = %(w)s) as least
                                   from wallet_account where wallet_id = %(w)s""", {"w": self.wallet_id}).fetchone()
            self.lowest = r["available_amount"] if self.lowest is None else min(self.lowest, r["available_amount"])
            self.lowest_allowance = r["least"] if self.lowest_allowance is None else min(self.lowest_allowance, r["least"])
            self.samples += 1
            self._stop.wait(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


def test_processes_on_one_wallet_with_credit_for_exactly_k_tasks(platform, conn, finance, db_url, redis_url, redis_prefix):
    k = 17
    t, members = partitioned(platform, conn, finance, credits=k * PRICE, users=10, slots=4, chunk=3 * PRICE)
    with Watch(platform, t.wallet_id) as watch:
        results = storm(db_url, redis_url, redis_prefix, members, processes=3, tries=18, tag="k")
    by_status = Counter(r[0] for r in results)
    assert by_status[202] == k and set(by_status) == {202, 402}, by_status
    assert {r[1] for r in results if r[0] == 402} == {"REJECT_INSUFFICIENT_CREDIT"}
    accepted = {r[1] for r in results if r[0] == 202}
    assert len(accepted) == k
    assert watch.samples > 0 and watch.lowest >= 0 and watch.lowest_allowance >= 0
    rows = conn.execute("""select t.task_id, r.reserved_amount,
                                  (select count(*) from ledger_transaction l where l.task_id = t.task_id
                                      and l.event_type = 'RESERVE') as reserves,
                                  (select coalesce(sum(amount), 0) from reservation_allocation a
                                    where a.reservation_id = r.reservation_id) as allocated
                             from generation_task t join credit_reservation r using (task_id) where t.tenant_id = %s""",
                        (t.tenant_id,)).fetchall()
    assert {str(r["task_id"]) for r in rows} == accepted
    assert all((r["reserved_amount"], r["reserves"], r["allocated"]) == (PRICE, 1, PRICE) for r in rows), rows
    # The slots did their work: admissions went through them, refills carved from the wallet.
    reasons = Counter(r["reason_code"] for r in conn.execute(
        "select reason_code from ledger_transaction where wallet_id = %s and event_type = 'RESERVE'", (t.wallet_id,)).fetchall())
    assert reasons["FROM_ALLOWANCE"] == k and reasons["ALLOWANCE"] >= 1, reasons
    w = assert_consistent(conn, t.wallet_id)
    assert w["available_amount"] + w["reserved_amount"] == k * PRICE

    report = allowance_return.run_once(platform)
    assert report.complete
    assert conn.execute("select count(*) as n from wallet_allowance where wallet_id = %s", (t.wallet_id,)).fetchone()["n"] == 0
    w = assert_consistent(conn, t.wallet_id)
    assert (w["available_amount"], w["reserved_amount"]) == (0, k * PRICE)  # every credit is a task's now
    lots = conn.execute("select sum(remaining_amount) as rem, sum(reserved_amount) as res from credit_lot where wallet_id = %s",
                        (t.wallet_id,)).fetchone()
    assert (lots["rem"], lots["res"]) == (0, k * PRICE)
    assert allowance_return.run_once(platform).repaired == 0  # nothing left to return


def test_the_tenant_queue_limit_stays_exact_with_many_slots(platform, conn, finance, db_url, redis_url, redis_prefix):
    limit = 13
    t, members = partitioned(platform, conn, finance, credits=100 * PRICE, users=12, slots=8, chunk=4 * PRICE,
                             max_queued_tasks=limit)
    results = storm(db_url, redis_url, redis_prefix, members, processes=3, tries=15, tag="q")
    by = Counter(r[0] if r[0] == 202 else r[1] for r in results)
    assert by[202] == limit and set(by) == {202, "REJECT_TENANT_QUEUE_FULL"}, by
    assert conn.execute("select count(*) as n from generation_task where tenant_id = %s", (t.tenant_id,)).fetchone()["n"] == limit
    assert_consistent(conn, t.wallet_id)


def test_a_task_admitted_through_a_slot_is_cancelled_back_to_its_lot(platform, conn, finance):
    from aivedio.admission.cancel import cancel

    t, members = partitioned(platform, conn, finance, credits=20 * PRICE, users=2, slots=2, chunk=4 * PRICE)
    req = GenerationRequest(**BODY)
    ids = [json.loads(admit(platform, m.caller, req, BODY, f"c{i}-{m.user_id}").body)["task_id"]
           for i in range(3) for m in members]
    paths = Counter(r["reason_code"] for r in conn.execute(
        "select reason_code from ledger_transaction where wallet_id = %s and event_type = 'RESERVE'", (t.wallet_id,)).fetchall())
    assert paths["FROM_ALLOWANCE"] == 6 and paths["ALLOWANCE"] >= 2, paths  # each slot carved, then spent
    before = assert_consistent(conn, t.wallet_id)
    cancel(platform, members[1].caller, uuid.UUID(ids[-1]))
    after = assert_consistent(conn, t.wallet_id)
    assert after["available_amount"] == before["available_amount"] + PRICE
    allowance_return.run_once(platform)
    w = assert_consistent(conn, t.wallet_id)
    assert (w["available_amount"], w["reserved_amount"]) == (20 * PRICE - 5 * PRICE, 5 * PRICE)


def test_an_expired_lots_allowance_is_not_spent_and_goes_back_to_the_lot(platform, conn, finance):
    from aivedio.billing.lots import grant_credits
    from aivedio.billing.ledger import lock_wallet

    t, members = partitioned(platform, conn, finance, credits=0, users=1, slots=2, chunk=10 * PRICE)
    later = datetime.now(timezone.utc) + timedelta(days=1)
    platform.db.transaction(lambda c: grant_credits(c, lock_wallet(c, t.tenant_id), 10 * PRICE, kind="PAID",
                                                    business_key="expiring", expires_at=later))
    req = GenerationRequest(**BODY)
    assert admit(platform, t.caller, req, BODY, "before").status == 202  # carves the lot's credit into the slot
    held = allowances.held(conn, t.wallet_id)
    assert held == 9 * PRICE
    conn.execute("update credit_lot set expires_at = now() - interval '1 second' where wallet_id = %s", (t.wallet_id,))
    with pytest.raises(Rejected) as e:
        admit(platform, t.caller, req, BODY, "after")
    assert e.value.decision == "REJECT_INSUFFICIENT_CREDIT"
    allowance_return.run_once(platform)
    assert allowances.held(conn, t.wallet_id) == 0
    lot = conn.execute("select remaining_amount, reserved_amount from credit_lot where wallet_id = %s", (t.wallet_id,)).fetchone()
    assert (lot["remaining_amount"], lot["reserved_amount"]) == (9 * PRICE, PRICE)  # the sweep's to expire now
    assert_consistent(conn, t.wallet_id)


def test_unpartitioning_gives_every_allowance_back(platform, conn, finance):
    t, members = partitioned(platform, conn, finance, credits=10 * PRICE, users=3, slots=3, chunk=2 * PRICE)
    req = GenerationRequest(**BODY)
    for m in members:
        admit(platform, m.caller, req, BODY, f"u-{m.user_id}")
    assert allowances.held(conn, t.wallet_id) > 0
    out = platform.db.transaction(lambda c: allowances.unpartition(c, operator=finance, tenant_id=t.tenant_id))
    assert out["was_partitioned"] and out["returned"] > 0
    assert allowances.held(conn, t.wallet_id) == 0
    w = assert_consistent(conn, t.wallet_id)
    assert (w["available_amount"], w["reserved_amount"]) == (7 * PRICE, 3 * PRICE)
    # And admissions go through the wallet again.
    assert admit(platform, t.caller, req, BODY, "after").status == 202
    assert conn.execute("""select reason_code from ledger_transaction where wallet_id = %s and event_type = 'RESERVE'
                            order by created_at desc limit 1""", (t.wallet_id,)).fetchone()["reason_code"] is None
    assert wallet_row(conn, t.tenant_id)["available_amount"] == 6 * PRICE


def test_an_operator_partitions_a_wallet_from_the_cli_as_typed(platform, finance, db_url, redis_url, redis_prefix):
    import os
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("aivedio")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AIVEDIO_")},
           "AIVEDIO_DATABASE_URL": db_url, "AIVEDIO_REDIS_URL": redis_url, "AIVEDIO_REDIS_PREFIX": redis_prefix}

    def cli(*args: str) -> tuple[int, dict]:
        r = subprocess.run([str(exe), "admin", "wallet", *args, "--operator", finance, "--json"], env=env,
                           capture_output=True, text=True, timeout=60)
        return r.returncode, json.loads(r.stdout)

    # The CLI is trusted with the database, and audits as --operator.
    t = new_tenant(platform, credits=10_000)
    rc, bad = cli("partition", "--tenant-id", str(t.tenant_id), "--slots", "1", "--chunk-amount", "0")
    assert rc == 1 and set(bad["details"]["fields"]) == {"slots", "chunk_amount"}
    assert platform.db.fetchone("select count(*) as n from wallet_partitioning where wallet_id = %s",
                                (t.wallet_id,))["n"] == 0  # nothing written
    rc, done = cli("partition", "--tenant-id", str(t.tenant_id), "--slots", "4", "--chunk-amount", "500")
    assert rc == 0 and done["slots"] == 4
    rc, undone = cli("unpartition", "--tenant-id", str(t.tenant_id))
    assert rc == 0 and undone["was_partitioned"] is True
    actions = [r["action"] for r in platform.db.fetchall(
        "select action from audit_log where target = %s order by audit_id", (f"wallet:{t.wallet_id}",))]
    assert actions == ["wallet.partition", "wallet.unpartition"]


# --- POSTPAID: the credit line, in slots --------------------------------------------------------------------

def test_a_postpaid_wallets_slots_spend_exactly_its_credit_limit(platform, conn, finance, db_url, redis_url, redis_prefix):
    k = 17
    t = new_tenant(platform, account_type="POSTPAID", credits=k * PRICE)  # a credit limit of k tasks, no lots
    members = [t] + [second_user(platform, t) for _ in range(9)]
    platform.db.transaction(lambda c: allowances.partition(c, operator=finance, tenant_id=t.tenant_id, slots=4,
                                                           chunk_amount=3 * PRICE))
    with Watch(platform, t.wallet_id) as watch:
        results = storm(db_url, redis_url, redis_prefix, members, processes=3, tries=18, tag="pp")
    by_status = Counter(r[0] for r in results)
    assert by_status[202] == k and set(by_status) == {202, 402}, by_status
    assert watch.samples > 0 and watch.lowest >= -k * PRICE and watch.lowest_allowance >= 0
    rows = conn.execute("""select r.reserved_amount, (select count(*) from reservation_allocation a
                                                        where a.reservation_id = r.reservation_id) as allocations
                             from credit_reservation r where r.tenant_id = %s""", (t.tenant_id,)).fetchall()
    assert len(rows) == k and all((r["reserved_amount"], r["allocations"]) == (PRICE, 0) for r in rows), rows
    reasons = Counter(r["reason_code"] for r in conn.execute(
        "select reason_code from ledger_transaction where wallet_id = %s and event_type = 'RESERVE'", (t.wallet_id,)).fetchall())
    assert reasons["FROM_ALLOWANCE"] == k and reasons["ALLOWANCE"] >= 1, reasons
    assert conn.execute("select count(*) as n from wallet_allowance where wallet_id = %s and lot_id is not null",
                        (t.wallet_id,)).fetchone()["n"] == 0  # allowances of no lot: the wallet has none
    assert_consistent(conn, t.wallet_id)

    assert allowance_return.run_once(platform).complete
    assert allowances.held(conn, t.wallet_id) == 0
    w = assert_consistent(conn, t.wallet_id)
    assert (w["available_amount"], w["reserved_amount"]) == (-k * PRICE, k * PRICE)  # the whole line is the tasks'


def test_a_postpaid_wallets_slots_are_held_to_the_contract_budget(platform, conn, finance):
    from aivedio.billing.contract_budgets import set_contract_budget

    t = new_tenant(platform, account_type="POSTPAID", credits=100 * PRICE)
    members = [t] + [second_user(platform, t) for _ in range(3)]
    now = platform.clock.now()
    platform.db.transaction(lambda c: set_contract_budget(c, operator=finance, tenant_id=t.tenant_id,
                                                          period_start=now - timedelta(days=1),
                                                          period_end=now + timedelta(days=1), budget_amount=5 * PRICE))
    platform.db.transaction(lambda c: allowances.partition(c, operator=finance, tenant_id=t.tenant_id, slots=2,
                                                           chunk_amount=4 * PRICE))
    req = GenerationRequest(**BODY)
    outcomes = []
    for i in range(8):
        m = members[i % len(members)]
        try:
            outcomes.append(admit(platform, m.caller, req, BODY, f"b{i}").status)
        except Rejected as r:
            outcomes.append((r.decision, r.message))
    assert outcomes[:5] == [202] * 5, outcomes
    assert all(o[0] == "REJECT_INSUFFICIENT_CREDIT" and "contract budget" in o[1] for o in outcomes[5:]), outcomes
    reasons = Counter(r["reason_code"] for r in conn.execute(
        "select reason_code from ledger_transaction where wallet_id = %s and event_type = 'RESERVE'", (t.wallet_id,)).fetchall())
    assert reasons["FROM_ALLOWANCE"] == 5, reasons  # through the slots
    w = assert_consistent(conn, t.wallet_id)
    assert w["reserved_amount"] == 5 * PRICE  # the tasks' and the slots' credit together: the budget, not past it
    allowance_return.run_once(platform)
    w = assert_consistent(conn, t.wallet_id)
    assert (w["available_amount"], w["reserved_amount"]) == (-5 * PRICE, 5 * PRICE)


def test_a_contract_budget_cut_takes_back_what_the_slots_hold(platform, conn, finance):
    """The slots of a POSTPAID wallet hold credit carved under the budget in force: a cut returns it
    at once, so the next admission meets the new budget, not what a slot still held."""
    from aivedio.billing.contract_budgets import set_contract_budget

    t = new_tenant(platform, account_type="POSTPAID", credits=100 * PRICE)
    members = [t] + [second_user(platform, t) for _ in range(3)]
    now = platform.clock.now()
    period = (now - timedelta(days=1), now + timedelta(days=1))

    def budget(amount):
        platform.db.transaction(lambda c: set_contract_budget(c, operator=finance, tenant_id=t.tenant_id,
                                                              period_start=period[0], period_end=period[1],
                                                              budget_amount=amount))

    budget(20 * PRICE)
    platform.db.transaction(lambda c: allowances.partition(c, operator=finance, tenant_id=t.tenant_id, slots=2,
                                                           chunk_amount=5 * PRICE))
    req = GenerationRequest(**BODY)
    for i, m in enumerate(members):
        assert admit(platform, m.caller, req, BODY, f"before-{i}").status == 202
    assert allowances.held(conn, t.wallet_id) > 0  # the slots hold more than the tasks took
    budget(4 * PRICE)  # exactly what the four tasks hold
    assert allowances.held(conn, t.wallet_id) == 0
    with pytest.raises(Rejected) as e:
        admit(platform, members[0].caller, req, BODY, "after")
    assert e.value.decision == "REJECT_INSUFFICIENT_CREDIT" and "contract budget" in e.value.message
    w = assert_consistent(conn, t.wallet_id)
    assert (w["available_amount"], w["reserved_amount"]) == (-4 * PRICE, 4 * PRICE)
