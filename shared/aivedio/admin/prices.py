"""The operator's price versions (ch. 20.6.1): a new version of the price book, validated against
the config's models and the charge policies, audited. The prices themselves, and how a quote is
read from them, are aivedio.pricing.price_book's.

An operator creates a version effective from a moment (now by default) with the rules of each model
given in full or in part: a model or a field left out keeps what the version it follows says (the
config's defaults for an empty book). Versions of a product never overlap: the ACTIVE open-ended
version in force at effective_from is closed there (its effective_to, the one column besides status
that may change), and any other ACTIVE version the new range touches refuses the new one. The past
is never rewritten: closing the version in force before now would reprice what was admitted under it."""
from __future__ import annotations

import json
from datetime import datetime

import psycopg
from pydantic import ValidationError

from aivedio import audit
from aivedio.billing.policies import POLICIES, UnknownPolicy, resolve
from aivedio.config import MODES, RESOLUTIONS, ModelPrice, PlatformConfig
from aivedio.errors import InvalidRequest
from aivedio.pricing.price_book import LOCK_PRODUCT, PRODUCT_CODE, UNIT, default_rules, version_doc

# An operator creates a version effective from a moment (now by default) with the rules of each model
# given in full or in part: a model or a field left out keeps what the version it follows says (the
# config's defaults for an empty book). Versions of a product never overlap: the ACTIVE open-ended
# version in force at effective_from is closed there (its effective_to, the one column besides status
# that may change), and any other ACTIVE version the new range touches refuses the new one. The past
# is never rewritten: closing the version in force before now would reprice what was admitted under it.

PRODUCTS = (PRODUCT_CODE,)
MAX_REASON = 1000
OVERLAPPING = """select price_version_id, effective_from, effective_to from price_book
                  where product_code = %(p)s and status = 'ACTIVE'
                    and (effective_to is null or effective_to > %(from)s)
                    and (%(to)s::timestamptz is null or effective_from < %(to)s)
                  order by effective_from"""
IN_FORCE_AT = """select * from price_book
                  where product_code = %(p)s and status = 'ACTIVE' and effective_from <= %(at)s
                    and (effective_to is null or effective_to > %(at)s)
                  order by effective_from desc limit 1"""
LATEST_BEFORE = """select * from price_book where product_code = %(p)s and status = 'ACTIVE' and effective_from <= %(at)s
                    order by effective_from desc limit 1"""
INSERT_OPERATOR_VERSION = """insert into price_book (product_code, effective_from, effective_to, currency_or_unit, rules,
                                                     status, created_by, reason)
                             values (%s, %s, %s, %s, %s, 'ACTIVE', %s, %s) returning *"""


def _model_rules(config: PlatformConfig, base: dict | None, models: object, bad: dict[str, str]) -> dict:
    """Every configured model's full rules: `base` (a version's rules, or the config's defaults)
    with the given fields of each model replaced, each model validated as a ModelPrice."""
    start = (base or default_rules(config))["models"]
    if not isinstance(models, dict):
        bad["rules.models"] = "an object of model -> price fields"
        return {}
    out = {}
    for m in config.models:
        merged = {**ModelPrice().model_dump(), **(start.get(m) or config.price_for(m).model_dump())}
        given = models.get(m, {})
        if not isinstance(given, dict):
            bad[f"rules.models.{m}"] = "an object of price fields"
            continue
        merged.update(given)
        try:
            price = ModelPrice.model_validate(merged)
        except ValidationError as e:
            for err in e.errors():
                bad[".".join(["rules.models", m, *(str(x) for x in err["loc"])])] = err["msg"]
            continue
        for field, keys in (("resolution_multiplier_pct", RESOLUTIONS), ("mode_multiplier_pct", MODES)):
            table = getattr(price, field)
            if set(table) != set(keys) or any(type(v) is not int or v < 0 for v in table.values()):
                bad[f"rules.models.{m}.{field}"] = f"a non-negative integer percentage for each of {', '.join(keys)}"
        try:
            resolve(price.charge_policy_code)
        except UnknownPolicy:
            bad[f"rules.models.{m}.charge_policy_code"] = f"a charge policy: {', '.join(sorted({k.split('@')[0] for k in POLICIES}))}"
        out[m] = price.model_dump()
    for m in models:
        if m not in config.models:
            bad[f"rules.models.{m}"] = f"unknown model; models are {', '.join(config.models)}"
    return out


