"""Charge policies as versioned data (ch. 20.6.4 to 20.6.6, 20.7.8), and the one pure function that
turns a task's locked charge snapshot and its terminal outcome into the credits to charge.

A policy is named in the charge snapshot at admission (generation_charge.charge_policy_code, from
the price version the task was quoted with) and never changes for that task. Its code is
`CODE@VERSION`; a bare `CODE` is version 1, as snapshots written before versions were spelled out.
A change of policy is a new version here, never an edit of an old one: tasks already admitted
settle with the version they were promised.

Each policy says, for every terminal outcome (state, stage), which rule charges the user, once for
a job the provider billed (provider_charged) and once for one it did not:

- NONE: nothing; the whole reservation is released;
- QUOTE: the quoted amount (fixed price);
- USAGE: the quote's formula applied to the seconds actually produced, from the locked price rules;
- CANCEL_FEE: `cancel_fee_pct` of the quote, rounded up.

Then its over-reservation rule (ch. 20.6.5) bounds what is charged when the rule asks for more than
is reserved:

- FIXED_PRICE_CAP: never more than the quote; the platform bears the rest;
- TOP_UP_RESERVE: never more than reserved; work that may cost more (an extension, an upscale)
  must top the reservation up first (reservations.top_up), and is refused when it cannot;
- POSTPAID_CREDIT: a POSTPAID wallet is charged the excess within its credit limit, reserved and
  settled in the same transaction; any other wallet is capped as HARD_CAP;
- HARD_CAP: never more than reserved.

A prepaid wallet therefore never goes negative: nothing is charged beyond what it reserved.
What a cap cuts off is reported as `absorbed` (the platform's loss), never dropped silently."""
from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from types import MappingProxyType
from typing import Mapping

from aivedio.pricing.price_book import amount_for_seconds

NONE, QUOTE, USAGE, CANCEL_FEE = "NONE", "QUOTE", "USAGE", "CANCEL_FEE"
RULES = (NONE, QUOTE, USAGE, CANCEL_FEE)
FIXED_PRICE_CAP, TOP_UP_RESERVE, POSTPAID_CREDIT, HARD_CAP = "FIXED_PRICE_CAP", "TOP_UP_RESERVE", "POSTPAID_CREDIT", "HARD_CAP"
OVER_RESERVATION = (FIXED_PRICE_CAP, TOP_UP_RESERVE, POSTPAID_CREDIT, HARD_CAP)

# Every terminal outcome of the terminal event contract: state -> its stages.
OUTCOMES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "SUCCEEDED": ("PROVIDER_SUCCEEDED",),
    "FAILED": ("SUBMIT_REJECTED", "PROVIDER_FAILED", "MEDIA_DELIVERY_FAILED", "ABANDONED"),
    "CANCELLED": ("BEFORE_DISPATCH", "BEFORE_SUBMIT", "PROVIDER_QUEUED", "PROVIDER_RUNNING"),
})


# Terminal states a policy prices with another state's rules. MEDIA_INGEST_FAILED (the media pipeline
# could not make a playable video of the provider's success, aivedio.media.pipeline) is the outcome
# FAILED/MEDIA_DELIVERY_FAILED names, "a result the platform could not deliver": every policy version
# already says what it charges for it, so no version changes.
CHARGED_AS: Mapping[str, str] = MappingProxyType({"MEDIA_INGEST_FAILED": "FAILED"})


class UnknownPolicy(KeyError):
    pass


class UnknownOutcome(ValueError):
    pass


@dataclass(frozen=True)
class ChargePolicy:
    code: str
    version: int
    description: str
    # (state, stage) -> (rule when the provider billed the job, rule when it did not)
    rules: Mapping[tuple[str, str], tuple[str, str]]
    over_reservation: str
    cancel_fee_pct: int = 0

    @property
    def key(self) -> str:
        return f"{self.code}@{self.version}"

    def __post_init__(self) -> None:
        every = {(s, st) for s, stages in OUTCOMES.items() for st in stages}
        if set(self.rules) != every:
            raise ValueError(f"{self.key}: rules must cover exactly every outcome; missing "
                             f"{sorted(every - set(self.rules))}, extra {sorted(set(self.rules) - every)}")
        for outcome, pair in self.rules.items():
            if len(pair) != 2 or any(r not in RULES for r in pair):
                raise ValueError(f"{self.key}: {outcome}: rules are pairs of {RULES}")
        if self.over_reservation not in OVER_RESERVATION:
            raise ValueError(f"{self.key}: over_reservation must be one of {OVER_RESERVATION}")
        if not 0 <= self.cancel_fee_pct <= 100:
            raise ValueError(f"{self.key}: cancel_fee_pct must be 0..100")


