"""Immutable, versioned prices (ch. 20.6.1). A price version's rules are data; a quote names the
version it came from, and a task settles at that version forever, whatever today's price is."""
from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_CEILING, Decimal
from uuid import UUID

import psycopg

from aivedio import degraded
from aivedio.caching import cached
from aivedio.config import PlatformConfig
from aivedio.errors import DomainError, InvalidRequest
from aivedio.observability import logger
from aivedio.pricing.estimates import Estimate

PRODUCT_CODE = "video-generation"
UNIT = "CREDIT"


@dataclass(frozen=True)
class Quote:
    price_version_id: UUID
    quoted_amount: int
    max_reserve_amount: int
    unit: str
    charge_policy_code: str

    def as_dict(self) -> dict:
        return {"price_version_id": str(self.price_version_id), "quoted_amount": self.quoted_amount,
                "max_reserve_amount": self.max_reserve_amount, "unit": self.unit,
                "charge_policy_code": self.charge_policy_code}


def default_rules(config: PlatformConfig) -> dict:
    return {"rules_version": 1, "models": {m: config.price_for(m).model_dump() for m in config.models}}


def _rules_hash(rules: dict) -> str:
    return hashlib.sha256(json.dumps(rules, sort_keys=True).encode()).hexdigest()


def ensure_price_book(conn: psycopg.Connection, config: PlatformConfig, now: datetime) -> UUID:
    """Make the configured prices the active version: reuse it when the rules are unchanged,
    otherwise close the current version and open a new one. Old versions are never edited.
    A version an operator created (aivedio.admin.prices) is kept whatever the config says: once
    an operator prices the product, the config's [prices] only seed an empty book. A new version
    ends where an operator's later version begins, so versions never overlap."""
    rules = default_rules(config)
    with conn.transaction():
        conn.execute(LOCK_PRODUCT, (PRODUCT_CODE,))
        current = active_version(conn, now)
        if current and (current.get("created_by") is not None or _rules_hash(current["rules"]) == _rules_hash(rules)):
            return current["price_version_id"]
        if current:
            conn.execute("update price_book set effective_to = %s where price_version_id = %s",
                         (now, current["price_version_id"]))
        nxt = conn.execute(NEXT_VERSION_FROM, (PRODUCT_CODE, now)).fetchone()["next_from"]
        row = conn.execute(
            """insert into price_book (product_code, effective_from, effective_to, currency_or_unit, rules, status)
               values (%s, %s, %s, %s, %s, 'ACTIVE') returning price_version_id""",
            (PRODUCT_CODE, now, nxt, UNIT, json.dumps(rules)),
        ).fetchone()
        return row["price_version_id"]


LOCK_PRODUCT = "select pg_advisory_xact_lock(hashtext('price_book:' || %s))"
NEXT_VERSION_FROM = """select min(effective_from) as next_from from price_book
                        where product_code = %s and status = 'ACTIVE' and effective_from > %s"""


def active_version(conn: psycopg.Connection, now: datetime) -> dict | None:
    return conn.execute(
        """select * from price_book
            where product_code = %s and status = 'ACTIVE' and effective_from <= %s
              and (effective_to is null or effective_to > %s)
            order by effective_from desc limit 1""",
        (PRODUCT_CODE, now, now),
    ).fetchone()


# --- pricing unavailable (ch. 20.12.4) --------------------------------------------------------------
# There is no pricing service apart from PostgreSQL: "pricing unavailable" is the read of the active
# price version failing (the table unreadable, a statement cancelled, the connection lost while the
# rest of admission could still run). Admission then may price from the last version this process
# read, a PriceSnapshot, under every condition of ch. 20.12.4:
# - the snapshot is intact: the SHA-256 of its rules (canonical JSON), taken when they were read from
#   PostgreSQL, still matches them. That is all "signed" means here: an integrity check of what this
#   process holds, with no key; PostgreSQL (its immutability trigger) is what vouches for the rules;
# - the version was still in force when read, and its effective_to (if any) has not passed;
# - the snapshot is at most BillingConfig.price_snapshot_max_age_seconds old (platform seconds);
# - the task's quote is at most price_snapshot_max_task_amount credits.
# Otherwise pricing raises PricesUnavailable, which admission answers REJECT_PRICING_UNAVAILABLE:
# never a default or zero price, never a client's. A task priced from a snapshot names that version, as any other.

