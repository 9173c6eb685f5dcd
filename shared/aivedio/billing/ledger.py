"""The append-only double-entry ledger and the wallet snapshot beside it.

Every movement is one ledger_transaction with entries summing to zero (the database checks this at
commit, too). A business key is unique per wallet: posting the same key again adds nothing and
returns the first transaction, so at-least-once callers are safe. The snapshot columns of
wallet_account change in the same transaction as the entries, under the wallet's row lock."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
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
    """Lock the tenant's wallet: every balance change for a wallet goes through here. FOR NO KEY
    UPDATE: it excludes every other balance change as FOR UPDATE did (they all take it, or update
    the row), and lets through the FOR KEY SHARE of foreign-key checks, which the wallet's key never
    needs to wait for; a partitioned wallet's slot admissions (migration 0195) make such checks
    without the wallet lock, and FOR UPDATE would make them wait, and deadlock with a holder that
    then waits for one of their lots."""
    if wallet_id is None:
        return conn.execute(
            "select * from wallet_account where tenant_id = %s order by wallet_id limit 1 for no key update", (tenant_id,)
        ).fetchone()
    return conn.execute(
        "select * from wallet_account where tenant_id = %s and wallet_id = %s for no key update", (tenant_id, wallet_id)
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
               (wallet_id, tenant_id, unit_code, business_key, event_type, task_id, reservation_id, reversal_of, reason_code,
                metadata)
           values (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
           on conflict (wallet_id, business_key) do nothing
           returning ledger_txn_id""",
        (wallet["wallet_id"], wallet["tenant_id"], wallet["unit_code"], business_key, event_type, task_id, reservation_id,
         reversal_of, reason_code, json.dumps(metadata or {})),
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


@dataclass(frozen=True)
class Posting:
    """One transaction for append(): its id is chosen here, so no answer is awaited."""

    business_key: str
    event_type: str
    entries: tuple[Entry, ...]
    task_id: UUID | None = None
    reservation_id: UUID | None = None
    reversal_of: UUID | None = None
    reason_code: str | None = None
    metadata: dict | None = None
    ledger_txn_id: UUID = field(default_factory=uuid.uuid4)


# Headers, entries and the snapshots in one statement, for any number of wallets (entries reference
# their header through a deferred foreign key, checked at commit with the balance trigger).
APPEND = """
with txn as (
    insert into ledger_transaction (ledger_txn_id, wallet_id, tenant_id, unit_code, business_key, event_type, task_id,
                                    reservation_id, reversal_of, reason_code, metadata)
    select * from unnest(%(ids)s::uuid[], %(wallets)s::uuid[], %(tenants)s::uuid[], %(h_units)s::text[], %(keys)s::text[],
                         %(types)s::text[], %(tasks)s::uuid[], %(reservations)s::uuid[], %(reversals)s::uuid[],
                         %(reasons)s::text[], %(metadata)s::jsonb[])),
entries as (
    insert into ledger_entry (ledger_txn_id, wallet_id, tenant_id, lot_id, bucket, amount_delta, unit_code)
    select * from unnest(%(txns)s::uuid[], %(e_wallets)s::uuid[], %(e_tenants)s::uuid[], %(lots)s::uuid[], %(buckets)s::text[],
                         %(amounts)s::bigint[], %(units)s::text[]))
update wallet_account w
   set available_amount = w.available_amount + d.available, reserved_amount = w.reserved_amount + d.reserved,
       consumed_amount = w.consumed_amount + d.consumed, version = w.version + 1, updated_at = now()
  from unnest(%(d_wallets)s::uuid[], %(d_available)s::bigint[], %(d_reserved)s::bigint[], %(d_consumed)s::bigint[])
       as d(wallet_id, available, reserved, consumed)
 where w.wallet_id = d.wallet_id
"""


def append(conn: psycopg.Connection, *, wallet: dict | None = None, postings: Iterable[Posting] = (),
           by_wallet: Iterable[tuple[dict, Iterable[Posting]]] = ()) -> list[UUID]:
    """Append balanced transactions, to one wallet (`wallet`, `postings`) or to several
    (`by_wallet`: (wallet, postings) pairs), and move each snapshot once, in one statement that
    needs no answer (so it travels in a pipeline). For hot paths whose caller has already made sure,
    under the wallet locks, that the business keys are new (settlement's finalized snapshot): a key
    that exists anyway raises UniqueViolation instead of being skipped, and the whole transaction
    rolls back. Everyone else uses post(), which returns the existing transaction."""
    groups = [(wallet, list(postings))] if wallet is not None else []
    groups += [(w, list(ps)) for w, ps in by_wallet]
    cols: dict[str, list] = {k: [] for k in ("ids", "wallets", "tenants", "h_units", "keys", "types", "tasks", "reservations", "reversals",
                                             "reasons", "metadata", "txns", "e_wallets", "e_tenants", "lots", "buckets",
                                             "amounts", "units")}
    deltas: dict[UUID, dict[str, int]] = {}
    wallets: dict[UUID, dict] = {}
    out: list[UUID] = []
    for w, ps in groups:
        for p in ps:
            entries = [e for e in p.entries if e.amount_delta != 0]
            if not entries:
                continue
            if sum(e.amount_delta for e in entries) != 0:
                raise UnbalancedTransaction(f"{p.event_type} {p.business_key}: entries sum to {sum(e.amount_delta for e in entries)}")
            wid = w["wallet_id"]
            wallets[wid] = w
            d = deltas.setdefault(wid, {col: 0 for col in SNAPSHOT_COLUMNS.values()})
            for k, v in (("ids", p.ledger_txn_id), ("wallets", wid), ("tenants", w["tenant_id"]), ("h_units", w["unit_code"]),
                         ("keys", p.business_key),
                         ("types", p.event_type), ("tasks", p.task_id), ("reservations", p.reservation_id),
                         ("reversals", p.reversal_of), ("reasons", p.reason_code), ("metadata", json.dumps(p.metadata or {}))):
                cols[k].append(v)
            for e in entries:
                for k, v in (("txns", p.ledger_txn_id), ("e_wallets", wid), ("e_tenants", w["tenant_id"]), ("lots", e.lot_id),
                             ("buckets", e.bucket), ("amounts", e.amount_delta), ("units", w["unit_code"])):
                    cols[k].append(v)
                if e.bucket in SNAPSHOT_COLUMNS:
                    d[SNAPSHOT_COLUMNS[e.bucket]] += e.amount_delta
            out.append(p.ledger_txn_id)
    if not out:
        return []
    conn.execute(APPEND, {**cols, "d_wallets": list(deltas), "d_available": [d["available_amount"] for d in deltas.values()],
                          "d_reserved": [d["reserved_amount"] for d in deltas.values()],
                          "d_consumed": [d["consumed_amount"] for d in deltas.values()]})
    for wid, d in deltas.items():
        for col, v in d.items():
            wallets[wid][col] += v
    return out


def ledger_aggregate(conn: psycopg.Connection, wallet_id: UUID) -> dict[str, int]:
    """Sum of entries per bucket: what the snapshot must equal."""
    rows = conn.execute(
        "select bucket, coalesce(sum(amount_delta), 0)::bigint as total from ledger_entry where wallet_id = %s group by bucket",
        (wallet_id,),
    ).fetchall()
    return {r["bucket"]: int(r["total"]) for r in rows}