def _rules(**by_outcome: tuple[str, str]) -> Mapping[tuple[str, str], tuple[str, str]]:
    out = {}
    for name, pair in by_outcome.items():
        state, stage = name.split("__")
        out[(state, stage)] = pair
    return MappingProxyType(out)


# Pre-provider outcomes never charge: nothing can have been billed (ch. 20.6.6 "尚未提交供应商").
_NOT_STARTED = dict(
    FAILED__SUBMIT_REJECTED=(NONE, NONE),
    FAILED__ABANDONED=(NONE, NONE),
    CANCELLED__BEFORE_DISPATCH=(NONE, NONE),
    CANCELLED__BEFORE_SUBMIT=(NONE, NONE),
)

_POLICIES = (
    ChargePolicy(
        "SUCCESS_ONLY", 1,
        "Pay only for a delivered video, at the quote. A failed job is free even when the provider billed "
        "it (that cost is the platform's failure cost); so is a result the platform could not deliver "
        "(playable delivery is the promise, ch. 20.7.8). A cancellation the provider billed passes on a fee.",
        _rules(SUCCEEDED__PROVIDER_SUCCEEDED=(QUOTE, QUOTE),
               FAILED__PROVIDER_FAILED=(NONE, NONE),
               FAILED__MEDIA_DELIVERY_FAILED=(NONE, NONE),
               CANCELLED__PROVIDER_QUEUED=(CANCEL_FEE, NONE),
               CANCELLED__PROVIDER_RUNNING=(CANCEL_FEE, NONE),
               **_NOT_STARTED),
        FIXED_PRICE_CAP, cancel_fee_pct=20),
    ChargePolicy(
        "SUBMIT_CHARGED", 1,
        "Pay the quote once the provider accepted the job: a provider failure and an undelivered result "
        "are charged (delivery is retried, ch. 20.7.8); a cancellation while running is charged, while "
        "queued only when the provider billed it.",
        _rules(SUCCEEDED__PROVIDER_SUCCEEDED=(QUOTE, QUOTE),
               FAILED__PROVIDER_FAILED=(QUOTE, QUOTE),
               FAILED__MEDIA_DELIVERY_FAILED=(QUOTE, QUOTE),
               CANCELLED__PROVIDER_QUEUED=(CANCEL_FEE, NONE),
               CANCELLED__PROVIDER_RUNNING=(QUOTE, QUOTE),
               **_NOT_STARTED),
        FIXED_PRICE_CAP, cancel_fee_pct=20),
    ChargePolicy(
        "USAGE_BASED", 1,
        "Pay for the seconds produced, at the locked per-second rules, capped at the reservation. A failed "
        "or cancelled job is charged its usage only when the provider billed it.",
        _rules(SUCCEEDED__PROVIDER_SUCCEEDED=(USAGE, USAGE),
               FAILED__PROVIDER_FAILED=(USAGE, NONE),
               FAILED__MEDIA_DELIVERY_FAILED=(USAGE, USAGE),
               CANCELLED__PROVIDER_QUEUED=(CANCEL_FEE, NONE),
               CANCELLED__PROVIDER_RUNNING=(USAGE, NONE),
               **_NOT_STARTED),
        HARD_CAP, cancel_fee_pct=10),
)


def _variant(base: ChargePolicy, code: str, over_reservation: str, note: str) -> ChargePolicy:
    return ChargePolicy(code, 1, base.description + " " + note, base.rules, over_reservation, base.cancel_fee_pct)


POLICIES: Mapping[str, ChargePolicy] = MappingProxyType({p.key: p for p in (
    *_POLICIES,
    _variant(_POLICIES[2], "USAGE_BASED_TOP_UP", TOP_UP_RESERVE,
             "Work that may run longer tops the reservation up first, and is refused when it cannot."),
    _variant(_POLICIES[2], "USAGE_BASED_POSTPAID", POSTPAID_CREDIT,
             "A POSTPAID wallet pays usage beyond the reservation within its credit limit."),
)})


