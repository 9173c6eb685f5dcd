"""Credit reservations (ch. 20.5.3, 20.6): RESERVE at admission, a top-up before work that may cost
more, SETTLE of what is charged and RELEASE of the rest, each across the credit lots the
reservation drew from. Settlement (aivedio.billing.settlement) decides the amounts; these move them."""
from __future__ import annotations

from datetime import datetime
from uuid import UUID

import psycopg

from aivedio.billing import lots
from aivedio.billing.ledger import Entry, Posted, Posting, append, find_transaction, post


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


def lock_reservation(conn: psycopg.Connection, wallet: dict, task_id: UUID) -> dict | None:
    """The task's reservation, locked. The caller holds the wallet lock (lock order: wallet first)."""
    return conn.execute(
        "select * from credit_reservation where task_id = %s and wallet_id = %s for update", (task_id, wallet["wallet_id"])
    ).fetchone()


def open_allocations(conn: psycopg.Connection, reservation_id: UUID) -> list[dict]:
    """The lots a reservation still holds credit of, locked, in spending order: earliest expiry
    first, then priority (the order reserve() took them in)."""
    return conn.execute(
        f"""select a.lot_id, a.amount - a.settled_amount - a.released_amount as open, l.expires_at, l.priority
             from reservation_allocation a join credit_lot l using (lot_id)
            where a.reservation_id = %s and a.amount - a.settled_amount - a.released_amount > 0
            order by {lots.SPENDING_ORDER}
            for update of a""",
        (reservation_id,),
    ).fetchall()


# Both sides of a lot movement in one statement: the lot's parts and the reservation's allocation.
APPLY_TO_LOTS = """
with parts as (select * from unnest(%(lots)s::uuid[], %(settled)s::bigint[], %(released)s::bigint[]) as u(lot_id, s, r)),
allocations as (
    update reservation_allocation a
       set settled_amount = a.settled_amount + parts.s, released_amount = a.released_amount + parts.r
      from parts where a.reservation_id = %(reservation_id)s and a.lot_id = parts.lot_id)
update credit_lot l
   set reserved_amount = l.reserved_amount - parts.s - parts.r, remaining_amount = l.remaining_amount + parts.r
  from parts where l.lot_id = parts.lot_id
"""

RECORD_SETTLEMENT_ALLOCATION = """
insert into settlement_allocation (ledger_txn_id, lot_id, tenant_id, amount)
select %(txn)s, l, %(tenant_id)s, a from unnest(%(lots)s::uuid[], %(amounts)s::bigint[]) as u(l, a)
"""

CLOSE_RESERVATION = """
update credit_reservation
   set settled_amount = settled_amount + %(settled)s, released_amount = released_amount + %(released)s, state = %(state)s,
       version = version + 1, updated_at = now()
 where reservation_id = %(reservation_id)s
"""


def split(allocations: list[dict], amount: int) -> tuple[list[tuple[UUID, int]], list[tuple[UUID, int]]]:
    """Which lots a settlement of `amount` consumes and which it releases: the allocations are in
    spending order (open_allocations), so the credit expiring first is consumed first, and every
    lot gets back exactly its own unconsumed part (ch. 20.13.7)."""
    settle, release = [], []
    need = amount
    for a in allocations:
        part = min(need, a["open"])
        need -= part
        if part:
            settle.append((a["lot_id"], part))
        if a["open"] - part:
            release.append((a["lot_id"], a["open"] - part))
    if need and allocations:
        raise lots.LotsExhausted(f"allocations hold {amount - need} of the {amount} to settle")
    return settle, release


def _apply_to_lots(conn: psycopg.Connection, reservation_id: UUID, settled: list[tuple[UUID, int]],
                   released: list[tuple[UUID, int]]) -> None:
    """Settled credit leaves its lot; released credit goes back to its lot's spendable part (the
    lot's expiry never changes). One statement each for the lots and the allocations."""
    per: dict[UUID, list[int]] = {}
    for lot_id, part in settled:
        per.setdefault(lot_id, [0, 0])[0] += part
    for lot_id, part in released:
        per.setdefault(lot_id, [0, 0])[1] += part
    if not per:
        return
    args = {"lots": list(per), "settled": [v[0] for v in per.values()], "released": [v[1] for v in per.values()],
            "reservation_id": reservation_id}
    conn.execute(APPLY_TO_LOTS, args)


def release_remaining(conn: psycopg.Connection, *, wallet: dict, task_id: UUID, reason_code: str) -> Posted | None:
    """RELEASE whatever of the task's reservation is neither settled nor released yet, back to the
    lots it came from, with their original expiry (ch. 20.13.7). Idempotent on
    release:generation:{task_id}:{reason_code}. The caller holds the wallet lock."""
    r = lock_reservation(conn, wallet, task_id)
    if r is None:
        return None
    open_amount = r["reserved_amount"] - r["settled_amount"] - r["released_amount"]
    if open_amount <= 0:
        return None
    _, parts = split(open_allocations(conn, r["reservation_id"]), 0)
    posted = post(conn, wallet=wallet, business_key=f"release:generation:{task_id}:{reason_code}", event_type="RELEASE",
                  entries=_pairs(parts, open_amount, debit="RESERVED", credit="AVAILABLE"),
                  task_id=task_id, reservation_id=r["reservation_id"], reason_code=reason_code)
    if not posted.created:
        return posted
    _apply_to_lots(conn, r["reservation_id"], [], parts)
    conn.execute(CLOSE_RESERVATION, {"settled": 0, "released": open_amount, "reservation_id": r["reservation_id"],
                                     "state": "RELEASED" if r["settled_amount"] == 0 else "SETTLED"})
    return posted


