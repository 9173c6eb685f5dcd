"""The safeguard switches of admission, the outbox, the claim, settlement and release (issue 18,
"Each checker is proven able to fail"), each shown holding without its switch and failing with it,
over the real PostgreSQL and Redis; and the two failpoints of these modules, each shown to crash
exactly in its window.

A switch is read once at import (aivedio.faults.safeguards), so the in-process proofs set
`safeguards._BROKEN` for one test; the environment path (the allow variable, never in Lambda) and
the failpoints, which kill their process, run in a child process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone

import pytest

from aivedio import outbox
from aivedio.admission.models import GenerationRequest
from aivedio.admission.service import admit
from aivedio.billing.settlement import settle, settle_many, Terminal
from aivedio.faults import failpoints, safeguards
from aivedio.config import LaneConfig, Limits, PlatformConfig, ProviderAccount, ProviderConfig
from aivedio.context import set_platform
from aivedio.scheduling.resources import ensure_platform_pools, release_attempt
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import BODY, assert_wallet_matches_ledger, new_tenant
from tests.conftest import ROOT, create_test_database, drop_test_database
from tests.scheduler_support import OPEN, UNCAPPED, submit, used
from tests import settle_support

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def db_url():
    """A fresh database per test (overrides the per-module one of conftest): pools, queues and the
    outbox are global, and each test counts them."""
    url = create_test_database("chaos_safeguards")
    yield url
    drop_test_database(url)


def broken(monkeypatch, *names: str) -> None:
    """Switch these safeguards off in this process for one test (what AIVEDIO_CHAOS_BREAK does at import)."""
    assert set(names) <= set(safeguards.SAFEGUARDS)
    monkeypatch.setattr(safeguards, "_BROKEN", frozenset(names))


@pytest.fixture
def p(make_platform):
    """settle_support's platform (one roomy provider account, a ManualClock), installed as this
    process's platform: the outbox's after-commit writer finds its database through it."""
    platform = settle_support.start(make_platform)
    set_platform(platform)
    yield platform
    set_platform(None)


def child(code: str, env: dict[str, str], args: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (args as json in sys.argv[1]), with `env` added."""
    base = {k: v for k, v in os.environ.items()
            if k not in (safeguards.BREAK_ENV, safeguards.ALLOW_ENV, failpoints.ENV, "AWS_LAMBDA_FUNCTION_NAME")}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "shared")])
    return subprocess.run([sys.executable, "-c", code, json.dumps(args)], cwd=ROOT, env={**base, **env},
                          capture_output=True, text=True, timeout=timeout)


# A child on the test's database: the platform of settle_support.start, without touching its pools.
CHILD_PLATFORM = """
import json, sys, time
from datetime import datetime, timezone
from uuid import UUID
from aivedio.attempts.lifecycle import AttemptRef
from aivedio.config import ManualClock, PlatformConfig, ProviderAccount, ProviderConfig, Settings
from aivedio.context import build_platform, set_platform
from tests.settle_support import Claimed
a = json.loads(sys.argv[1])
cfg = PlatformConfig(providers=[ProviderConfig(name="provider-a",
                                               accounts=[ProviderAccount(account_id="account-01", max_concurrency=200)])])
p = build_platform(Settings(database_url=a["db"], redis_url=a["redis"], redis_prefix=a["prefix"], home=a["home"]), cfg,
                   clock=ManualClock(datetime.now(timezone.utc)), pool_size=2)
set_platform(p)
"""


def child_args(p, **kw) -> dict:
    s = p.settings
    return {"db": s.database_url, "redis": s.redis_url, "prefix": s.redis_prefix, "home": str(s.home), **kw}


def claimed_args(c: settle_support.Claimed) -> dict:
    r = c.ref
    return {"tenant": str(r.tenant_id), "task": str(r.task_id), "attempt": str(r.attempt_id), "fencing": r.fencing_token,
            "wallet": str(c.wallet_id)}


CHILD_CLAIMED = "c = Claimed(AttemptRef(UUID(a['tenant']), UUID(a['task']), UUID(a['attempt']), a['fencing']), UUID(a['wallet']))\n"


# --- the switches' environment -----------------------------------------------------------------------------

IMPORT_SAFEGUARDS = "from aivedio.faults import safeguards; print(sorted(safeguards._BROKEN))"


