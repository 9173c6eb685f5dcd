"""Spend allowances of a partitioned wallet (ch. 20.11.4; migration 0195): credit the wallet has
reserved for admission slots, so the admissions of a tenant whose many users share one wallet do
not all lock that one row.

- partition(): an operator gives a wallet `slots` slots (a user always admits through the slot its
  id hashes to) and the chunk a refill carves for a slot. A wallet with credit lots (PREPAID,
  SUBSCRIPTION) holds its allowances per lot; a POSTPAID wallet, which has none, holds them as
  allowances of no lot (lot_id null), carved from its credit line within its credit limit and the
  period's contract budget (migration 0230).
- the admission (aivedio_admit) carves and spends the allowances; see the migration.
- return_all(): every allowance of a wallet back to it, a RELEASE per wallet (RESERVED ->
  AVAILABLE of the very lots), under the lock order of everything that locks both: the allowance
  rows first, then the wallet (FOR NO KEY UPDATE). The allowance-return maintenance service runs it
  on a schedule; unpartition() runs it at once.

The ledger stays the one truth: a carve is a RESERVE (reason ALLOWANCE) and a return a RELEASE
(reason ALLOWANCE_RETURN), and the wallet's RESERVED bucket is its open reservations plus its
allowances, which billing.wallet_checks counts."""
from __future__ import annotations

import uuid
from uuid import UUID

import psycopg

from aivedio import audit
from aivedio.billing.ledger import Entry, post
from aivedio.errors import InvalidRequest, NotFound

DEFAULT_SLOTS = 16
DEFAULT_FAST_MAX_UNITS = 64  # a task with more fairness units takes the merged path
DEFAULT_FAST_MAX_COST_UNITS = 100_000
RETURN_REASON = "ALLOWANCE_RETURN"

# Every allowance row of a wallet, in the lock order (slot, lot).
LOCK_ALLOWANCES = """
select slot, lot_id, amount from wallet_allowance where wallet_id = %s order by slot, lot_id for update
"""
LOCK_WALLET_NO_KEY = "select * from wallet_account where wallet_id = %s for no key update"
HELD_BY_WALLET = "select coalesce(sum(amount), 0)::bigint as n from wallet_allowance where wallet_id = %s"
HELD_BY_LOT = "select lot_id, coalesce(sum(amount), 0)::bigint as n from wallet_allowance where wallet_id = %s group by lot_id"
RETURN_TO_LOTS = """
update credit_lot l set reserved_amount = l.reserved_amount - r.n, remaining_amount = l.remaining_amount + r.n
  from unnest(%(lots)s::uuid[], %(amounts)s::bigint[]) as r(lot_id, n)
 where l.lot_id = r.lot_id
"""
DELETE_ALLOWANCES = "delete from wallet_allowance where wallet_id = %s"


def lock_allowances(conn: psycopg.Connection, wallet_id: UUID) -> list[dict]:
    """Lock a wallet's allowance rows: before its wallet row, by whoever locks both."""
    return conn.execute(LOCK_ALLOWANCES, (wallet_id,)).fetchall()


def held(conn: psycopg.Connection, wallet_id: UUID) -> int:
    """Credit the wallet's slots hold (part of its RESERVED)."""
    return conn.execute(HELD_BY_WALLET, (wallet_id,)).fetchone()["n"]


def held_by_lot(conn: psycopg.Connection, wallet_id: UUID) -> dict[UUID, int]:
    return {r["lot_id"]: r["n"] for r in conn.execute(HELD_BY_LOT, (wallet_id,)).fetchall()}


