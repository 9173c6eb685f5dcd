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


def current_version(platform) -> dict:
    """The active version, cached per process for a moment: versions are immutable, and a new one
    only applies to tasks admitted after it is seen."""
    from aivedio.admission.queue_stats import cached

    def load() -> dict:
        now = platform.clock.now()
        with platform.db.connection() as conn:
            version = active_version(conn, now)
            if version is None:
                ensure_price_book(conn, platform.config, now)
                version = active_version(conn, now)
        return version

    return cached(platform, "price_version", load)


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