def close(conn: psycopg.Connection, *, wallet: dict, reservation: dict, allocations: list[dict], amount: int, settle_key: str,
          release_key: str, reason_code: str, release_reason: str, metadata: dict | None = None) -> UUID | None:
    """Settlement's money movement, in one go: SETTLE `amount` of the open reservation
    (RESERVED -> CONSUMED) from its lots in spending order, recorded per lot in
    settlement_allocation so a refund can find them, and RELEASE the rest (RESERVED -> AVAILABLE)
    back to its original lots. Every statement is fire-and-forget (pipeline friendly); the ledger
    keys must be new (ledger.append). Returns the SETTLE transaction's id, or None for no charge.
    The caller holds the wallet lock and has checked that the reservation is still open."""
    r = reservation
    open_amount = r["reserved_amount"] - r["settled_amount"] - r["released_amount"]
    if not 0 <= amount <= open_amount:
        raise ValueError(f"settle {amount} of an open reservation of {open_amount}")
    settled, released = split(allocations, amount)
    release_amount = open_amount - amount
    postings = []
    if amount:
        postings.append(Posting(settle_key, "SETTLE", tuple(_pairs(settled, amount, debit="RESERVED", credit="CONSUMED")),
                                task_id=r["task_id"], reservation_id=r["reservation_id"], reason_code=reason_code,
                                metadata=metadata))
    if release_amount:
        postings.append(Posting(release_key, "RELEASE", tuple(_pairs(released, release_amount, debit="RESERVED", credit="AVAILABLE")),
                                task_id=r["task_id"], reservation_id=r["reservation_id"], reason_code=release_reason))
    append(conn, wallet=wallet, postings=postings)
    _apply_to_lots(conn, r["reservation_id"], settled, released)
    settle_txn = postings[0].ledger_txn_id if amount else None
    if settle_txn is not None and settled:
        conn.execute(RECORD_SETTLEMENT_ALLOCATION, {"txn": settle_txn, "tenant_id": wallet["tenant_id"],
                                                    "lots": [lot for lot, _ in settled], "amounts": [a for _, a in settled]})
    r["settled_amount"] += amount
    r["released_amount"] += release_amount
    r["state"] = "SETTLED" if r["settled_amount"] else "RELEASED"
    conn.execute(CLOSE_RESERVATION, {"settled": amount, "released": release_amount, "state": r["state"],
                                     "reservation_id": r["reservation_id"]})
    return settle_txn


def top_up(conn: psycopg.Connection, *, wallet: dict, reservation: dict, amount: int, business_key: str,
           now: datetime) -> Posted | None:
    """Reserve `amount` more for a task that is already reserved (ch. 20.6.5): before an extension
    or upscale that may cost more than the quote, or for a POSTPAID excess at settlement. Raises
    InsufficientCredit when the wallet cannot (the extension is then refused: a hard cap). The
    caller holds the wallet lock and the reservation row. Idempotent on the business key."""
    if amount <= 0:
        return None
    existing = find_transaction(conn, wallet["wallet_id"], business_key)
    if existing is not None:
        return Posted(existing["ledger_txn_id"], False)
    if not can_reserve(wallet, amount):
        raise InsufficientCredit(f"available {wallet['available_amount']} < {amount}")
    parts = [] if wallet["account_type"] == "POSTPAID" else lots.take_from_lots(conn, wallet["wallet_id"], amount, now)
    posted = post(conn, wallet=wallet, business_key=business_key, event_type="RESERVE",
                  entries=_pairs(parts, amount, debit="AVAILABLE", credit="RESERVED"),
                  task_id=reservation["task_id"], reservation_id=reservation["reservation_id"], reason_code="TOP_UP")
    if parts:
        with conn.cursor() as cur:
            cur.executemany(
                """insert into reservation_allocation (reservation_id, lot_id, amount) values (%s, %s, %s)
                   on conflict (reservation_id, lot_id) do update set amount = reservation_allocation.amount + excluded.amount""",
                [(reservation["reservation_id"], lot_id, part) for lot_id, part in parts],
            )
    conn.execute(
        """update credit_reservation set reserved_amount = reserved_amount + %s, version = version + 1, updated_at = now()
            where reservation_id = %s""",
        (amount, reservation["reservation_id"]),
    )
    conn.execute("update generation_charge set max_reserve_amount = max_reserve_amount + %s where task_id = %s",
                 (amount, reservation["task_id"]))
    reservation["reserved_amount"] += amount
    return posted


def _pairs(parts: list[tuple[UUID, int]], amount: int, *, debit: str, credit: str) -> list[Entry]:
    """Double entries per lot (so each lot's movement is traceable), or one pair without lots."""
    if not parts:
        return [Entry(debit, -amount), Entry(credit, amount)]
    out: list[Entry] = []
    for lot_id, part in parts:
        out += [Entry(debit, -part, lot_id), Entry(credit, part, lot_id)]
    return out
