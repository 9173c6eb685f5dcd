"""The router's cost term (ch. 20.9.3): each candidate's expected cost per success, compared with the
cheapest list price among the candidates. Divided by each provider's own price, as it was, the price
cancelled out: a provider at a quarter of the price scored the same as a dear one, and only the
success rates told them apart."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from aivedio.config import PlatformConfig, ProviderAccount, ProviderConfig
from aivedio.scheduling import router

TASK = {"model_code": "video-model-x", "resolution": "720p", "duration_seconds": 5}


def _platform(monkeypatch, stats: dict[str, router.ProviderStats]):
    cfg = PlatformConfig(providers=[
        ProviderConfig(name="premium", cost_per_second="0.0800", accounts=[ProviderAccount(account_id="a", max_concurrency=5)]),
        ProviderConfig(name="value", cost_per_second="0.0200", accounts=[ProviderAccount(account_id="a", max_concurrency=5)]),
    ])
    monkeypatch.setattr(router, "provider_stats", lambda platform, conn=None: stats)  # recent outcomes, as PostgreSQL would give them
    return SimpleNamespace(config=cfg)


def test_at_equal_reliability_the_cheaper_provider_goes_first(monkeypatch):
    p = _platform(monkeypatch, {})
    for tier in router.TIER_WEIGHTS:
        routes = router.route(p, TASK, tier)
        assert [r.provider for r in routes] == ["value", "premium"], tier
        assert routes[0].expected_cost < routes[1].expected_cost


def test_a_cheap_provider_that_fails_often_loses_where_reliability_weighs_most(monkeypatch):
    flaky = router.ProviderStats(success_rate=0.55, billable_failure_rate=0.2, duplicate_rate=0.0, mean_latency_seconds=60, samples=19)
    solid = router.ProviderStats(success_rate=0.99, billable_failure_rate=0.0, duplicate_rate=0.0, mean_latency_seconds=60, samples=19)
    p = _platform(monkeypatch, {"value": flaky, "premium": solid})
    assert router.route(p, TASK, "ENTERPRISE_RESERVED")[0].provider == "premium"  # reliability 0.5 of the score
    assert router.route(p, TASK, "BEST_EFFORT")[0].provider == "value"  # cost 0.7 of it
    expected = {r.provider: r.expected_cost for r in router.route(p, TASK, "STANDARD")}
    # Billable failures are paid for and spread over the successes: 0.02 x 5 x 1.2 / 0.55.
    assert float(expected["value"]) == pytest.approx(0.02 * 5 * 1.2 / 0.55, rel=1e-6)