class PricesUnavailable(DomainError):
    """No price version can be read and no snapshot may stand in (or the task is above the
    snapshot's cap): new work must wait, never be priced at a default."""

    code = "PRICES_UNAVAILABLE"
    retry_after_seconds = 30


@dataclass(frozen=True)
class PriceSnapshot:
    version: dict  # the price_book row as read
    sha256: str  # of its rules, when read
    read_at: datetime  # platform clock

    def intact(self) -> bool:
        return _rules_hash(self.version["rules"]) == self.sha256


@dataclass(frozen=True)
class Priced:
    version: dict
    snapshot: PriceSnapshot | None  # set when the price book could not be read and the snapshot stood in


def _read_active(platform) -> dict:
    now = platform.clock.now()
    with platform.db.connection() as conn:
        version = active_version(conn, now)
        if version is None:
            ensure_price_book(conn, platform.config, now)
            version = active_version(conn, now)
    return version


def _unavailable(platform, message: str, *, mode: bool = True, **detail) -> PricesUnavailable:
    if mode:
        degraded.enter(platform, degraded.PRICING, f"price book unreadable and no usable price snapshot ({message}): "
                       "new work is refused", **detail)
    return PricesUnavailable(f"prices are unavailable ({message}); retry later")


def _from_snapshot(platform, error: Exception) -> Priced:
    snap: PriceSnapshot | None = platform.extras.get("price_snapshot")
    cfg = platform.config.billing
    now = platform.clock.now()
    if snap is None:
        raise _unavailable(platform, "no price version was read yet", error=repr(error)[:200])
    if not snap.intact():
        raise _unavailable(platform, "the snapshot fails its checksum", price_version_id=str(snap.version["price_version_id"]))
    age = (now - snap.read_at).total_seconds() * platform.clock.time_scale
    if age > cfg.price_snapshot_max_age_seconds:
        raise _unavailable(platform, f"the snapshot is {age:.0f}s old (max {cfg.price_snapshot_max_age_seconds:.0f}s)",
                           price_version_id=str(snap.version["price_version_id"]))
    if snap.version["effective_to"] is not None and snap.version["effective_to"] <= now:
        raise _unavailable(platform, "the snapshot's version is no longer in force",
                           price_version_id=str(snap.version["price_version_id"]))
    degraded.enter(platform, degraded.PRICING,
                   f"price book unreadable: pricing from the snapshot of version {snap.version['price_version_id']} "
                   f"read at {snap.read_at.isoformat()}, for tasks up to {cfg.price_snapshot_max_task_amount} credits",
                   price_version_id=str(snap.version["price_version_id"]), error=repr(error)[:200])
    return Priced(snap.version, snap)


def current(platform) -> Priced:
    """The active version, cached per process for a moment: versions are immutable, and a new one
    only applies to tasks admitted after it is seen. When the price book cannot be read, the last
    snapshot under the rules above, else PricesUnavailable."""
    def load() -> Priced:
        try:
            version = _read_active(platform)
        except psycopg.Error as e:
            logger.warning("price book unreadable", extra={"error": repr(e)[:200]})
            return _from_snapshot(platform, e)
        platform.extras["price_snapshot"] = PriceSnapshot(version, _rules_hash(version["rules"]), platform.clock.now())
        degraded.leave(platform, degraded.PRICING)
        return Priced(version, None)

    return cached(platform, "price_version", load)


def current_version(platform) -> dict:
    return current(platform).version


