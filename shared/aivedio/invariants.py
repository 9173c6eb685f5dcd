"""What must hold of the platform's facts whatever happened (ch. 18.16.6, 20.8.4, 20.8.5), stated once.

Each invariant has a name, the promise it keeps, and the one statement that counts what breaks it
in PostgreSQL. The same promises are checked in three places, and all three read them here:
- the wallet check (aivedio.billing.wallet_checks) runs `wallet_findings` under a wallet's lock and
  freezes a wallet that breaks one;
- the demo's verdicts (aivedio_tools.demo.report) and simulate's end-of-run checks
  (aivedio_tools.simulate.checks) count each invariant over the database a run left;
- the chaos checkers (aivedio_tools.chaos.checkers) check a run offline from the rows it recorded,
  with the pure forms at the end of this module (`unbalanced`, `wallet_differences`, `shard_problem`),
  which say the same as the statements above them.

Terminal states come from aivedio.tasks, the buckets from aivedio.billing.ledger; no list is
written twice. A statement takes `terminal` (the terminal states) and `tasks` (task ids to look
at, or None for every task) as parameters, so a run can be judged on its own tasks."""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import psycopg

from aivedio.billing.ledger import SNAPSHOT_COLUMNS, ledger_aggregate
from aivedio.tasks import TERMINAL

TERMINAL_STATES = sorted(TERMINAL)  # the statements' %(terminal)s
POSTPAID = "POSTPAID"  # wallet_account.account_type: may go below zero, within its credit limit; it has no lots
CLOSED_CREDIT_RESERVATION = frozenset({"SETTLED", "RELEASED", "PARTIALLY_REFUNDED", "REFUNDED"})
_SCOPED = "(%(tasks)s::uuid[] is null or t.task_id = any(%(tasks)s::uuid[]))"


@dataclass(frozen=True)
class Invariant:
    name: str
    promise: str
    statement: str  # one row whose `n` counts the facts that break it


LEDGER_BALANCED = Invariant(
    "ledger_balanced", "every ledger transaction's entries sum to zero",
    """select count(*)::int as n from (select ledger_txn_id from ledger_entry
                                         group by ledger_txn_id having sum(amount_delta) <> 0) u""")
EVERY_TASK_TERMINAL = Invariant(
    "every_task_terminal", "every task ended (once the work stops)",
    f"select count(*)::int as n from generation_task t where {_SCOPED} and t.state <> all(%(terminal)s)")
NOTHING_HELD_BY_TERMINAL_TASKS = Invariant(
    "no_active_reservation_for_finished_task", "a terminal task holds no capacity",
    f"""select count(*)::int as n from resource_reservation r join generation_task t using (task_id)
         where r.state = 'ACTIVE' and t.state = any(%(terminal)s) and {_SCOPED}""")
NO_OPEN_CREDIT_ON_TERMINAL_TASKS = Invariant(
    "no_open_credit_on_finished_task", "a terminal task's credit reservation is closed: settled or released in full",
    f"""select count(*)::int as n from credit_reservation c join generation_task t using (task_id)
         where t.state = any(%(terminal)s) and c.reserved_amount - c.settled_amount - c.released_amount > 0
           and {_SCOPED}""")
SHARDS_WITHIN_CAPACITY = Invariant(
    "shard_counters_within_0_and_capacity", "a capacity shard's used units lie in [0, capacity]",
    """select count(*)::int as n from resource_pool_shard where used_units < 0 or used_units > capacity_units""")
SHARDS_EQUAL_ACTIVE_RESERVATIONS = Invariant(
    "shard_counters_equal_active_reservations",
    "a capacity shard's used units are its ACTIVE reservations: the reservations are the facts, the counter derived",
    """select count(*)::int as n from (
           select s.used_units, coalesce(sum(r.reserved_units), 0) as active
             from resource_pool_shard s
             left join resource_reservation r on r.resource_key = s.resource_key and r.shard_no = s.shard_no
                                             and r.state = 'ACTIVE'
            group by s.resource_key, s.shard_no, s.used_units) x
        where used_units <> active""")
RESERVATIONS_OF_LIVE_ATTEMPTS = Invariant(
    "active_reservations_belong_to_live_attempts",
    "an ACTIVE reservation belongs to its task's current attempt, which has not ended (without the media step,"
    " whose worker slots the attempt that succeeded holds)",
    """select count(*)::int as n from resource_reservation r
         join task_attempt a using (attempt_id) join generation_task t on t.task_id = r.task_id
        where r.state = 'ACTIVE' and (a.state = any(%(terminal)s) or t.current_attempt_id <> a.attempt_id)""")
RUNNING_TASKS_HOLD_THEIR_LANE = Invariant(
    "running_tasks_hold_a_lane_reservation", "a task at the provider holds its lane's capacity",
    """select count(*)::int as n from generation_task t
        where t.state in ('DISPATCHING', 'RUNNING')
          and not exists (select 1 from resource_reservation r where r.attempt_id = t.current_attempt_id
                            and r.state = 'ACTIVE' and r.resource_key like 'lane:%%')""")
DRR_NON_NEGATIVE = Invariant(
    "drr_deficits_nonnegative", "a tenant's DRR deficit and fairness debt never go below zero",
    "select count(*)::int as n from drr_lane_tenant where deficit < 0 or fairness_debt < 0")
TASK_ROWS_CONSISTENT = Invariant(
    "task_rows_consistent", "a succeeded task started and finished in that order; a queued task has no attempt",
    """select count(*)::int as n from generation_task
        where (state = 'SUCCEEDED' and (started_at is null or finished_at is null or finished_at < started_at))
           or (state = 'QUEUED' and current_attempt_id is not null)""")

