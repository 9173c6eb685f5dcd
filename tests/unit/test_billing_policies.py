"""Charge policies as versioned data and the pure decide() (issue 6, "Charge policies as data")."""
from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aivedio.billing import policies
from aivedio.billing.policies import ChargeSnapshot, Outcome, decide
from aivedio.config import ModelPrice

RULES = ModelPrice().model_dump()
PARAMS = {"model": "video-model-x", "mode": "text_to_video", "resolution": "720p", "with_audio": False}


def snap(code="SUCCESS_ONLY", quoted=70, reserved=70, account_type="PREPAID", headroom=0) -> ChargeSnapshot:
    return ChargeSnapshot(policy_code=code, quoted_amount=quoted, reserved_open=reserved, model_rules=RULES, params=PARAMS,
                          account_type=account_type, headroom=headroom)


def test_every_policy_covers_every_outcome_and_codes_are_versioned():
    for key, p in policies.POLICIES.items():
        assert key == f"{p.code}@{p.version}"
        assert {o for o in p.rules} == {(s, st) for s, stages in policies.OUTCOMES.items() for st in stages}
    assert policies.resolve("SUCCESS_ONLY") is policies.resolve("SUCCESS_ONLY@1")  # a bare code is version 1
    with pytest.raises(policies.UnknownPolicy):
        policies.resolve("SUCCESS_ONLY@9")
    with pytest.raises(ValueError, match="cover exactly every outcome"):
        policies.ChargePolicy("X", 1, "", {("SUCCEEDED", "PROVIDER_SUCCEEDED"): ("QUOTE", "QUOTE")}, "HARD_CAP")


def test_success_only():
    ok = Outcome("SUCCEEDED", "PROVIDER_SUCCEEDED", provider_charged=True, usage_seconds=Decimal("12"))
    d = decide(snap(), ok)
    assert (d.amount, d.rule, d.absorbed, d.policy) == (70, "QUOTE", 0, "SUCCESS_ONLY@1")  # usage does not matter
    assert decide(snap(), Outcome("FAILED", "PROVIDER_FAILED", provider_charged=True)).amount == 0
    assert decide(snap(), Outcome("FAILED", "MEDIA_DELIVERY_FAILED", provider_charged=True)).amount == 0
    assert decide(snap(), Outcome("CANCELLED", "PROVIDER_RUNNING", provider_charged=True)).amount == 14  # ceil(20 % of 70)
    assert decide(snap(), Outcome("CANCELLED", "PROVIDER_RUNNING", provider_charged=False)).amount == 0
    assert decide(snap(), Outcome("CANCELLED", "BEFORE_DISPATCH")).amount == 0


def test_submit_charged():
    s = snap("SUBMIT_CHARGED")
    assert decide(s, Outcome("FAILED", "PROVIDER_FAILED", provider_charged=False)).amount == 70
    assert decide(s, Outcome("FAILED", "MEDIA_DELIVERY_FAILED")).amount == 70
    assert decide(s, Outcome("FAILED", "SUBMIT_REJECTED")).amount == 0
    assert decide(s, Outcome("FAILED", "ABANDONED")).amount == 0
    assert decide(s, Outcome("CANCELLED", "PROVIDER_QUEUED", provider_charged=True)).amount == 14


def test_usage_based_partial_and_capped():
    s = snap("USAGE_BASED")
    d = decide(s, Outcome("SUCCEEDED", "PROVIDER_SUCCEEDED", usage_seconds=Decimal("3.2")))
    assert (d.amount, d.rule, d.absorbed) == (52, "USAGE", 0)
    d = decide(s, Outcome("SUCCEEDED", "PROVIDER_SUCCEEDED", usage_seconds=Decimal("12.5")))
    assert (d.uncapped, d.amount, d.absorbed) == (145, 70, 75) and "capped by HARD_CAP" in d.notes
    d = decide(s, Outcome("SUCCEEDED", "PROVIDER_SUCCEEDED", output_seconds=4))  # no usage reported: delivered seconds
    assert d.amount == 60
    assert decide(s, Outcome("FAILED", "PROVIDER_FAILED", provider_charged=True)).amount == 70  # billed, usage unknown: the quote
    assert decide(s, Outcome("FAILED", "PROVIDER_FAILED", provider_charged=False, usage_seconds=Decimal(3))).amount == 0


def test_over_reservation_rules():
    over = Outcome("SUCCEEDED", "PROVIDER_SUCCEEDED", usage_seconds=Decimal("9"))  # 110 credits
    fixed = decide(snap("SUCCESS_ONLY", quoted=70, reserved=100), Outcome("SUCCEEDED", "PROVIDER_SUCCEEDED"))
    assert fixed.amount == 70  # never more than the quote
    post = decide(snap("USAGE_BASED_POSTPAID", account_type="POSTPAID", headroom=25), over)
    assert (post.amount, post.top_up, post.absorbed) == (95, 25, 15)  # within the credit limit only
    pre = decide(snap("USAGE_BASED_POSTPAID", account_type="PREPAID", headroom=1000), over)
    assert (pre.amount, pre.top_up) == (70, 0)  # a prepaid wallet never goes beyond its reservation
    topped = decide(snap("USAGE_BASED_TOP_UP", reserved=110), over)
    assert (topped.amount, topped.top_up) == (110, 0)  # topped up before the extension


def test_an_unknown_outcome_raises():
    with pytest.raises(policies.UnknownOutcome):
        decide(snap(), Outcome("FAILED", "SOMETHING_NEW"))


@settings(max_examples=300, deadline=None)
@given(code=st.sampled_from(sorted(policies.POLICIES)),
       outcome=st.sampled_from([(s, stg) for s, stages in policies.OUTCOMES.items() for stg in stages]),
       charged=st.booleans(), quoted=st.integers(0, 10_000), extra=st.integers(0, 10_000), headroom=st.integers(-500, 10_000),
       account=st.sampled_from(["PREPAID", "SUBSCRIPTION", "POSTPAID"]),
       seconds=st.one_of(st.none(), st.decimals(min_value=0, max_value=600, places=2)), output=st.integers(0, 600))
def test_decisions_are_bounded(code, outcome, charged, quoted, extra, headroom, account, seconds, output):
    s = snap(code, quoted=quoted, reserved=quoted + extra, account_type=account, headroom=headroom)
    d = decide(s, Outcome(outcome[0], outcome[1], provider_charged=charged, usage_seconds=seconds, output_seconds=output))
    assert 0 <= d.amount <= s.reserved_open + d.top_up
    assert d.absorbed == d.uncapped - d.amount >= 0
    assert 0 <= d.top_up <= max(0, headroom)
    if account != "POSTPAID":
        assert d.top_up == 0  # only a postpaid wallet is charged beyond its reservation
    if outcome[1] in ("BEFORE_DISPATCH", "BEFORE_SUBMIT", "SUBMIT_REJECTED", "ABANDONED"):
        assert d.amount == 0  # nothing reached the provider
