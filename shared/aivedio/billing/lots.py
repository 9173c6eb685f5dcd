"""Credit lots: paid, subscription, promotional or compensation credit, each with an expiry and a
priority. Reservations take from lots earliest-expiry first, then by priority; a release returns
to the very lot it came from, with that lot's original expiry (ch. 20.13.7)."""
from __future__ import annotations

from datetime import datetime
from uuid import UUID

import psycopg

from aivedio.billing.ledger import Entry, post

# Lower numbers are spent first when expiries tie: promotional credit before paid credit.
LOT_PRIORITY = {"PROMOTIONAL": 0, "COMPENSATION": 5, "SUBSCRIPTION": 10, "PAID": 20}
# The spending order, of credit_lot aliased `l`: reservations take lots in it, and a settlement
# consumes a reservation's lots in it (the credit expiring first goes first).
SPENDING_ORDER = "l.expires_at asc nulls last, l.priority asc, l.created_at asc, l.lot_id"


class LotsExhausted(Exception):
    """The lots hold less than the snapshot says is available: a wallet check must look."""


def create_lot(
    conn: psycopg.Connection,
    *,
    wallet: dict,
    kind: str,
    amount: int,
    source_business_key: str,
    expires_at: datetime | None = None,
) -> UUID:
    row = conn.execute(
        """insert into credit_lot (wallet_id, tenant_id, kind, original_amount, remaining_amount, priority,
                                   expires_at, source_business_key)
           values (%s, %s, %s, %s, %s, %s, %s, %s)
           on conflict (wallet_id, source_business_key) do nothing
           returning lot_id""",
        (wallet["wallet_id"], wallet["tenant_id"], kind, amount, amount, LOT_PRIORITY[kind], expires_at, source_business_key),
    ).fetchone()
    if row is None:
        row = conn.execute(
            "select lot_id from credit_lot where wallet_id = %s and source_business_key = %s",
            (wallet["wallet_id"], source_business_key),
        ).fetchone()
    return row["lot_id"]


def take_from_lots(conn: psycopg.Connection, wallet_id: UUID, amount: int, now: datetime) -> list[tuple[UUID, int]]:
    """Move `amount` from lots' remaining to their reserved part, earliest expiry first, then
    priority. Returns [(lot_id, amount)]. Locks the lots it reads."""
    lots = conn.execute(
        f"""select lot_id, remaining_amount from credit_lot l
            where wallet_id = %s and remaining_amount > 0 and (expires_at is null or expires_at > %s)
            order by {SPENDING_ORDER}
            for no key update""",  # as lock_wallet: foreign-key checks on the lot pass
        (wallet_id, now),
    ).fetchall()
    taken: list[tuple[UUID, int]] = []
    need = amount
    for lot in lots:
        if need == 0:
            break
        part = min(need, lot["remaining_amount"])
        taken.append((lot["lot_id"], part))
        need -= part
    if need:
        raise LotsExhausted(f"wallet {wallet_id}: lots hold {amount - need} of the {amount} available")
    with conn.cursor() as cur:
        cur.executemany(
            """update credit_lot set remaining_amount = remaining_amount - %s, reserved_amount = reserved_amount + %s
                where lot_id = %s""",
            [(part, part, lot_id) for lot_id, part in taken],
        )
    return taken


def refund_to_lots(conn: psycopg.Connection, parts: list[tuple[UUID, int]]) -> None:
    """Consumed credit that is refunded comes back to the lot it was consumed from, under that
    lot's original expiry (ch. 20.5.8, 20.13.7): a refund never turns expiring credit into
    lasting credit. Credit returned to a lot that has expired is booked EXPIRE by the next sweep."""
    with conn.cursor() as cur:
        cur.executemany(
            "update credit_lot set remaining_amount = remaining_amount + %s where lot_id = %s",
            [(part, lot_id) for lot_id, part in parts if part],
        )


def grant_credits(conn, wallet: dict, amount: int, *, kind: str, business_key: str, expires_at=None):
    """GRANT: credits enter the wallet as a lot (AVAILABLE +amount, ISSUED -amount)."""
    lot_id = create_lot(conn, wallet=wallet, kind=kind, amount=amount, source_business_key=business_key, expires_at=expires_at)
    return post(conn, wallet=wallet, business_key=business_key, event_type="GRANT",
                entries=[Entry("AVAILABLE", amount, lot_id), Entry("ISSUED", -amount, lot_id)],
                metadata={"kind": kind})
