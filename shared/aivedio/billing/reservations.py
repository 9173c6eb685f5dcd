"""Credit reservations (ch. 20.5.3, 20.6): RESERVE at admission, a top-up before work that may cost
more, SETTLE of what is charged and RELEASE of the rest, each across the credit lots the
reservation drew from. Settlement (aivedio.billing.settlement) decides the amounts; these move them.
A POSTPAID wallet reserves within its credit limit and its contract budget (contract_budgets)."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import psycopg

from aivedio.billing import contract_budgets, lots
from aivedio.billing.ledger import Entry, Posted, Posting, append, find_transaction, post


class InsufficientCredit(Exception):
    pass


def can_reserve(wallet: dict, amount: int) -> bool:
    """What the wallet snapshot alone allows: the balance, or a POSTPAID wallet's credit limit."""
    if wallet["account_type"] == "POSTPAID":
        return wallet["available_amount"] - amount >= -wallet["credit_limit_amount"]
    return wallet["available_amount"] >= amount


def ensure_reservable(conn: psycopg.Connection, wallet: dict, amount: int, now: datetime) -> None:
    """Raise InsufficientCredit unless the wallet may reserve `amount` more at `now`: can_reserve,
    and for POSTPAID the contract budget of the period too. The caller holds the wallet lock."""
    if not can_reserve(wallet, amount):
        raise InsufficientCredit(f"available {wallet['available_amount']} < {amount}")
    room = contract_budgets.headroom(conn, wallet, now)
    if room is not None and amount > room:
        raise InsufficientCredit(f"the contract budget of this billing period has {max(0, room)} left, {amount} needed")


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
    ensure_reservable(conn, wallet, amount, now)
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


# Both sides of lot movements in one statement: each allocation's part, and each lot's total (a lot
# that several reservations of the batch drew from appears once in `lots`, with the sums).
APPLY_TO_LOTS = """
with parts as (select * from unnest(%(a_reservations)s::uuid[], %(a_lots)s::uuid[], %(a_settled)s::bigint[],
                                    %(a_released)s::bigint[]) as u(reservation_id, lot_id, s, r)),
allocations as (
    update reservation_allocation a
       set settled_amount = a.settled_amount + parts.s, released_amount = a.released_amount + parts.r
      from parts where a.reservation_id = parts.reservation_id and a.lot_id = parts.lot_id)
update credit_lot l
   set reserved_amount = l.reserved_amount - totals.s - totals.r, remaining_amount = l.remaining_amount + totals.r
  from unnest(%(lots)s::uuid[], %(settled)s::bigint[], %(released)s::bigint[]) as totals(lot_id, s, r)
 where l.lot_id = totals.lot_id
"""

RECORD_SETTLEMENT_ALLOCATION = """
insert into settlement_allocation (ledger_txn_id, lot_id, tenant_id, amount)
select * from unnest(%(txns)s::uuid[], %(lots)s::uuid[], %(tenants)s::uuid[], %(amounts)s::bigint[])
"""

