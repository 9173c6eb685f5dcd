"""Wallet consistency checks (ch. 20.8.4, 20.8.5) and the rebuild that repairs what they find.

The check, under the wallet's lock (so no balance change interleaves), looks for what breaks the
wallet's invariants (aivedio.invariants.wallet_findings): the snapshot against the ledger aggregate
per bucket, reserved against the open part of the wallet's reservations, the lots against available
and reserved, and ledger transactions that do not sum to zero. On any mismatch it freezes the wallet's risky operations (admission rejects with
REJECT_WALLET_FROZEN; refunds and compensations refuse), records each finding in
wallet_discrepancy, logs an error and counts a metric: that is the alert.

The rebuild never edits history. It appends one ADJUST transaction that brings the ledger's
RESERVED in line with the reservations (the facts of what is held), moving each lot's reserved part
to match its allocations, then recomputes the snapshot from the ledger (the snapshot is derived
data, ch. 20.5.1), checks again, and unfreezes only when the check passes. Each step is audited."""
from __future__ import annotations

from datetime import datetime
from uuid import UUID

import psycopg

from aivedio import audit
from aivedio.billing import allowances
from aivedio.billing.ledger import Entry, ledger_aggregate, post
from aivedio.errors import Conflict, NotFound
from aivedio.invariants import OPEN_RESERVED, wallet_findings
from aivedio.metrics_catalog import RECONCILIATION_BREAKS
from aivedio.observability import logger, publish

FREEZE_PREFIX = "wallet check: "

LOT_DRIFT = """
select l.lot_id, l.reserved_amount as lot_reserved, l.remaining_amount,
       (coalesce((select sum(a.amount - a.settled_amount - a.released_amount) from reservation_allocation a
                   where a.lot_id = l.lot_id), 0)
        + coalesce((select sum(w.amount) from wallet_allowance w where w.lot_id = l.lot_id), 0))::bigint as held
  from credit_lot l where l.wallet_id = %s
 order by l.lot_id
 for update of l
"""


def _lock(conn: psycopg.Connection, wallet_id: UUID) -> dict:
    # A partitioned wallet's allowances first (the lock order of refills and returns), so no slot's
    # admission moves credit between the reads below.
    allowances.lock_allowances(conn, wallet_id)
    w = conn.execute("select * from wallet_account where wallet_id = %s for no key update", (wallet_id,)).fetchone()
    if w is None:
        raise NotFound(f"no wallet {wallet_id}")
    return w


def check_wallet(conn: psycopg.Connection, *, wallet_id: UUID, now: datetime, freeze: bool = True) -> dict:
    wallet = _lock(conn, wallet_id)
    found = wallet_findings(conn, wallet)
    if found and freeze:
        kinds = ", ".join(f["kind"] for f in found)
        if not wallet["frozen"]:
            conn.execute("update wallet_account set frozen = true, freeze_reason = %s, updated_at = %s where wallet_id = %s",
                         (FREEZE_PREFIX + kinds, now, wallet_id))
        with conn.cursor() as cur:
            cur.executemany(
                """insert into wallet_discrepancy (wallet_id, tenant_id, kind, expected, actual, found_at)
                   values (%s, %s, %s, %s, %s, %s) on conflict (wallet_id, kind) where status = 'OPEN' do nothing""",
                [(wallet_id, wallet["tenant_id"], f["kind"], f["expected"], f["actual"], now) for f in found])
        publish(RECONCILIATION_BREAKS, len(found))
        logger.error("ALERT wallet check mismatch: risky operations frozen",
                     extra={"tenant_id": str(wallet["tenant_id"]), "wallet_id": str(wallet_id), "findings": found})
    return {"wallet_id": str(wallet_id), "tenant_id": str(wallet["tenant_id"]), "ok": not found, "findings": found,
            "frozen": bool(wallet["frozen"] or (found and freeze))}


def check_all(platform, now: datetime | None = None, freeze: bool = True) -> dict:
    """Check every wallet, each in its own short transaction."""
    now = now or platform.clock.now()
    with platform.db.connection() as conn:
        ids = [r["wallet_id"] for r in conn.execute("select wallet_id from wallet_account order by wallet_id").fetchall()]
    bad = []
    for wid in ids:
        r = platform.db.transaction(lambda c, wid=wid: check_wallet(c, wallet_id=wid, now=now, freeze=freeze))
        if not r["ok"]:
            bad.append(r)
    return {"wallets": len(ids), "mismatched": len(bad), "findings": bad}


