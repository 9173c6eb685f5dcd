"""The credit expiry sweeper (ch. 20.5.8, 20.13.7): books EXPIRE for what expired unused.

A lot is spendable while expires_at > now (lots.take_from_lots) and expired from expires_at on: at
exactly expires_at it can no longer be reserved, and the sweep that runs at or after that instant
moves its remaining credit to the EXPIRED bucket (AVAILABLE -x, EXPIRED +x, both on the lot). Credit
of the lot that is reserved at that moment is not expired: it is settled or released later, and a
release returns it to the lot with the lot's original expiry, so the next sweep expires it then.
Reserving and releasing never extend a lot's life.

Each expiry is its own ledger transaction with the business key expire:lot:{lot_id}:{expired so
far}, so a sweep that runs twice, or two sweeps at once, expire each credit once. Each wallet is
swept in its own transaction under its wallet lock (the lock order of every balance change)."""
from __future__ import annotations

from datetime import datetime
from uuid import UUID

import psycopg

from aivedio.billing.ledger import Entry, lock_wallet, post
from aivedio.metrics_catalog import CREDIT_EXPIRY_FAILURES, CREDITS_EXPIRED
from aivedio.observability import logger, publish

DUE_WALLETS = """
select distinct wallet_id, tenant_id from credit_lot
 where expires_at <= %(now)s and remaining_amount > 0 and expires_at is not null
 limit %(limit)s
"""

DUE_LOTS = """
select lot_id, remaining_amount, expired_amount, expires_at from credit_lot
 where wallet_id = %(wallet_id)s and expires_at <= %(now)s and remaining_amount > 0 and expires_at is not null
 order by expires_at, lot_id
 for update
"""

MARK_EXPIRED = """
update credit_lot set remaining_amount = remaining_amount - %(amount)s, expired_amount = expired_amount + %(amount)s
 where lot_id = %(lot_id)s
"""


def expire_wallet(conn: psycopg.Connection, *, wallet_id: UUID, tenant_id: UUID, now: datetime) -> int:
    """Expire every lot of one wallet that expired by `now`. Returns the credits expired."""
    wallet = lock_wallet(conn, tenant_id, wallet_id)
    if wallet is None:
        return 0
    total = 0
    for lot in conn.execute(DUE_LOTS, {"wallet_id": wallet_id, "now": now}).fetchall():
        amount = lot["remaining_amount"]
        posted = post(conn, wallet=wallet, business_key=f"expire:lot:{lot['lot_id']}:{lot['expired_amount']}",
                      event_type="EXPIRE", entries=[Entry("AVAILABLE", -amount, lot["lot_id"]),
                                                    Entry("EXPIRED", amount, lot["lot_id"])],
                      reason_code="LOT_EXPIRED", metadata={"expires_at": lot["expires_at"].isoformat()})
        if posted.created:
            conn.execute(MARK_EXPIRED, {"amount": amount, "lot_id": lot["lot_id"]})
            total += amount
    if total:
        publish(CREDITS_EXPIRED, total)
        logger.info("credits expired", extra={"tenant_id": str(tenant_id), "wallet_id": str(wallet_id), "amount": total})
    return total


def sweep(platform, now: datetime | None = None, batch: int | None = None) -> dict:
    """Expire what is due, wallet by wallet, each in its own transaction. A wallet that fails (a
    check violation means its snapshot drifted: the wallet check will freeze it) is logged and
    skipped, so one bad wallet does not stop the others."""
    now = now or platform.clock.now()
    batch = batch or platform.config.billing.expiry_batch
    expired = wallets = failed = 0
    seen: set[UUID] = set()
    while True:
        with platform.db.connection() as conn:
            due = [w for w in conn.execute(DUE_WALLETS, {"now": now, "limit": batch + len(seen)}).fetchall()
                   if w["wallet_id"] not in seen]
        if not due:
            break
        for w in due:
            seen.add(w["wallet_id"])
            try:
                expired += platform.db.transaction(
                    lambda c, w=w: expire_wallet(c, wallet_id=w["wallet_id"], tenant_id=w["tenant_id"], now=now))
                wallets += 1
            except psycopg.errors.CheckViolation as e:
                failed += 1
                logger.error("credit expiry failed for a wallet", extra={"wallet_id": str(w["wallet_id"]), "error": str(e)})
                publish(CREDIT_EXPIRY_FAILURES)
    return {"wallets": wallets, "credits_expired": expired, "failed_wallets": failed}