def test_a_switch_needs_its_allow_variable_a_known_name_and_no_lambda():
    allow = {safeguards.ALLOW_ENV: safeguards.ALLOW_VALUE}
    ok = child(IMPORT_SAFEGUARDS, {safeguards.BREAK_ENV: "capacity-check,release-on-terminal", **allow}, {})
    assert ok.returncode == 0 and ok.stdout.strip() == "['capacity-check', 'release-on-terminal']", ok.stderr
    assert "SAFEGUARDS BROKEN" in ok.stderr
    for env, says in [
        ({safeguards.BREAK_ENV: "capacity-check"}, "needs AIVEDIO_CHAOS_ALLOW_BREAKING"),
        ({safeguards.BREAK_ENV: "capacity-check", safeguards.ALLOW_ENV: "yes"}, "needs AIVEDIO_CHAOS_ALLOW_BREAKING"),
        ({safeguards.BREAK_ENV: "capacity-chek", **allow}, "unknown safeguards ['capacity-chek']"),
        ({safeguards.BREAK_ENV: "capacity-check", **allow, "AWS_LAMBDA_FUNCTION_NAME": "aivedio-dev-api"}, "in Lambda"),
    ]:
        r = child(IMPORT_SAFEGUARDS, env, {})
        assert r.returncode != 0 and "SafeguardError" in r.stderr and says in r.stderr, (env, r.stderr)
    # Nothing set: nothing broken, and the platform's modules import as they always did.
    quiet = child(IMPORT_SAFEGUARDS + "\nimport aivedio.admission.service, aivedio.billing.settlement, aivedio.outbox", {}, {})
    assert quiet.returncode == 0 and quiet.stdout.strip() == "[]" and "SAFEGUARDS BROKEN" not in quiet.stderr, quiet.stderr
    # A failpoint is armed under the same allow variable, and never in Lambda.
    arm = {failpoints.ENV: "seed=1;after-ledger-before-ack=1"}
    for env in (arm, {**arm, **allow, "AWS_LAMBDA_FUNCTION_NAME": "aivedio-dev-settlement"}):
        r = child("import aivedio.faults.failpoints", env, {})
        assert r.returncode != 0 and "SafeguardError" in r.stderr, (env, r.stderr)


def test_a_call_site_naming_an_unknown_switch_fails():
    with pytest.raises(KeyError):
        safeguards.broken("idempotency-lok")


# --- idempotency-lock (aivedio.admission.service._admit) -----------------------------------------------------

def test_idempotency_lock_one_task_per_key_unless_broken(platform, monkeypatch, conn):
    t = new_tenant(platform)
    req = GenerationRequest(**BODY)

    def twice(key: str) -> list[str]:
        return [json.loads(admit(platform, t.caller, req, BODY, key).body)["task_id"] for _ in range(2)]

    def tasks(key: str) -> int:
        return conn.execute("select count(*) as n from generation_task where tenant_id = %s and split_part(idempotency_key, '#', 1) = %s",
                            (t.tenant_id, key)).fetchone()["n"]

    first, replay = twice("key-held")
    assert first == replay and tasks("key-held") == 1  # the replay answers the first task

    broken(monkeypatch, "idempotency-lock")
    one, two = twice("key-broken")
    assert one != two and tasks("key-broken") == 2  # a duplicate submit made a second task


# --- publish-in-transaction and after-commit-before-publish (aivedio.outbox) ---------------------------------

def event_and_task_xmin(conn, task_id) -> tuple[str | None, str]:
    ev = conn.execute("select xmin::text as x from outbox_event where aggregate_id = %s and event_type = 'TaskSucceeded'",
                      (task_id,)).fetchone()
    task = conn.execute("select xmin::text as x, state from generation_task where task_id = %s", (task_id,)).fetchone()
    assert task["state"] == "SUCCEEDED"
    return (ev["x"] if ev else None), task["x"]