CLOSE_RESERVATIONS = """
update credit_reservation r
   set settled_amount = r.settled_amount + c.settled, released_amount = r.released_amount + c.released, state = c.state,
       version = r.version + 1, updated_at = now()
  from unnest(%(reservations)s::uuid[], %(settled)s::bigint[], %(released)s::bigint[], %(states)s::text[])
       as c(reservation_id, settled, released, state)
 where r.reservation_id = c.reservation_id
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


def _apply_to_lots(conn: psycopg.Connection, moves: list[tuple[UUID, list[tuple[UUID, int]], list[tuple[UUID, int]]]]) -> None:
    """Settled credit leaves its lot; released credit goes back to its lot's spendable part (the
    lot's expiry never changes). `moves` are (reservation_id, settled parts, released parts); one
    statement for all of them."""
    per_allocation: dict[tuple[UUID, UUID], list[int]] = {}
    per_lot: dict[UUID, list[int]] = {}
    for reservation_id, settled, released in moves:
        for col, parts in ((0, settled), (1, released)):
            for lot_id, part in parts:
                per_allocation.setdefault((reservation_id, lot_id), [0, 0])[col] += part
                per_lot.setdefault(lot_id, [0, 0])[col] += part
    if not per_lot:
        return
    conn.execute(APPLY_TO_LOTS, {
        "a_reservations": [k[0] for k in per_allocation], "a_lots": [k[1] for k in per_allocation],
        "a_settled": [v[0] for v in per_allocation.values()], "a_released": [v[1] for v in per_allocation.values()],
        "lots": list(per_lot), "settled": [v[0] for v in per_lot.values()], "released": [v[1] for v in per_lot.values()]})


def _close_reservations(conn: psycopg.Connection, rows: list[tuple[UUID, int, int, str]]) -> None:
    """(reservation_id, settled, released, new state) for each reservation, in one statement."""
    if rows:
        conn.execute(CLOSE_RESERVATIONS, {"reservations": [r[0] for r in rows], "settled": [r[1] for r in rows],
                                          "released": [r[2] for r in rows], "states": [r[3] for r in rows]})


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
    _apply_to_lots(conn, [(r["reservation_id"], [], parts)])
    _close_reservations(conn, [(r["reservation_id"], 0, open_amount, "RELEASED" if r["settled_amount"] == 0 else "SETTLED")])
    return posted


@dataclass
class Closing:
    """One reservation to close: SETTLE `amount` and RELEASE the rest. `reservation` and
    `allocations` as settlement loaded them (allocations open and in spending order)."""

    wallet: dict
    reservation: dict
    allocations: list[dict]
    amount: int
    settle_key: str
    release_key: str
    reason_code: str
    release_reason: str
    metadata: dict | None = None
    settle_txn_id: UUID | None = None  # set by close_many


def close_many(conn: psycopg.Connection, closings: list[Closing], now: datetime) -> None:
    """Settlement's money movement, for any number of reservations in a handful of statements: for
    each, SETTLE `amount` of the open reservation (RESERVED -> CONSUMED) from its lots in spending
    order, recorded per lot in settlement_allocation so a refund can find them, and RELEASE the rest
    (RESERVED -> AVAILABLE) back to its original lots. What a POSTPAID wallet settles accrues to its
    contract budget's period at `now`. Every statement is fire-and-forget (pipeline friendly); the
    ledger keys must be new (ledger.append). Sets each closing's settle_txn_id (None for no charge)
    and updates the reservation and wallet dicts in place. The caller holds the wallet locks and has
    checked that the reservations are still open."""
    by_wallet: dict[UUID, tuple[dict, list[Posting]]] = {}
    moves, closed, recorded = [], [], []
    receivable: dict[UUID, int] = {}
    for c in closings:
        r = c.reservation
        open_amount = r["reserved_amount"] - r["settled_amount"] - r["released_amount"]
        if not 0 <= c.amount <= open_amount:
            raise ValueError(f"settle {c.amount} of an open reservation of {open_amount}")
        settled, released = split(c.allocations, c.amount)
        release_amount = open_amount - c.amount
        postings = by_wallet.setdefault(c.wallet["wallet_id"], (c.wallet, []))[1]
        if c.amount:
            posting = Posting(c.settle_key, "SETTLE", tuple(_pairs(settled, c.amount, debit="RESERVED", credit="CONSUMED")),
                              task_id=r["task_id"], reservation_id=r["reservation_id"], reason_code=c.reason_code,
                              metadata=c.metadata)
            postings.append(posting)
            c.settle_txn_id = posting.ledger_txn_id
            recorded += [(posting.ledger_txn_id, lot, c.wallet["tenant_id"], part) for lot, part in settled]
            if c.wallet["account_type"] == "POSTPAID":
                receivable[c.wallet["wallet_id"]] = receivable.get(c.wallet["wallet_id"], 0) + c.amount
        if release_amount:
            postings.append(Posting(c.release_key, "RELEASE",
                                    tuple(_pairs(released, release_amount, debit="RESERVED", credit="AVAILABLE")),
                                    task_id=r["task_id"], reservation_id=r["reservation_id"], reason_code=c.release_reason))
        moves.append((r["reservation_id"], settled, released))
        r["settled_amount"] += c.amount
        r["released_amount"] += release_amount
        r["state"] = "SETTLED" if r["settled_amount"] else "RELEASED"
        closed.append((r["reservation_id"], c.amount, release_amount, r["state"]))
    append(conn, by_wallet=by_wallet.values())
    _apply_to_lots(conn, moves)
    if recorded:
        conn.execute(RECORD_SETTLEMENT_ALLOCATION, {"txns": [x[0] for x in recorded], "lots": [x[1] for x in recorded],
                                                    "tenants": [x[2] for x in recorded], "amounts": [x[3] for x in recorded]})
    _close_reservations(conn, closed)
    contract_budgets.accrue(conn, now=now, settled=receivable)


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
    ensure_reservable(conn, wallet, amount, now)
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