def resolve(code: str) -> ChargePolicy:
    """The policy a snapshot names: `CODE@N`, or a bare `CODE` meaning version 1."""
    name, _, version = code.partition("@")
    key = f"{name}@{version or 1}"
    try:
        return POLICIES[key]
    except KeyError:
        raise UnknownPolicy(f"no charge policy {code!r}; known: {sorted(POLICIES)}") from None


@dataclass(frozen=True)
class ChargeSnapshot:
    """What was locked at admission, plus the wallet's room at settlement time."""

    policy_code: str
    quoted_amount: int
    reserved_open: int  # reserved and neither settled nor released yet
    model_rules: Mapping  # the model's rules in the LOCKED price version
    params: Mapping  # normalized params: mode, resolution, with_audio
    account_type: str = "PREPAID"
    headroom: int = 0  # what the wallet could still reserve now (available, plus the credit limit if POSTPAID)


@dataclass(frozen=True)
class Outcome:
    state: str
    stage: str
    provider_charged: bool = False
    usage_seconds: Decimal | None = None
    output_seconds: int = 0


@dataclass(frozen=True)
class ChargeDecision:
    amount: int  # credits to settle
    top_up: int  # credits to reserve first, beyond the reservation (POSTPAID_CREDIT only)
    uncapped: int  # what the rule asked for
    absorbed: int  # uncapped - amount: borne by the platform
    rule: str
    policy: str
    reason_code: str
    notes: tuple[str, ...] = field(default_factory=tuple)


def rule_for(policy: ChargePolicy, outcome: Outcome) -> str:
    pair = policy.rules.get((CHARGED_AS.get(outcome.state, outcome.state), outcome.stage))
    if pair is None:
        raise UnknownOutcome(f"{policy.key}: no rule for {outcome.state}/{outcome.stage}")
    return pair[0] if outcome.provider_charged else pair[1]


def decide(snapshot: ChargeSnapshot, outcome: Outcome) -> ChargeDecision:
    """Credits to charge for this outcome under the snapshot's locked policy and price rules."""
    policy = resolve(snapshot.policy_code)
    rule = rule_for(policy, outcome)
    notes: list[str] = []
    if rule == NONE:
        uncapped = 0
    elif rule == QUOTE:
        uncapped = snapshot.quoted_amount
    elif rule == CANCEL_FEE:
        uncapped = -(-snapshot.quoted_amount * policy.cancel_fee_pct // 100)
    else:  # USAGE
        seconds = outcome.usage_seconds
        if seconds is None and outcome.output_seconds > 0:
            seconds = Decimal(outcome.output_seconds)
            notes.append("usage from delivered seconds")
        if seconds is None:
            uncapped = snapshot.quoted_amount  # the provider billed but did not say for what: the promise holds
            notes.append("usage unknown: quote")
        else:
            p = snapshot.params
            uncapped = amount_for_seconds(snapshot.model_rules, seconds=max(Decimal(0), seconds), resolution=p["resolution"],
                                          mode=p["mode"], with_audio=bool(p.get("with_audio")))
    amount, top_up = _cap(policy, snapshot, uncapped)
    if amount < uncapped:
        notes.append(f"capped by {policy.over_reservation}")
    return ChargeDecision(amount=amount, top_up=top_up, uncapped=uncapped, absorbed=uncapped - amount, rule=rule,
                          policy=policy.key, reason_code=f"{rule}:{outcome.state}/{outcome.stage}", notes=tuple(notes))


def _cap(policy: ChargePolicy, s: ChargeSnapshot, uncapped: int) -> tuple[int, int]:
    """(amount, top_up) under the policy's over-reservation rule."""
    open_ = max(0, s.reserved_open)
    if policy.over_reservation == FIXED_PRICE_CAP:
        return min(uncapped, s.quoted_amount, open_), 0
    if policy.over_reservation == POSTPAID_CREDIT and s.account_type == "POSTPAID":
        excess = max(0, uncapped - open_)
        top_up = min(excess, max(0, s.headroom))
        return min(uncapped, open_ + top_up), top_up
    return min(uncapped, open_), 0  # HARD_CAP, TOP_UP_RESERVE (topped up before the work), POSTPAID_CREDIT elsewhere
