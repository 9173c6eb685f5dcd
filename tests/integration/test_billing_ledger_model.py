"""A Hypothesis state machine over the real billing core on the real PostgreSQL (issue 6, "Done means").

Each example gets a fresh tenant and wallet (a few inserts; nothing is truncated, the ledger is
append-only) and runs a short random sequence of: grant a lot (paid, or promotional with an
expiry), reserve (a task as admission makes it), settle (full, partial, capped, failed, cancelled,
each policy), release before dispatch, refund (settled or still pending), compensate (with and
without a case id), advance the clock and expire, and replay an earlier operation.

After every step it checks, against the database:
- every ledger transaction sums to zero;
- the wallet snapshot equals the ledger aggregate per bucket, and the model's own totals;
- the lots' remaining amounts sum to available, their reserved parts to reserved;
- every reservation has settled + released <= reserved and refunded <= settled, and the open parts
  sum to the snapshot's reserved;
and, in the steps themselves, that a replay adds nothing and that a rejected operation leaves no
trace (the tenant's whole footprint is unchanged).

The charge each settlement must make comes from the pure policies.decide(), so the test checks that
the transaction applies exactly what the locked policy says."""
from __future__ import annotations

import os

import uuid
from collections import Counter
from datetime import timedelta

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test
from psycopg.rows import dict_row

from aivedio.billing import expiry, policies
from aivedio.billing.compensation import request_compensation
from aivedio.billing.errors import CompensationInvalid, RefundExceedsSettled
from aivedio.billing.ledger import lock_wallet
from aivedio.billing.lots import LotsExhausted
from aivedio.billing.refunds import request_refund
from aivedio.billing.reservations import InsufficientCredit, release_remaining
from aivedio.billing.settlement import settle_in
from aivedio.config import ModelPrice, PlatformConfig, Settings
from aivedio.db.pool import in_transaction
from aivedio.pricing import price_book
from tests.billing_support import (EVENT_TYPE, PARAMS, SUPPORT, T0, add_lot, assert_invariants, footprint,
                                   make_task, new_wallet, quote_for, terminal)
from tests.conftest import TEST_HOME

pytestmark = pytest.mark.timeout(600)
RULES = ModelPrice().model_dump()
POLICIES = ("SUCCESS_ONLY", "SUBMIT_CHARGED", "USAGE_BASED")
OUTCOMES = [(s, stg) for s, stages in policies.OUTCOMES.items() for stg in stages]
THRESHOLD = 10**9  # compensation applies at once here; dual approval has its own tests


STATS: Counter = Counter()  # what the examples exercised; the test asserts every path was taken


class Ctx:
    platform = None
    conn: psycopg.Connection | None = None
    price_version = None