def return_all(conn: psycopg.Connection, wallet_id: UUID) -> int:
    """Give every allowance of the wallet back (one RELEASE); returns the amount. The caller's
    transaction; the allowance rows are locked here, then the wallet."""
    rows = lock_allowances(conn, wallet_id)
    per_lot: dict[UUID | None, int] = {}  # None: a POSTPAID wallet's allowance, of no lot
    for r in rows:
        if r["amount"]:
            per_lot[r["lot_id"]] = per_lot.get(r["lot_id"], 0) + r["amount"]
    total = sum(per_lot.values())
    if rows:
        wallet = conn.execute(LOCK_WALLET_NO_KEY, (wallet_id,)).fetchone()
        if total:
            entries = []
            for lot_id, n in sorted(per_lot.items(), key=lambda kv: (kv[0] is None, str(kv[0]))):
                entries += [Entry("RESERVED", -n, lot_id), Entry("AVAILABLE", n, lot_id)]
            post(conn, wallet=wallet, business_key=f"allowance:return:{uuid.uuid4()}", event_type="RELEASE", entries=entries,
                 reason_code=RETURN_REASON, metadata={"slots": sorted({r["slot"] for r in rows if r["amount"]})})
            conn.execute(RETURN_TO_LOTS, {"lots": list(per_lot), "amounts": list(per_lot.values())})
        conn.execute(DELETE_ALLOWANCES, (wallet_id,))
    return total


def partition(conn: psycopg.Connection, *, operator: str, tenant_id: UUID, slots: int = DEFAULT_SLOTS,
              chunk_amount: int, fast_max_units: int = DEFAULT_FAST_MAX_UNITS,
              fast_max_cost_units: int = DEFAULT_FAST_MAX_COST_UNITS, reason: str | None = None) -> dict:
    """Partition the tenant's wallet (or change its partitioning: the allowances go back first, so
    no slot holds credit under an old slot count). Audited."""
    bad = {}
    if not 2 <= slots <= 256:
        bad["slots"] = "2 to 256"
    for name, v in (("chunk_amount", chunk_amount), ("fast_max_units", fast_max_units), ("fast_max_cost_units", fast_max_cost_units)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            bad[name] = "a positive integer"
    if bad:
        raise InvalidRequest("invalid wallet partitioning", bad)
    w = conn.execute("select wallet_id from wallet_account where tenant_id = %s order by wallet_id limit 1",
                     (tenant_id,)).fetchone()
    if w is None:
        raise NotFound(f"tenant {tenant_id} has no wallet")
    returned = return_all(conn, w["wallet_id"])
    old = conn.execute("select slots, chunk_amount from wallet_partitioning where wallet_id = %s", (w["wallet_id"],)).fetchone()
    conn.execute(
        """insert into wallet_partitioning (wallet_id, tenant_id, slots, chunk_amount, fast_max_units, fast_max_cost_units)
           values (%s, %s, %s, %s, %s, %s)
           on conflict (wallet_id) do update set slots = excluded.slots, chunk_amount = excluded.chunk_amount,
                 fast_max_units = excluded.fast_max_units, fast_max_cost_units = excluded.fast_max_cost_units,
                 updated_at = now()""",
        (w["wallet_id"], tenant_id, slots, chunk_amount, fast_max_units, fast_max_cost_units))
    audit.append(conn, operator=operator, action="wallet.partition", target=f"wallet:{w['wallet_id']}", tenant_id=tenant_id,
                 old=dict(old) if old else None, new={"slots": slots, "chunk_amount": chunk_amount}, reason=reason)
    return {"wallet_id": str(w["wallet_id"]), "slots": slots, "chunk_amount": chunk_amount, "returned": returned}


def unpartition(conn: psycopg.Connection, *, operator: str, tenant_id: UUID, reason: str | None = None) -> dict:
    """Back to one wallet row: every allowance returned, the partitioning removed. Audited."""
    w = conn.execute("select wallet_id from wallet_account where tenant_id = %s order by wallet_id limit 1", (tenant_id,)).fetchone()
    if w is None:
        raise NotFound(f"tenant {tenant_id} has no wallet")
    returned = return_all(conn, w["wallet_id"])
    gone = conn.execute("delete from wallet_partitioning where wallet_id = %s returning slots", (w["wallet_id"],)).fetchone()
    audit.append(conn, operator=operator, action="wallet.unpartition", target=f"wallet:{w['wallet_id']}", tenant_id=tenant_id,
                 old={"slots": gone["slots"]} if gone else None, new=None, reason=reason)
    return {"wallet_id": str(w["wallet_id"]), "returned": returned, "was_partitioned": gone is not None}
