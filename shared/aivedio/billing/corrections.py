"""Corrections as appended reversals (ch. 20.5.2, 20.13.3): the ledger is append-only (the database
refuses UPDATE, DELETE and TRUNCATE), so a wrong transaction is undone by a new ADJUST transaction
whose entries are its entries negated and whose reversal_of names it. Its business key is
reverse:{ledger_txn_id}, so a transaction is reversed at most once.

Only transactions that move credit in or out of the wallet on their own are reversed here: GRANT,
COMPENSATE, EXPIRE and ADJUST. A SETTLE is reversed by a REFUND (aivedio.billing.refunds), and
RESERVE/RELEASE belong to their reservation's lifecycle. The lots move with the entries: a reversed
GRANT takes its credit back out of its lot, which must still hold it (credit already spent cannot
be ungranted; refuse and correct otherwise)."""
from __future__ import annotations

from datetime import datetime
from uuid import UUID

import psycopg

from aivedio import audit
from aivedio.billing.errors import CorrectionRefused
from aivedio.billing.ledger import Entry, find_transaction, lock_wallet, post
from aivedio.errors import NotFound

REVERSIBLE = ("GRANT", "COMPENSATE", "EXPIRE", "ADJUST")


def reverse(conn: psycopg.Connection, *, operator: str, ledger_txn_id: UUID, reason: str, now: datetime) -> dict:
    txn = conn.execute("select * from ledger_transaction where ledger_txn_id = %s", (ledger_txn_id,)).fetchone()
    if txn is None:
        raise NotFound(f"no ledger transaction {ledger_txn_id}")
    if txn["event_type"] not in REVERSIBLE:
        raise CorrectionRefused(f"a {txn['event_type']} is not reversed by hand: "
                                + ("refund it" if txn["event_type"] == "SETTLE" else "it belongs to its reservation"))
    if not reason or not reason.strip():
        raise CorrectionRefused("a correction needs a reason")
    wallet = lock_wallet(conn, txn["tenant_id"], txn["wallet_id"])
    key = f"reverse:{ledger_txn_id}"
    prior = find_transaction(conn, wallet["wallet_id"], key)
    if prior is not None:
        return {"ledger_txn_id": str(prior["ledger_txn_id"]), "reversal_of": str(ledger_txn_id), "replayed": True}
    if conn.execute("select 1 from ledger_transaction where reversal_of = %s and event_type = 'ADJUST'", (ledger_txn_id,)).fetchone():
        raise CorrectionRefused(f"{ledger_txn_id} was already reversed")
    entries = [Entry(e["bucket"], -e["amount_delta"], e["lot_id"])
               for e in conn.execute("select bucket, amount_delta, lot_id from ledger_entry where ledger_txn_id = %s order by entry_id",
                                     (ledger_txn_id,)).fetchall()]
    moves: dict[UUID, dict[str, int]] = {}
    for e in entries:
        if e.lot_id is not None and e.bucket in ("AVAILABLE", "RESERVED", "EXPIRED"):
            m = moves.setdefault(e.lot_id, {"AVAILABLE": 0, "RESERVED": 0, "EXPIRED": 0})
            m[e.bucket] += e.amount_delta
    for lot_id, m in moves.items():
        # NO KEY: a committing slot admission (billing.allowances) holds the lot in key-share mode
        lot = conn.execute("select * from credit_lot where lot_id = %s for no key update", (lot_id,)).fetchone()
        if lot["remaining_amount"] + m["AVAILABLE"] < 0 or lot["reserved_amount"] + m["RESERVED"] < 0 \
                or lot["expired_amount"] + m["EXPIRED"] < 0:
            raise CorrectionRefused(f"lot {lot_id} no longer holds the credit to reverse (spent or reserved since)")
    if wallet["account_type"] != "POSTPAID":
        delta_available = sum(e.amount_delta for e in entries if e.bucket == "AVAILABLE")
        if wallet["available_amount"] + delta_available < 0:
            raise CorrectionRefused("the wallet no longer holds the credit to reverse")
    posted = post(conn, wallet=wallet, business_key=key, event_type="ADJUST", entries=entries, task_id=txn["task_id"],
                  reversal_of=ledger_txn_id, reason_code="REVERSAL",
                  metadata={"operator": operator, "reason": reason, "reversed_event_type": txn["event_type"]})
    with conn.cursor() as cur:
        cur.executemany(
            """update credit_lot set remaining_amount = remaining_amount + %s, reserved_amount = reserved_amount + %s,
                      expired_amount = expired_amount + %s where lot_id = %s""",
            [(m["AVAILABLE"], m["RESERVED"], m["EXPIRED"], lot_id) for lot_id, m in moves.items()])
    audit.append(conn, operator=operator, action="ledger.reverse", target=f"ledger_txn:{ledger_txn_id}", tenant_id=txn["tenant_id"],
                 new={"reversal_ledger_txn_id": str(posted.ledger_txn_id), "event_type": txn["event_type"]}, reason=reason)
    return {"ledger_txn_id": str(posted.ledger_txn_id), "reversal_of": str(ledger_txn_id), "replayed": False}