class LedgerMachine(RuleBasedStateMachine):
    @initialize(paid=st.integers(0, 600), promo=st.integers(0, 300), promo_days=st.integers(1, 5))
    def fresh_wallet(self, paid, promo, promo_days):
        self.conn = Ctx.conn
        self.w = new_wallet(Ctx.platform, credits=paid)  # a PAID lot without expiry
        self.now = T0
        self.available, self.reserved, self.consumed = paid, 0, 0
        if promo:
            self.tx(lambda c: add_lot(c, self.w, promo, kind="PROMOTIONAL", expires_at=T0 + timedelta(days=promo_days)))
            self.available += promo
        self.open_tasks: list[dict] = []  # reserved, not settled
        self.settled: list[dict] = []
        self.replays: list[tuple] = []
        self.case_no = 0

    # --- helpers ----------------------------------------------------------------------------------------
    def tx(self, fn):
        return in_transaction(self.conn, fn)

    def snapshot(self):
        return footprint(self.conn, self.w.tenant_id, self.w.wallet_id)

    def rejected(self, exc, fn):
        """fn must raise exc and leave no trace."""
        before = self.snapshot()
        with pytest.raises(exc):
            self.tx(fn)
        assert self.snapshot() == before, "a rejected operation left a trace"
        STATS["rejected"] += 1

    # --- rules --------------------------------------------------------------------------------------------
    @rule(amount=st.integers(1, 300), promo=st.booleans(), days=st.integers(1, 6))
    def grant(self, amount, promo, days):
        expires = self.now + timedelta(days=days) if promo else None
        self.tx(lambda c: add_lot(c, self.w, amount, kind="PROMOTIONAL" if promo else "PAID", expires_at=expires))
        self.available += amount
        STATS["granted"] += 1

    @rule(seconds=st.integers(1, 10), policy=st.sampled_from(POLICIES + ("USAGE_BASED",)))
    def reserve(self, seconds, policy):
        amount = quote_for(seconds)
        live = self.conn.execute("""select coalesce(sum(remaining_amount), 0)::bigint as n from credit_lot
                                     where wallet_id = %s and (expires_at is null or expires_at > %s)""",
                                 (self.w.wallet_id, self.now)).fetchone()["n"]
        if amount > live:
            self.rejected((InsufficientCredit, LotsExhausted),
                          lambda c: make_task(c, self.w, policy=policy, seconds=seconds, now=self.now,
                                              price_version_id=Ctx.price_version))
            return
        task = self.tx(lambda c: make_task(c, self.w, policy=policy, seconds=seconds, now=self.now,
                                           price_version_id=Ctx.price_version))
        self.open_tasks.append({"task_id": task, "reserved": amount, "quoted": amount, "policy": policy, "seconds": seconds,
                                "pending": [], "charged": 0, "refunded": 0})
        self.available -= amount
        self.reserved += amount
        STATS["reserved"] += 1

    def _settle(self, t, payload, event_type, expected):
        s = self.tx(lambda c: settle_in(c, payload, self.now, event_type=event_type, event_id=uuid.uuid4()))
        assert s.outcome == "SETTLED" and s.charged == expected, (s, expected)
        STATS["settle_partial" if 0 < expected < t["reserved"] else "settle_full" if expected == t["reserved"] else "settle_zero"] += 1
        STATS["pending_refunds_applied"] += s.refunds_applied
        self.open_tasks.remove(t)
        self.reserved -= t["reserved"]
        self.available += t["reserved"] - expected
        self.consumed += expected
        t["charged"] = expected
        for amount in t.pop("pending"):  # refunds waiting for this settlement, in arrival order
            if amount <= t["charged"] - t["refunded"]:
                t["refunded"] += amount
                self.consumed -= amount
                self.available += amount
        t["pending"] = []
        self.settled.append(t)
        self.replays.append(("settle", payload, event_type))

    @precondition(lambda self: self.open_tasks)
    @rule(pick=st.integers(0, 10**6), outcome=st.sampled_from([("SUCCEEDED", "PROVIDER_SUCCEEDED")] * 6 + OUTCOMES),
          charged=st.booleans(), usage=st.one_of(st.none(), st.decimals(0, 6, places=1), st.decimals(0, 15, places=1)))
    def settle(self, pick, outcome, charged, usage):
        """Settle a reserved task with any terminal outcome: full, partial (usage below the quote),
        capped (usage above it), nothing (a failure or a cancellation), or BEFORE_DISPATCH (released
        by admission's cancel first, then settled as a no-op)."""
        t = self.open_tasks[pick % len(self.open_tasks)]
        state, stage = outcome
        if stage == "BEFORE_DISPATCH":
            def cancel(c):
                wallet = lock_wallet(c, self.w.tenant_id, self.w.wallet_id)
                release_remaining(c, wallet=wallet, task_id=t["task_id"], reason_code="CANCELLED_BEFORE_DISPATCH")
            self.tx(cancel)
            self._settle(t, {"task_id": str(t["task_id"]), "stage": "BEFORE_DISPATCH"}, "TaskCancelled", 0)
            return
        snap = policies.ChargeSnapshot(policy_code=t["policy"], quoted_amount=t["quoted"], reserved_open=t["reserved"],
                                       model_rules=RULES, params=PARAMS)
        expected = policies.decide(snap, policies.Outcome(state, stage, provider_charged=charged, usage_seconds=usage,
                                                          output_seconds=t["seconds"] if state == "SUCCEEDED" else 0)).amount
        payload = terminal(t["task_id"], self.w.tenant_id, state=state, stage=stage, provider_charged=charged,
                           seconds=None if usage is None else str(usage), cost="0.05" if charged else "0",
                           output_seconds=t["seconds"] if state == "SUCCEEDED" else 0)
        self._settle(t, payload, EVENT_TYPE[state], expected)

    @precondition(lambda self: self.open_tasks or self.settled)
    @rule(pick=st.integers(0, 10**6), raw=st.integers(1, 130), fits=st.booleans(), settled_first=st.booleans())
    def refund(self, pick, raw, fits, settled_first):
        """Refund a settled task (within or beyond what is refundable) or a task not settled yet
        (waits in PENDING_SETTLEMENT, or is refused if even the reservation cannot cover it)."""
        refundable = [t for t in self.settled if t["charged"] > t["refunded"]]
        pool = refundable if (settled_first and refundable) else self.open_tasks + self.settled
        t = pool[pick % len(pool)]
        room = (t["reserved"] - sum(t["pending"])) if t in self.open_tasks else (t["charged"] - t["refunded"])
        if fits and room > 0:  # a pending refund small enough for most charges, so settlements apply some
            amount = 1 + raw % (min(room, 20) if t in self.open_tasks else room)
        else:
            amount = raw
        key = uuid.uuid4().hex

        def do(c):
            return request_refund(c, operator=SUPPORT, tenant_id=self.w.tenant_id, task_id=t["task_id"], amount=amount,
                                  reason="model", now=self.now, request_key=key)
        if amount > room:
            self.rejected(RefundExceedsSettled, do)
            return
        out = self.tx(do)
        if t in self.open_tasks:
            assert out["state"] == "PENDING_SETTLEMENT"
            STATS["refund_pending"] += 1
            t["pending"].append(amount)
        else:
            assert out["state"] == "COMPLETED"
            STATS["refund_applied"] += 1
            t["refunded"] += amount
            self.consumed -= amount
            self.available += amount
        self.replays.append(("refund", do))

    @rule(amount=st.integers(1, 200), with_case=st.sampled_from([True, True, True, False]))
    def compensate(self, amount, with_case):
        self.case_no += 1
        case_id = f"case-{self.w.tenant_id}-{self.case_no}" if with_case else None

        def do(c):
            return request_compensation(c, operator=SUPPORT, tenant_id=self.w.tenant_id, case_id=case_id, amount=amount,
                                        reason_code="GOODWILL", evidence={"ticket": case_id}, now=self.now,
                                        dual_approval_above=THRESHOLD,
                                        expires_at=self.now + timedelta(days=3))
        if not with_case:
            self.rejected(CompensationInvalid, do)
            return
        assert self.tx(do)["state"] == "APPLIED"
        STATS["compensated"] += 1
        self.available += amount
        self.replays.append(("compensate", do))

    @rule(days=st.integers(0, 4), to_boundary=st.booleans())
    def expire(self, days, to_boundary):
        if to_boundary:  # land exactly on the next expiry, the boundary case
            nxt = self.conn.execute("""select min(expires_at) as t from credit_lot where wallet_id = %s and expires_at > %s""",
                                    (self.w.wallet_id, self.now)).fetchone()["t"]
            self.now = nxt or self.now
        else:
            self.now += timedelta(days=days)
        due = self._due(self.now)
        got = self.tx(lambda c: expiry.expire_wallet(c, wallet_id=self.w.wallet_id, tenant_id=self.w.tenant_id, now=self.now))
        assert got == due
        STATS["expired" if got else "expire_nothing"] += 1
        self.available -= got
        self.replays.append(("expire", self.now))

    def _due(self, at) -> int:
        return self.conn.execute("""select coalesce(sum(remaining_amount), 0)::bigint as n from credit_lot
                                     where wallet_id = %s and expires_at <= %s""", (self.w.wallet_id, at)).fetchone()["n"]

    @precondition(lambda self: self.replays)
    @rule(pick=st.integers(0, 10**6), prefer=st.sampled_from(["settle", "refund", "compensate", "expire"]))
    def replay(self, pick, prefer):
        pool = [r for r in self.replays if r[0] == prefer] or self.replays
        kind, *args = pool[pick % len(pool)]
        before = self.snapshot()
        if kind == "settle":
            payload, event_type = args
            s = self.tx(lambda c: settle_in(c, payload, self.now, event_type=event_type, event_id=uuid.uuid4()))
            assert s.outcome == "REPLAY"
        elif kind in ("refund", "compensate"):
            assert self.tx(args[0])["replayed"]
        else:
            # A sweep run again at the same instant books only what became due since: credit released
            # into an expired lot after the first sweep (a reservation that spanned the expiry).
            newly_due = self._due(args[0])
            got = self.tx(lambda c: expiry.expire_wallet(c, wallet_id=self.w.wallet_id, tenant_id=self.w.tenant_id,
                                                         now=args[0]))
            assert got == newly_due
            self.available -= got
        STATS[f"replay_{kind}"] += 1
        after = self.snapshot()
        if kind == "expire":  # lot rows may differ only if nothing was due; the ledger grows only by what was due
            if newly_due == 0:
                assert after["ledger_transaction"] == before["ledger_transaction"]
        else:
            assert after == before, f"replaying {kind} added something"

    # --- invariants ---------------------------------------------------------------------------------------------
    @invariant()
    def ledger_and_snapshot_agree(self):
        if not hasattr(self, "w"):
            return
        w = assert_invariants(self.conn, self.w.wallet_id)
        assert (w["available_amount"], w["reserved_amount"], w["consumed_amount"]) == (self.available, self.reserved, self.consumed)


