"""Subscription grants (ch. 20.1.2, issue 6 "credit lots"): a subscription wallet receives
`grant_amount` credits at the start of each period, as a SUBSCRIPTION lot that expires at the end
of that period (the expiry sweeper books what is left unused).

A grant's business key is grant:subscription:{wallet_id}:{period start}, so a period is granted
once however often the job runs. A period that ended while the job was not running is skipped, not
granted late: its credit would have expired already."""
from __future__ import annotations

from datetime import datetime, timedelta
from uuid import UUID

import psycopg

from aivedio import audit
from aivedio.billing.ledger import lock_wallet
from aivedio.billing.lots import grant_credits
from aivedio.errors import InvalidRequest, NotFound
from aivedio.metrics_catalog import SUBSCRIPTION_CREDITS_GRANTED
from aivedio.observability import logger, publish

DUE = """
select wallet_id, tenant_id from wallet_subscription where active and next_grant_at <= %(now)s
 order by next_grant_at limit %(limit)s
"""


def set_subscription(conn: psycopg.Connection, *, operator: str, tenant_id: UUID, grant_amount: int, period_seconds: int,
                     first_grant_at: datetime, active: bool = True) -> dict:
    bad = {}
    if grant_amount <= 0:
        bad["grant_amount"] = "a positive integer of credit units"
    if period_seconds <= 0:
        bad["period_seconds"] = "a positive number of seconds"
    if bad:
        raise InvalidRequest("invalid subscription", bad)
    w = conn.execute("select * from wallet_account where tenant_id = %s and account_type <> 'POSTPAID' order by wallet_id limit 1",
                     (tenant_id,)).fetchone()
    if w is None:
        raise NotFound(f"tenant {tenant_id} has no prepaid or subscription wallet")
    lock_wallet(conn, tenant_id, w["wallet_id"])
    old = conn.execute("select * from wallet_subscription where wallet_id = %s", (w["wallet_id"],)).fetchone()
    row = conn.execute(
        """insert into wallet_subscription (wallet_id, tenant_id, grant_amount, period_seconds, next_grant_at, active)
           values (%s, %s, %s, %s, %s, %s)
           on conflict (wallet_id) do update set grant_amount = excluded.grant_amount, period_seconds = excluded.period_seconds,
                  next_grant_at = excluded.next_grant_at, active = excluded.active, updated_at = now()
           returning *""",
        (w["wallet_id"], tenant_id, grant_amount, period_seconds, first_grant_at, active)).fetchone()
    audit.append(conn, operator=operator, action="subscription.set", target=f"wallet:{w['wallet_id']}", tenant_id=tenant_id,
                 old=dict(old) if old else None, new=dict(row))
    return dict(row)


def grant_wallet(conn: psycopg.Connection, *, wallet_id: UUID, tenant_id: UUID, now: datetime) -> int:
    """Grant every period of one wallet that has started by `now`. Returns the credits granted."""
    wallet = lock_wallet(conn, tenant_id, wallet_id)
    sub = conn.execute("select * from wallet_subscription where wallet_id = %s and active for update", (wallet_id,)).fetchone()
    if wallet is None or sub is None:
        return 0
    granted = 0
    start = sub["next_grant_at"]
    period = timedelta(seconds=sub["period_seconds"])
    while start <= now:
        end = start + period
        if end > now:  # the current period: grant it; earlier ones ended unused
            grant_credits(conn, wallet, sub["grant_amount"], kind="SUBSCRIPTION",
                          business_key=f"grant:subscription:{wallet_id}:{start.isoformat()}", expires_at=end)
            granted += sub["grant_amount"]
        start = end
    conn.execute("update wallet_subscription set next_grant_at = %s, updated_at = now() where wallet_id = %s", (start, wallet_id))
    if granted:
        publish(SUBSCRIPTION_CREDITS_GRANTED, granted)
        logger.info("subscription period granted", extra={"tenant_id": str(tenant_id), "wallet_id": str(wallet_id),
                                                          "amount": granted, "next_grant_at": start.isoformat()})
    return granted


def grant_due(platform, now: datetime | None = None, batch: int = 500) -> dict:
    now = now or platform.clock.now()
    wallets = credits = 0
    seen: set[UUID] = set()
    while True:
        with platform.db.connection() as conn:
            due = [w for w in conn.execute(DUE, {"now": now, "limit": batch + len(seen)}).fetchall()
                   if w["wallet_id"] not in seen]
        if not due:
            break
        for w in due:
            seen.add(w["wallet_id"])
            credits += platform.db.transaction(
                lambda c, w=w: grant_wallet(c, wallet_id=w["wallet_id"], tenant_id=w["tenant_id"], now=now))
            wallets += 1
    return {"wallets": wallets, "credits_granted": credits}
