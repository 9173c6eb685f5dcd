"""Contract budgets of enterprise POSTPAID wallets (ch. 20.1.2: "企业后付费：不是检查余额，而是检查信用
额度、合同预算和账期内累计应收"; ch. 20.6.2 step 6; and "对于企业后付费，预占的对象不是余额，而是信用额度和
合同预算").

A POSTPAID wallet reserves against its credit limit and, when an operator set one for the billing
period, against its contract budget: the receivable accrued in the period (credits SETTLED in it
minus credits REFUNDED in it) + what the wallet holds reserved now + the new amount may not exceed
the budget. reservations.ensure_reservable applies it, so a refusal is an InsufficientCredit, as
one beyond the credit limit is (admission answers REJECT_INSUFFICIENT_CREDIT and writes nothing).
A wallet with no budget for the period is limited by its credit limit alone.

Periods are explicit, [period_start, period_end) per wallet (a contract's billing periods need not
be calendar months), and never overlap. A posting belongs to the period holding its time, the
`now` of the settlement or refund (the platform's one clock), so the next period starts fresh. The
accrual lives in two counters on the period's row, moved in the same transaction as the SETTLE and
REFUND postings under the wallet lock: the check at reservation time reads one row. A period set
after it began starts from what it already holds (accrued_from_facts), the same figure the
counters must always equal."""
from __future__ import annotations

from datetime import datetime
from uuid import UUID

import psycopg

from aivedio import audit
from aivedio.billing import allowances
from aivedio.billing.ledger import lock_wallet
from aivedio.errors import Conflict, InvalidRequest, NotFound

# The one candidate is the latest period starting at or before `now` (periods never overlap).
IN_FORCE = """
select * from (select * from contract_budget where wallet_id = %(wallet_id)s and period_start <= %(now)s
                order by period_start desc limit 1) b
 where b.period_end > %(now)s
"""

# What the settlements and refunds of a wallet put in [start, end), at the times they were applied.
FACTS = """
select (select coalesce(sum(r.settled_amount), 0)::bigint
          from credit_reservation r join generation_charge c using (task_id)
         where r.wallet_id = %(wallet_id)s and c.finalized_at >= %(start)s and c.finalized_at < %(end)s) as settled,
       (select coalesce(sum(f.amount), 0)::bigint
          from refund_request f join credit_reservation r using (task_id)
         where r.wallet_id = %(wallet_id)s and f.state = 'COMPLETED' and f.completed_at >= %(start)s and f.completed_at < %(end)s)
       as refunded
"""

# Needs no answer: it travels in settlement's pipeline. A wallet with no period in force moves nothing.
ACCRUE = """
update contract_budget b
   set settled_amount = b.settled_amount + d.settled, refunded_amount = b.refunded_amount + d.refunded,
       version = b.version + 1, updated_at = now()
  from unnest(%(wallets)s::uuid[], %(settled)s::bigint[], %(refunded)s::bigint[]) as d(wallet_id, settled, refunded)
 where b.wallet_id = d.wallet_id and b.period_start <= %(now)s and b.period_end > %(now)s
"""


def in_force(conn: psycopg.Connection, wallet_id: UUID, now: datetime) -> dict | None:
    return conn.execute(IN_FORCE, {"wallet_id": wallet_id, "now": now}).fetchone()


def headroom(conn: psycopg.Connection, wallet: dict, now: datetime) -> int | None:
    """What the wallet may still reserve under its contract budget at `now` (None: no budget in
    force). The caller holds the wallet lock, so `wallet["reserved_amount"]` is current."""
    if wallet["account_type"] != "POSTPAID":
        return None
    b = in_force(conn, wallet["wallet_id"], now)
    if b is None:
        return None
    return b["budget_amount"] - (b["settled_amount"] - b["refunded_amount"]) - wallet["reserved_amount"]