def test_publish_in_transaction_the_event_commits_with_its_state_unless_broken(p, monkeypatch, conn):
    held, loose = settle_support.claim(p, 2)
    settle_support.run_and_finish(p, held)
    ev, task = event_and_task_xmin(conn, held.task_id)
    assert ev == task  # one transaction wrote the state and its event

    broken(monkeypatch, "publish-in-transaction")
    settle_support.run_and_finish(p, loose)
    deadline = time.monotonic() + 10
    while (got := event_and_task_xmin(conn, loose.task_id))[0] is None and time.monotonic() < deadline:
        time.sleep(0.02)
    ev, task = got
    assert ev is not None and int(ev) > int(task)  # written afterwards, by a transaction of its own
    # Settlement writes its TaskSettled from a pipeline: that one too comes after the commit.
    assert settle_delivery(p, terminal_event(conn, loose.task_id)).outcome == "SETTLED"
    deadline = time.monotonic() + 10
    while (settled := conn.execute("select xmin::text as x from outbox_event where aggregate_id = %s and event_type = 'TaskSettled'",
                                   (loose.task_id,)).fetchone()) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    charge = conn.execute("select xmin::text as x from generation_charge where task_id = %s", (loose.task_id,)).fetchone()
    assert settled is not None and int(settled["x"]) > int(charge["x"])


CHILD_FINISH_THEN_RELAY = CHILD_PLATFORM + CHILD_CLAIMED + """
from aivedio import outbox
from tests.settle_support import run_and_finish
run_and_finish(p, c)
time.sleep(a["linger"])  # time for the after-commit writer, when the safeguard is off
outbox.relay_once(p, lambda message: None)
print("relayed")
"""


def test_a_crash_after_the_commit_loses_the_event_only_with_publish_in_transaction_broken(p, conn):
    held, lost = settle_support.claim(p, 2)
    armed = failpoints.env_for(7, {"after-commit-before-publish": 1.0})

    # The safeguard on: the state and its event committed together; the relay crashes before its
    # first delivery (the failpoint's window), and the event waits PENDING for the next relay.
    r = child(CHILD_FINISH_THEN_RELAY, armed, {**child_args(p, linger=0), **claimed_args(held)})
    assert r.returncode == failpoints.EXIT_CODE and "FAILPOINT after-commit-before-publish" in r.stderr, r.stderr
    row = conn.execute("select status from outbox_event where aggregate_id = %s and event_type = 'TaskSucceeded'",
                       (held.task_id,)).fetchone()
    assert row is not None and row["status"] == "PENDING"

    # Broken: the event waits for the commit, and the crash in between loses it; the task stays SUCCEEDED.
    r = child(CHILD_FINISH_THEN_RELAY, {**armed, **safeguards.env_for(["publish-in-transaction"])},
              {**child_args(p, linger=20), **claimed_args(lost)})
    assert r.returncode == failpoints.EXIT_CODE and "relayed" not in r.stdout, r.stderr
    assert event_and_task_xmin(conn, lost.task_id)[0] is None


# --- settlement-idempotency and after-ledger-before-ack (aivedio.billing.settlement) -------------------------

def terminal_event(conn, task_id) -> dict:
    return conn.execute("""select event_id, event_type, payload from outbox_event
                            where aggregate_id = %s and event_type = 'TaskSucceeded'""", (task_id,)).fetchone()


def settle_delivery(p, ev: dict):
    """As the settlement handler settles one SQS record."""
    with p.db.connection() as c:
        return settle(c, ev["payload"], p.clock.now(), event_type=ev["event_type"], event_id=ev["event_id"])


def charges(conn, task_id) -> tuple[int, int]:
    """(SETTLE transactions of the task, credits they consumed)."""
    row = conn.execute("""select count(distinct t.ledger_txn_id) as n, coalesce(sum(e.amount_delta), 0)::bigint as consumed
                            from ledger_transaction t join ledger_entry e using (ledger_txn_id)
                           where t.task_id = %s and t.event_type = 'SETTLE' and e.bucket = 'CONSUMED'""", (task_id,)).fetchone()
    return row["n"], row["consumed"]


def test_settlement_idempotency_a_redelivery_charges_once_unless_broken(p, monkeypatch, conn):
    held, twice, batched = settle_support.claim(p, 3)
    for c in (held, twice, batched):
        settle_support.run_and_finish(p, c)

    ev = terminal_event(conn, held.task_id)
    assert [settle_delivery(p, ev).outcome for _ in range(2)] == ["SETTLED", "REPLAY"]
    n, price = charges(conn, held.task_id)
    assert n == 1 and price > 0

    broken(monkeypatch, "settlement-idempotency")
    ev = terminal_event(conn, twice.task_id)
    assert [settle_delivery(p, ev).outcome for _ in range(2)] == ["SETTLED", "SETTLED"]
    assert charges(conn, twice.task_id) == (2, 2 * price)
    # Two deliveries in one batch charge twice too.
    ev = terminal_event(conn, batched.task_id)
    with p.db.connection() as c:
        got = settle_many(c, [Terminal(ev["payload"], ev["event_type"], ev["event_id"])] * 2, p.clock.now())
    assert [s.outcome for s in got] == ["SETTLED", "SETTLED"] and charges(conn, batched.task_id) == (2, 2 * price)
    # The ledger itself stays sound: only the promise of one charge per task is broken.
    assert_wallet_matches_ledger(conn, held.ref.tenant_id)