def create_price_version(conn: psycopg.Connection, config: PlatformConfig, *, operator: str, effective_from: datetime | None,
                         models: object, now: datetime, reason: object = None, effective_to: datetime | None = None,
                         product_code: str = PRODUCT_CODE) -> dict:
    """A new ACTIVE price version from effective_from (default now) to effective_to (default open).
    Refused with InvalidRequest naming the field, writing nothing, when the range is empty, starts in
    the past over a version in force, or overlaps another ACTIVE version of the product other than
    the open-ended one it supersedes (closed at effective_from). Audited as price.create."""
    bad: dict[str, str] = {}
    if product_code not in PRODUCTS:
        bad["product_code"] = f"unknown product; products are {', '.join(PRODUCTS)}"
    start = effective_from or now
    if start.tzinfo is None:
        bad["effective_from"] = "a time with its timezone"
    if effective_to is not None and (effective_to.tzinfo is None or (start.tzinfo is not None and effective_to <= start)):
        bad["effective_to"] = "after effective_from, with its timezone"
    if reason is not None and (not isinstance(reason, str) or not reason.strip()):
        bad["reason"] = "a non-empty text: why the prices change"
    elif reason is not None and len(reason) > MAX_REASON:
        bad["reason"] = f"at most {MAX_REASON} characters"
    if bad:
        raise InvalidRequest(f"invalid price version: {', '.join(sorted(bad))}", bad)
    conn.execute(LOCK_PRODUCT, (product_code,))
    base = conn.execute(LATEST_BEFORE, {"p": product_code, "at": start}).fetchone()
    rules = {"rules_version": 1, "models": _model_rules(config, base["rules"] if base else None, models, bad)}
    superseded = conn.execute(IN_FORCE_AT, {"p": product_code, "at": start}).fetchone()
    if superseded is not None and (superseded["effective_to"] is not None or superseded["effective_from"] >= start):
        superseded = None  # only an open-ended version that began before is closed; any other overlaps
    overlapping = [r for r in conn.execute(OVERLAPPING, {"p": product_code, "from": start, "to": effective_to}).fetchall()
                   if superseded is None or r["price_version_id"] != superseded["price_version_id"]]
    if superseded is not None and start < now:
        overlapping.insert(0, superseded)  # in force since before now: closing it would reprice the past
        superseded = None
    if overlapping:
        o = overlapping[0]
        span = f"{o['effective_from'].isoformat()} to {o['effective_to'].isoformat() if o['effective_to'] else 'open'}"
        bad["effective_from"] = (f"overlaps ACTIVE price version {o['price_version_id']} ({span})"
                                 + ("; a version in force cannot be closed in the past" if o["effective_from"] < now
                                    and start < now else ""))
    if bad:
        raise InvalidRequest(f"invalid price version: {', '.join(sorted(bad))}", bad)
    if superseded is not None:
        conn.execute("update price_book set effective_to = %s where price_version_id = %s",
                     (start, superseded["price_version_id"]))
    reason = reason.strip() if reason else None
    row = conn.execute(INSERT_OPERATOR_VERSION, (product_code, start, effective_to, UNIT, json.dumps(rules), operator,
                                                 reason)).fetchone()
    doc = version_doc(row)
    audit.append(conn, operator=operator, action="price.create", target=f"price_version:{row['price_version_id']}",
                 old=None if superseded is None else {"price_version_id": str(superseded["price_version_id"]),
                                                      "effective_to": None},
                 new={"price_version_id": doc["price_version_id"], "product_code": product_code,
                      "effective_from": doc["effective_from"], "effective_to": doc["effective_to"], "rules": rules,
                      "supersedes": None if superseded is None else str(superseded["price_version_id"])},
                 reason=reason)
    return {**doc, "supersedes": None if superseded is None else str(superseded["price_version_id"])}