def admission_quote(platform, est: Estimate) -> Quote:
    """The quote admission reserves against; from a snapshot only up to the per-task cap."""
    priced = current(platform)
    q = quote(priced.version, est)
    cap = platform.config.billing.price_snapshot_max_task_amount
    if priced.snapshot is not None and q.max_reserve_amount > cap:
        raise _unavailable(platform, f"a task of {q.max_reserve_amount} credits is above the {cap}-credit cap for "
                           "pricing from a snapshot", mode=False)
    return q


def load_version(conn: psycopg.Connection, price_version_id: UUID) -> dict | None:
    return conn.execute("select * from price_book where price_version_id = %s", (price_version_id,)).fetchone()


def price(rules: dict, est: Estimate) -> tuple[int, str]:
    """Quoted credits for one estimate under one version's rules. Integers only; rounds up."""
    r = rules["models"][est.model]
    amount = amount_for_seconds(r, seconds=est.duration_seconds, resolution=est.resolution, mode=est.mode,
                                with_audio=est.with_audio)
    return amount, r["charge_policy_code"]


def amount_for_seconds(model_rules: dict, *, seconds: int | Decimal, resolution: str, mode: str, with_audio: bool) -> int:
    """Credits for `seconds` of output under one model's rules: the quote's formula, which usage-based
    settlement applies to the seconds actually produced (ch. 20.6.1). Rounds up."""
    numerator = (model_rules["base_amount"] + model_rules["per_second_amount"] * Decimal(seconds)) \
        * model_rules["resolution_multiplier_pct"][resolution] * model_rules["mode_multiplier_pct"][mode]
    amount = int((numerator / 10_000).to_integral_value(rounding=ROUND_CEILING))
    if with_audio:
        amount += model_rules["audio_surcharge_amount"]
    return amount


def quote(version: dict, est: Estimate) -> Quote:
    amount, policy = price(version["rules"], est)
    # Fixed-price products reserve exactly the quote; usage-based ones would reserve a cap above it.
    return Quote(version["price_version_id"], amount, amount, UNIT, policy)


def version_doc(row: dict) -> dict:
    return {"price_version_id": str(row["price_version_id"]), "product_code": row["product_code"],
            "effective_from": row["effective_from"].isoformat(),
            "effective_to": row["effective_to"].isoformat() if row["effective_to"] else None,
            "unit": row["currency_or_unit"], "status": row["status"], "rules": row["rules"],
            "created_by": row.get("created_by"), "reason": row.get("reason"),
            "created_at": row["created_at"].isoformat() if row.get("created_at") else None}


LIST_VERSIONS = """select * from price_book
                    where (%(p)s::text is null or product_code = %(p)s)
                      and (%(before_from)s::timestamptz is null
                           or (effective_from, price_version_id) < (%(before_from)s, %(before_id)s::uuid))
                    order by effective_from desc, price_version_id desc limit %(limit)s"""


def list_price_versions(conn: psycopg.Connection, *, product_code: str | None = None, limit: int = 50,
                        cursor: str | None = None) -> dict:
    """Price versions, newest effective_from first: {"items": [...], "next_cursor"} (an opaque cursor)."""
    if type(limit) is not int or not 1 <= limit <= 500:
        raise InvalidRequest("invalid limit", {"limit": "from 1 to 500"})
    before_from = before_id = None
    if cursor:
        try:
            raw = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
            before_from, before_id = datetime.fromisoformat(raw["f"]), str(UUID(raw["id"]))
        except (ValueError, KeyError, TypeError, RecursionError):
            raise InvalidRequest("invalid cursor", {"cursor": "a next_cursor this API returned"}) from None
    rows = conn.execute(LIST_VERSIONS, {"p": product_code, "before_from": before_from, "before_id": before_id,
                                        "limit": limit + 1}).fetchall()
    items = [version_doc(r) for r in rows[:limit]]
    nxt = None
    if len(rows) > limit:
        last = rows[limit - 1]
        nxt = base64.urlsafe_b64encode(json.dumps({"f": last["effective_from"].isoformat(),
                                                   "id": str(last["price_version_id"])}).encode()).decode().rstrip("=")
    return {"items": items, "next_cursor": nxt}