def accrue(conn: psycopg.Connection, *, now: datetime, settled: dict[UUID, int] | None = None,
           refunded: dict[UUID, int] | None = None) -> None:
    """Add credits settled or refunded at `now` to the POSTPAID wallets' periods in force (keys are
    wallet ids). The caller holds the wallet locks and posts the SETTLE or REFUND in the same
    transaction."""
    settled, refunded = settled or {}, refunded or {}
    wallets = [w for w in {**settled, **refunded} if settled.get(w) or refunded.get(w)]
    if wallets:
        conn.execute(ACCRUE, {"now": now, "wallets": wallets, "settled": [settled.get(w, 0) for w in wallets],
                              "refunded": [refunded.get(w, 0) for w in wallets]})


def accrued_from_facts(conn: psycopg.Connection, wallet_id: UUID, start: datetime, end: datetime) -> dict:
    """{"settled", "refunded"} in [start, end), from the charges and refunds themselves."""
    return dict(conn.execute(FACTS, {"wallet_id": wallet_id, "start": start, "end": end}).fetchone())


def set_contract_budget(conn: psycopg.Connection, *, operator: str, tenant_id: UUID, period_start: datetime,
                        period_end: datetime, budget_amount: int, reason: str | None = None) -> dict:
    """Create the tenant's POSTPAID wallet's budget for [period_start, period_end), or change the
    amount of exactly that period. Audited; a refusal writes nothing."""
    bad = {}
    if not isinstance(budget_amount, int) or isinstance(budget_amount, bool) or budget_amount < 0:
        bad["budget_amount"] = "a non-negative integer of credit units"
    if period_end <= period_start:
        bad["period_end"] = "after period_start"
    if bad:
        raise InvalidRequest("invalid contract budget", bad)
    w = conn.execute(
        "select wallet_id from wallet_account where tenant_id = %s and account_type = 'POSTPAID' order by wallet_id limit 1",
        (tenant_id,)).fetchone()
    if w is None:
        raise NotFound(f"tenant {tenant_id} has no POSTPAID wallet")
    # A partitioned wallet's slots hold credit carved under the budget in force: it goes back first
    # (the allowances, then the wallet: the lock order of 0195), so a cut binds the next admission.
    allowances.return_all(conn, w["wallet_id"])
    wallet = lock_wallet(conn, tenant_id, w["wallet_id"])  # the lock every accrual and reservation of this wallet takes
    clash = conn.execute(
        """select period_start, period_end from contract_budget
            where wallet_id = %(w)s and period_start < %(end)s and period_end > %(start)s
              and (period_start, period_end) <> (%(start)s, %(end)s)""",
        {"w": wallet["wallet_id"], "start": period_start, "end": period_end}).fetchone()
    if clash is not None:
        raise Conflict(f"overlaps the period {clash['period_start'].isoformat()} to {clash['period_end'].isoformat()}",
                       code="CONTRACT_PERIOD_OVERLAP")
    old = conn.execute("select * from contract_budget where wallet_id = %s and period_start = %s",
                       (wallet["wallet_id"], period_start)).fetchone()
    if old is None:
        facts = accrued_from_facts(conn, wallet["wallet_id"], period_start, period_end)
        row = conn.execute(
            """insert into contract_budget (wallet_id, tenant_id, period_start, period_end, budget_amount, settled_amount,
                                            refunded_amount)
               values (%s, %s, %s, %s, %s, %s, %s) returning *""",
            (wallet["wallet_id"], tenant_id, period_start, period_end, budget_amount, facts["settled"], facts["refunded"])).fetchone()
    else:
        row = conn.execute(
            """update contract_budget set budget_amount = %s, version = version + 1, updated_at = now()
                where wallet_id = %s and period_start = %s returning *""",
            (budget_amount, wallet["wallet_id"], period_start)).fetchone()
    audit.append(conn, operator=operator, action="contract_budget.set", target=f"wallet:{wallet['wallet_id']}", tenant_id=tenant_id,
                 old={"budget_amount": old["budget_amount"]} if old else None,
                 new={"budget_amount": budget_amount, "period": [period_start.isoformat(), period_end.isoformat()]}, reason=reason)
    return {**row, "reserved_amount": wallet["reserved_amount"]}