# What a run's database must show once its work has stopped (the demo's verdicts, simulate).
AT_REST = (LEDGER_BALANCED, EVERY_TASK_TERMINAL, NOTHING_HELD_BY_TERMINAL_TASKS, NO_OPEN_CREDIT_ON_TERMINAL_TASKS)
# What holds at every moment of a run without the media step, work running or not (simulate
# checks them at the end of every run).
ALWAYS = (SHARDS_WITHIN_CAPACITY, SHARDS_EQUAL_ACTIVE_RESERVATIONS, NOTHING_HELD_BY_TERMINAL_TASKS,
          RESERVATIONS_OF_LIVE_ATTEMPTS, RUNNING_TASKS_HOLD_THEIR_LANE, DRR_NON_NEGATIVE, TASK_ROWS_CONSISTENT)


def broken(conn: psycopg.Connection, invariant: Invariant, tasks: list[str] | None = None) -> int:
    """How many facts break `invariant` (over `tasks`, or every task)."""
    return int(conn.execute(invariant.statement, {"terminal": TERMINAL_STATES, "tasks": tasks}).fetchone()["n"])


# --- one wallet ----------------------------------------------------------------------------------------

# What the wallet holds reserved: its reservations' open parts, and the spend allowances of its
# admission slots (billing.allowances: credit reserved for a slot, not yet for a task).
OPEN_RESERVED = """
select (select coalesce(sum(reserved_amount - settled_amount - released_amount), 0)
          from credit_reservation where wallet_id = %(w)s)
     + (select coalesce(sum(amount), 0) from wallet_allowance where wallet_id = %(w)s) as n
"""
LOTS = """
select coalesce(sum(remaining_amount), 0)::bigint as remaining, coalesce(sum(reserved_amount), 0)::bigint as reserved,
       count(*) as lots
  from credit_lot where wallet_id = %s
"""
UNBALANCED_OF_WALLET = """
select count(*) as n from (select ledger_txn_id from ledger_entry where wallet_id = %s
                            group by ledger_txn_id having sum(amount_delta) <> 0) u
"""


def wallet_findings(conn: psycopg.Connection, wallet: dict) -> list[dict]:
    """What is inconsistent in one wallet (the caller holds its lock): the snapshot (available,
    reserved, consumed) against the ledger's aggregate per bucket; reserved against the open part of
    its reservations and allowances; for a wallet with lots, the lots' remaining and reserved
    against available and reserved; and its ledger transactions that do not sum to zero."""
    wid = wallet["wallet_id"]
    agg = ledger_aggregate(conn, wid)
    out = []

    def cmp(kind: str, expected: int, actual: int) -> None:
        if expected != actual:
            out.append({"kind": kind, "expected": int(expected), "actual": int(actual)})

    for bucket, column in SNAPSHOT_COLUMNS.items():
        cmp(f"SNAPSHOT_{bucket}", agg.get(bucket, 0), wallet[column])
    cmp("RESERVED_VS_RESERVATIONS", conn.execute(OPEN_RESERVED, {"w": wid}).fetchone()["n"], wallet["reserved_amount"])
    if wallet["account_type"] != POSTPAID:
        lots = conn.execute(LOTS, (wid,)).fetchone()
        cmp("LOTS_VS_AVAILABLE", lots["remaining"], wallet["available_amount"])
        cmp("LOTS_VS_RESERVED", lots["reserved"], wallet["reserved_amount"])
    cmp("UNBALANCED_TRANSACTIONS", 0, conn.execute(UNBALANCED_OF_WALLET, (wid,)).fetchone()["n"])
    return out


# --- the same promises over recorded rows (a chaos run's facts, checked offline) ------------------------------

def unbalanced(entries: Iterable[dict[str, Any]]) -> dict[Any, dict[str, int]]:
    """LEDGER_BALANCED over ledger_entry rows: each transaction whose entries do not sum to zero,
    with its sum per unit."""
    sums: dict[Any, Counter] = {}
    for e in entries:
        sums.setdefault(e["ledger_txn_id"], Counter())[e["unit_code"]] += e["amount_delta"]
    return {txn: dict(s) for txn, s in sums.items() if any(s.values())}


def wallet_differences(wallet: dict[str, Any], aggregate: dict[str, int], lots: list[dict[str, Any]],
                       open_reserved: int | None) -> dict[str, tuple[int, int]]:
    """wallet_findings over rows: (expected, actual) of each snapshot column that disagrees with the
    ledger's `aggregate` per bucket, with its open reservations (None: not recorded) and its lots."""
    diffs = {col: (aggregate.get(bucket, 0), wallet[col]) for bucket, col in SNAPSHOT_COLUMNS.items()
             if aggregate.get(bucket, 0) != wallet[col]}
    if open_reserved is not None and open_reserved != wallet["reserved_amount"]:
        diffs["reserved vs open reservations"] = (open_reserved, wallet["reserved_amount"])
    if wallet["account_type"] != POSTPAID:
        for what, col, lot_col in (("lots remaining", "available_amount", "remaining_amount"),
                                   ("lots reserved", "reserved_amount", "reserved_amount")):
            total = sum(lot[lot_col] for lot in lots)
            if total != wallet[col]:
                diffs[f"{col} vs {what}"] = (total, wallet[col])
    return diffs


def shard_problem(shard: dict[str, Any], active: int) -> str | None:
    """SHARDS_EQUAL_ACTIVE_RESERVATIONS and SHARDS_WITHIN_CAPACITY for one resource_pool_shard row,
    given its ACTIVE reservations' units; None when both hold."""
    used, cap = shard["used_units"], shard["capacity_units"]
    if used != active:
        return f"used {used} != ACTIVE reservations {active}"
    if not 0 <= used <= cap:
        return f"used {used} outside [0, {cap}]"
    return None