def rebuild(conn: psycopg.Connection, *, operator: str, wallet_id: UUID, now: datetime, reason: str) -> dict:
    """Append the adjustments that make the wallet consistent again, then unfreeze it if the check
    passes. Run it inside one transaction."""
    wallet = _lock(conn, wallet_id)
    before = wallet_findings(conn, wallet)
    entries: list[Entry] = []
    lot_moves: list[tuple[int, UUID]] = []
    if wallet["account_type"] != "POSTPAID":
        for lot in conn.execute(LOT_DRIFT, (wallet_id,)).fetchall():
            d = lot["lot_reserved"] - lot["held"]  # > 0: the lot holds back credit no reservation holds
            if d and (d > 0 or lot["remaining_amount"] >= -d):
                entries += [Entry("RESERVED", -d, lot["lot_id"]), Entry("AVAILABLE", d, lot["lot_id"])]
                lot_moves.append((d, lot["lot_id"]))
    agg = ledger_aggregate(conn, wallet_id)
    open_reserved = conn.execute(OPEN_RESERVED, {"w": wallet_id}).fetchone()["n"]
    residual = agg.get("RESERVED", 0) - sum(-e.amount_delta for e in entries if e.bucket == "RESERVED") - open_reserved
    if residual:
        entries += [Entry("RESERVED", -residual), Entry("AVAILABLE", residual)]
    adjust_txn = None
    if entries:
        n = conn.execute("select count(*) as n from ledger_transaction where wallet_id = %s and event_type = 'ADJUST'",
                         (wallet_id,)).fetchone()["n"]
        posted = post(conn, wallet=wallet, business_key=f"adjust:wallet:{wallet_id}:{n + 1}", event_type="ADJUST",
                      entries=entries, reason_code="WALLET_REBUILD",
                      metadata={"operator": operator, "reason": reason, "findings": before})
        adjust_txn = posted.ledger_txn_id
        with conn.cursor() as cur:
            cur.executemany("update credit_lot set reserved_amount = reserved_amount - %s, remaining_amount = remaining_amount + %s "
                            "where lot_id = %s", [(d, d, lot_id) for d, lot_id in lot_moves])
    # The snapshot is derived data: recompute it from the ledger.
    agg = ledger_aggregate(conn, wallet_id)
    old = {k: wallet[k] for k in ("available_amount", "reserved_amount", "consumed_amount")}
    new = {"available_amount": agg.get("AVAILABLE", 0), "reserved_amount": agg.get("RESERVED", 0),
           "consumed_amount": agg.get("CONSUMED", 0)}
    if old != new:
        conn.execute("""update wallet_account set available_amount = %(available_amount)s, reserved_amount = %(reserved_amount)s,
                               consumed_amount = %(consumed_amount)s, version = version + 1, updated_at = %(now)s
                         where wallet_id = %(wallet_id)s""", {**new, "now": now, "wallet_id": wallet_id})
        wallet.update(new)
    after = wallet_findings(conn, wallet)
    unfrozen = False
    if not after:
        conn.execute("""update wallet_discrepancy set status = 'RESOLVED', resolution_ledger_txn_id = %s, resolved_by = %s,
                               resolved_at = %s where wallet_id = %s and status = 'OPEN'""",
                     (adjust_txn, operator, now, wallet_id))
        if wallet["frozen"] and (wallet["freeze_reason"] or "").startswith(FREEZE_PREFIX):
            conn.execute("update wallet_account set frozen = false, freeze_reason = null, updated_at = %s where wallet_id = %s",
                         (now, wallet_id))
            unfrozen = True
    audit.append(conn, operator=operator, action="wallet.rebuild", target=f"wallet:{wallet_id}", tenant_id=wallet["tenant_id"],
                 old={"snapshot": old, "findings": before},
                 new={"snapshot": new, "adjust_ledger_txn_id": str(adjust_txn) if adjust_txn else None, "remaining_findings": after,
                      "unfrozen": unfrozen}, reason=reason)
    logger.warning("wallet rebuilt", extra={"tenant_id": str(wallet["tenant_id"]), "wallet_id": str(wallet_id),
                                           "adjusted": bool(adjust_txn), "remaining_findings": after})
    return {"wallet_id": str(wallet_id), "before": before, "after": after, "adjust_ledger_txn_id": str(adjust_txn) if adjust_txn else None,
            "snapshot_before": old, "snapshot_after": new, "unfrozen": unfrozen, "ok": not after}


def unfreeze(conn: psycopg.Connection, *, operator: str, wallet_id: UUID, now: datetime, reason: str) -> dict:
    """Lift a freeze by hand: only when the wallet checks clean."""
    wallet = _lock(conn, wallet_id)
    found = wallet_findings(conn, wallet)
    if found:
        raise Conflict("the wallet still has mismatches: rebuild it first", code="WALLET_INCONSISTENT",
                       details={"findings": found})
    conn.execute("update wallet_account set frozen = false, freeze_reason = null, updated_at = %s where wallet_id = %s",
                 (now, wallet_id))
    audit.append(conn, operator=operator, action="wallet.unfreeze", target=f"wallet:{wallet_id}", tenant_id=wallet["tenant_id"],
                 old={"freeze_reason": wallet["freeze_reason"]}, reason=reason)
    return {"wallet_id": str(wallet_id), "frozen": False}
