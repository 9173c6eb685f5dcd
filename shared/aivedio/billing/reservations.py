"""Credit reservations: RESERVE at admission, RELEASE of what was not charged. Settlement, refunds
and the rest of the money lifecycle build on these in the billing capability."""
from __future__ import annotations

from datetime import datetime
from uuid import UUID

import psycopg

from aivedio.billing import lots
from aivedio.billing.ledger import Entry, Posted, post


class InsufficientCredit(Exception):
    pass


def can_reserve(wallet: dict, amount: int) -> bool:
    if wallet["account_type"] == "POSTPAID":
        return wallet["available_amount"] - amount >= -wallet["credit_limit_amount"]
    return wallet["available_amount"] >= amount


def reserve(
    conn: psycopg.Connection,
    *,
    wallet: dict,
    task_id: UUID,
    quoted_amount: int,
    amount: int,
    price_version_id: UUID,
    charge_policy_code: str,
    now: datetime,
) -> tuple[UUID, Posted | None]:
    """RESERVE: AVAILABLE -amount, RESERVED +amount, allocated across lots. Caller holds the wallet lock."""
    if not can_reserve(wallet, amount):
        raise InsufficientCredit(f"available {wallet['available_amount']} < {amount}")
    # POSTPAID wallets spend a credit limit, not lots; the others draw their lots down.
    parts = [] if wallet["account_type"] == "POSTPAID" else lots.take_from_lots(conn, wallet["wallet_id"], amount, now)
    res = conn.execute(
        """insert into credit_reservation (wallet_id, task_id, quoted_amount, reserved_amount, state,
                                           price_version_id, charge_policy_code)
           values (%s, %s, %s, %s, 'ACTIVE', %s, %s) returning reservation_id""",
        (wallet["wallet_id"], task_id, quoted_amount, amount, price_version_id, charge_policy_code),
    ).fetchone()
    reservation_id = res["reservation_id"]
    if parts:
        with conn.cursor() as cur:
            cur.executemany(
                "insert into reservation_allocation (reservation_id, lot_id, amount) values (%s, %s, %s)",
                [(reservation_id, lot_id, part) for lot_id, part in parts],
            )
    if amount == 0:  # a free task reserves nothing and posts nothing
        return reservation_id, None
    entries = _pairs(parts, amount, debit="AVAILABLE", credit="RESERVED")
    posted = post(conn, wallet=wallet, business_key=f"reserve:generation:{task_id}:v1", event_type="RESERVE",
                  entries=entries, task_id=task_id, reservation_id=reservation_id)
    return reservation_id, posted


def release_remaining(conn: psycopg.Connection, *, wallet: dict, task_id: UUID, reason_code: str) -> Posted | None:
    """RELEASE whatever of the task's reservation is neither settled nor released yet, back to the
    lots it came from. Idempotent on release:generation:{task_id}:{reason_code}."""
    r = conn.execute(
        "select * from credit_reservation where task_id = %s and wallet_id = %s for update", (task_id, wallet["wallet_id"])
    ).fetchone()
    if r is None:
        return None
    open_amount = r["reserved_amount"] - r["settled_amount"] - r["released_amount"]
    if open_amount <= 0:
        return None
    allocs = conn.execute(
        """select lot_id, amount - settled_amount - released_amount as open
             from reservation_allocation where reservation_id = %s and amount - settled_amount - released_amount > 0
            order by lot_id for update""",
        (r["reservation_id"],),
    ).fetchall()
    parts = [(a["lot_id"], a["open"]) for a in allocs]
    posted = post(conn, wallet=wallet, business_key=f"release:generation:{task_id}:{reason_code}", event_type="RELEASE",
                  entries=_pairs(parts, open_amount, debit="RESERVED", credit="AVAILABLE"),
                  task_id=task_id, reservation_id=r["reservation_id"], reason_code=reason_code)
    if not posted.created:
        return posted
    lots.return_to_lots(conn, parts)
    with conn.cursor() as cur:
        cur.executemany(
            "update reservation_allocation set released_amount = released_amount + %s where reservation_id = %s and lot_id = %s",
            [(part, r["reservation_id"], lot_id) for lot_id, part in parts],
        )
    new_state = "RELEASED" if r["settled_amount"] == 0 else "SETTLED"
    conn.execute(
        """update credit_reservation set released_amount = released_amount + %s, state = %s,
                  version = version + 1, updated_at = now() where reservation_id = %s""",
        (open_amount, new_state, r["reservation_id"]),
    )
    return posted


def _pairs(parts: list[tuple[UUID, int]], amount: int, *, debit: str, credit: str) -> list[Entry]:
    """Double entries per lot (so each lot's movement is traceable), or one pair without lots."""
    if not parts:
        return [Entry(debit, -amount), Entry(credit, amount)]
    out: list[Entry] = []
    for lot_id, part in parts:
        out += [Entry(debit, -part, lot_id), Entry(credit, part, lot_id)]
    return out
