"""The append-only double-entry ledger and the wallet snapshot beside it.

Every movement is one ledger_transaction with entries summing to zero (the database checks this at
commit, too). A business key is unique per wallet: posting the same key again adds nothing and
returns the first transaction, so at-least-once callers are safe. The snapshot columns of
wallet_account change in the same transaction as the entries, under the wallet's row lock."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable
from uuid import UUID

import psycopg

# Buckets that the wallet snapshot mirrors; ISSUED and EXPIRED are contra buckets outside it.
SNAPSHOT_COLUMNS = {"AVAILABLE": "available_amount", "RESERVED": "reserved_amount", "CONSUMED": "consumed_amount"}


class UnbalancedTransaction(ValueError):
    pass


@dataclass(frozen=True)
class Entry:
    bucket: str
    amount_delta: int
    lot_id: UUID | None = None


@dataclass(frozen=True)
class Posted:
    ledger_txn_id: UUID
    created: bool  # False: the business key existed; nothing was added


def lock_wallet(conn: psycopg.Connection, tenant_id: UUID, wallet_id: UUID | None = None) -> dict | None:
    """SELECT ... FOR UPDATE the tenant's wallet: every balance change for a wallet goes through here."""
    if wallet_id is None:
        return conn.execute(
            "select * from wallet_account where tenant_id = %s order by wallet_id limit 1 for update", (tenant_id,)
        ).fetchone()
    return conn.execute(
        "select * from wallet_account where tenant_id = %s and wallet_id = %s for update", (tenant_id, wallet_id)
    ).fetchone()


def find_transaction(conn: psycopg.Connection, wallet_id: UUID, business_key: str) -> dict | None:
    return conn.execute(
        "select * from ledger_transaction where wallet_id = %s and business_key = %s", (wallet_id, business_key)
    ).fetchone()


def post(
    conn: psycopg.Connection,
    *,
    wallet: dict,
    business_key: str,
    event_type: str,
    entries: Iterable[Entry],
    task_id: UUID | None = None,
    reservation_id: UUID | None = None,
    reversal_of: UUID | None = None,
    reason_code: str | None = None,
    metadata: dict | None = None,
) -> Posted:
    """Append one balanced transaction and move the snapshot. The caller holds the wallet lock."""
    entries = [e for e in entries if e.amount_delta != 0]
    if not entries:
        raise UnbalancedTransaction(f"{event_type} {business_key}: a ledger transaction needs entries; post nothing for zero")
    if sum(e.amount_delta for e in entries) != 0:
        raise UnbalancedTransaction(f"{event_type} {business_key}: entries sum to {sum(e.amount_delta for e in entries)}")
    row = conn.execute(
        """insert into ledger_transaction
               (wallet_id, tenant_id, business_key, event_type, task_id, reservation_id, reversal_of, reason_code, metadata)
           values (%s, %s, %s, %s, %s, %s, %s, %s, %s)
           on conflict (wallet_id, business_key) do nothing
           returning ledger_txn_id""",
        (wallet["wallet_id"], wallet["tenant_id"], business_key, event_type, task_id, reservation_id, reversal_of,
         reason_code, json.dumps(metadata or {})),
    ).fetchone()
    if row is None:
        existing = find_transaction(conn, wallet["wallet_id"], business_key)
        return Posted(existing["ledger_txn_id"], False)
    txn_id = row["ledger_txn_id"]
    with conn.cursor() as cur:
        cur.executemany(
            """insert into ledger_entry (ledger_txn_id, wallet_id, lot_id, bucket, amount_delta, unit_code)
               values (%s, %s, %s, %s, %s, %s)""",
            [(txn_id, wallet["wallet_id"], e.lot_id, e.bucket, e.amount_delta, wallet["unit_code"]) for e in entries],
        )
    deltas = {col: 0 for col in SNAPSHOT_COLUMNS.values()}
    for e in entries:
        if e.bucket in SNAPSHOT_COLUMNS:
            deltas[SNAPSHOT_COLUMNS[e.bucket]] += e.amount_delta
    if any(deltas.values()):
        conn.execute(
            """update wallet_account
                  set available_amount = available_amount + %(available_amount)s,
                      reserved_amount = reserved_amount + %(reserved_amount)s,
                      consumed_amount = consumed_amount + %(consumed_amount)s,
                      version = version + 1, updated_at = now()
                where wallet_id = %(wallet_id)s""",
            {**deltas, "wallet_id": wallet["wallet_id"]},
        )
        for col, d in deltas.items():
            wallet[col] = wallet[col] + d
    return Posted(txn_id, True)


def ledger_aggregate(conn: psycopg.Connection, wallet_id: UUID) -> dict[str, int]:
    """Sum of entries per bucket: what the snapshot must equal."""
    rows = conn.execute(
        "select bucket, coalesce(sum(amount_delta), 0)::bigint as total from ledger_entry where wallet_id = %s group by bucket",
        (wallet_id,),
    ).fetchall()
    return {r["bucket"]: int(r["total"]) for r in rows}
