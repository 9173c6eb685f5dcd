"""Immutable, versioned prices (ch. 20.6.1). A price version's rules are data; a quote names the
version it came from, and a task settles at that version forever, whatever today's price is."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_CEILING, Decimal
from uuid import UUID

import psycopg

from aivedio.admission.estimates import Estimate
from aivedio.config import PlatformConfig
from aivedio.observability import logger

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
    otherwise close the current version and open a new one. Old versions are never edited."""
    rules = default_rules(config)
    with conn.transaction():
        conn.execute("select pg_advisory_xact_lock(hashtext('price_book:' || %s))", (PRODUCT_CODE,))
        current = active_version(conn, now)
        if current and _rules_hash(current["rules"]) == _rules_hash(rules):
            return current["price_version_id"]
        if current:
            conn.execute("update price_book set effective_to = %s where price_version_id = %s",
                         (now, current["price_version_id"]))
        row = conn.execute(
            """insert into price_book (product_code, effective_from, currency_or_unit, rules, status)
               values (%s, %s, %s, %s, 'ACTIVE') returning price_version_id""",
            (PRODUCT_CODE, now, UNIT, json.dumps(rules)),
        ).fetchone()
        return row["price_version_id"]


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
# Otherwise the request is refused with REJECT_PRICING_UNAVAILABLE: never a default or zero price,
# never a client's. A task priced from a snapshot names that version, as any other.

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


def _unavailable(platform, message: str, *, mode: bool = True, **detail):
    from aivedio import degraded
    from aivedio.admission.decisions import Rejected

    if mode:
        degraded.enter(platform, degraded.PRICING, f"price book unreadable and no usable price snapshot ({message}): "
                       "new work is refused", **detail)
    return Rejected("REJECT_PRICING_UNAVAILABLE", f"prices are unavailable ({message}); retry later", 30)


def _from_snapshot(platform, error: Exception) -> Priced:
    from aivedio import degraded

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
    snapshot under the rules above, else Rejected(REJECT_PRICING_UNAVAILABLE)."""
    from aivedio import degraded
    from aivedio.admission.queue_stats import cached

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