@pytest.fixture(scope="module")
def machine_ctx(db_url):
    from aivedio.context import build_platform

    platform = build_platform(Settings(database_url=db_url, redis_url="none", home=TEST_HOME), PlatformConfig(), pool_size=2)
    with psycopg.connect(db_url, autocommit=True, row_factory=dict_row) as conn:
        Ctx.platform, Ctx.conn = platform, conn
        Ctx.price_version = price_book.ensure_price_book(conn, PlatformConfig(), T0 - timedelta(days=1))
        yield
    Ctx.platform = Ctx.conn = None
    platform.close()


def test_ledger_state_machine(machine_ctx):
    # CI explores the same 200 examples every run (a red build is a regression, not a dice roll);
    # AIVEDIO_HYPOTHESIS_EXPLORE=1 draws new ones, for a longer hunt on a workstation.
    explore = os.environ.get("AIVEDIO_HYPOTHESIS_EXPLORE") == "1"
    run_state_machine_as_test(LedgerMachine, settings=settings(
        max_examples=200, stateful_step_count=15, deadline=None, derandomize=not explore, database=None if not explore else settings.default.database,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]))
    # Hypothesis switches rules off per example (swarm testing), so single paths vary from run to
    # run; each family must have been taken, and the detail is printed for the curious (-s).
    families = {"credit in": ("granted", "compensated"), "reserve": ("reserved",), "rejected": ("rejected",),
                "settle": ("settle_full", "settle_partial", "settle_zero"), "refund": ("refund_applied", "refund_pending"),
                "expire": ("expired",), "replay": ("replay_settle", "replay_refund", "replay_compensate", "replay_expire")}
    print("ledger state machine paths:", dict(sorted(STATS.items())))
    missing = {name for name, keys in families.items() if not any(STATS[k] for k in keys)}
    assert not missing, f"the examples never exercised {missing}: {dict(STATS)}"