CHILD_SETTLE = CHILD_PLATFORM + """
from aivedio.billing.settlement import settle
ev = a["event"]
with p.db.connection() as conn:
    settle(conn, ev["payload"], p.clock.now(), event_type=ev["event_type"], event_id=ev["event_id"])
print("acknowledged")
"""


def test_after_ledger_before_ack_crashes_once_the_ledger_committed(p, conn):
    [c] = settle_support.claim(p, 1)
    settle_support.run_and_finish(p, c)
    ev = terminal_event(conn, c.task_id)
    event = {"event_id": str(ev["event_id"]), "event_type": ev["event_type"], "payload": ev["payload"]}
    r = child(CHILD_SETTLE, failpoints.env_for(3, {"after-ledger-before-ack": 1.0}), child_args(p, event=event))
    assert r.returncode == failpoints.EXIT_CODE and "acknowledged" not in r.stdout, r.stderr
    assert charges(conn, c.task_id)[0] == 1  # committed before the crash
    assert conn.execute("select finalized_at from generation_charge where task_id = %s", (c.task_id,)).fetchone()["finalized_at"]
    assert settle_delivery(p, ev).outcome == "REPLAY"  # the queue's redelivery changes nothing
    assert charges(conn, c.task_id)[0] == 1


# --- release-on-terminal (aivedio.scheduling.resources.release_attempt) --------------------------------------

def active_reservations(conn, attempt_id) -> int:
    return conn.execute("select count(*) as n from resource_reservation where attempt_id = %s and state = 'ACTIVE'",
                        (attempt_id,)).fetchone()["n"]


def test_release_on_terminal_a_finished_task_frees_its_reservations_unless_broken(p, monkeypatch, conn):
    held, kept = settle_support.claim(p, 2)
    assert active_reservations(conn, held.attempt_id) > 0
    settle_support.run_and_finish(p, held)
    assert active_reservations(conn, held.attempt_id) == 0

    broken(monkeypatch, "release-on-terminal")
    n = active_reservations(conn, kept.attempt_id)
    settle_support.run_and_finish(p, kept)
    assert active_reservations(conn, kept.attempt_id) == n > 0  # ACTIVE on a SUCCEEDED task
    with p.db.connection() as c:  # and no later release (the finalize step, the expired-reservations repair) frees them
        assert release_attempt(c, kept.attempt_id, p.clock.now()) == []


# --- capacity-check (aivedio.scheduling.claim.claim_demands) -------------------------------------------------

@pytest.mark.parametrize("switched_off", [False, True])
def test_capacity_check_a_claim_refuses_a_full_provider_account_unless_broken(make_platform, monkeypatch, conn, switched_off):
    cfg = PlatformConfig(providers=[ProviderConfig(name="sim-a", accounts=[ProviderAccount(account_id="a1", max_concurrency=2)])],
                         lanes={"ENTERPRISE_RESERVED": LaneConfig(capacity_units=500, borrowable_units=0),
                                "PAID_SHARED": LaneConfig(capacity_units=500)},
                         limits=Limits(pool_shards=1))
    p = make_platform(cfg)
    with p.db.connection() as c:
        ensure_platform_pools(c, cfg)
    if switched_off:
        broken(monkeypatch, "capacity-check")
    t = new_tenant(p, credits=1_000_000, **{**OPEN, **UNCAPPED})
    tasks = submit(p, t.tenant_id, t.user_id, n=5)
    Scheduler(p).tick(10.0)
    running = conn.execute("select count(*) as n from task_attempt where task_id = any(%s)", (tasks,)).fetchone()["n"]
    if switched_off:
        assert running == 5  # more attempts than the account's max_concurrency of 2
        assert used(conn, "provider-account:sim-a:a1") == 0
    else:
        assert running == 2 and used(conn, "provider-account:sim-a:a1") == 2
