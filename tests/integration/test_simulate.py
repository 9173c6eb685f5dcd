"""`aivedio simulate` at reduced size (issue 4, "Fairness must be measured, not assumed"): the real
admission, DRR scheduler, claim and release against scratch PostgreSQL databases and a real Redis,
on a manual clock. Sizes are cut so each scenario finishes within seconds to tens of seconds; the
full-size figures come from `aivedio simulate --scenario NAME --json`.

The provider-bound scenarios (issue "Fair shares where capacity really binds") are checked for what
the simulation itself guarantees: the config's provider accounts are the capacity the claim holds,
utilisation is of those slots, the invariants hold and the report carries every figure. The weighted
shares (fairness error <= 0.03, per account where there are two) are asserted too, since the
scheduler keeps a turn paused on the binding key across Scheduler objects; so is whale-provider-bound's
wait target (every small tenant's p99 within 1.5x of the realised-slot ideal), met since a drained
tenant leaves the ring at once (1.13x at full size, 2.17x before)."""
from __future__ import annotations

import pytest

from aivedio.pricing.estimates import estimate
from aivedio.admission.models import GenerationRequest
from aivedio_tools.simulate import build, run_scenario
from aivedio_tools.simulate.scenarios import BODY_1U, BODY_8U, BODY_15U, MODEL_A, MODEL_B, platform_config, with_model
from tests.conftest import admin_url


def _invariants_hold(run: dict) -> None:
    failed = {k: v for k, v in run["invariants"].items() if not v["ok"]}
    assert not failed, failed
    assert run["starvation_check"]["ok"], run["starvation_check"]


def test_scenario_bodies_cost_what_the_scenarios_say():
    """The scenarios' request bodies have the fairness units they are built around, and stay in the
    tenant's own lane (not EXPENSIVE)."""
    cfg = platform_config({}, 40)
    for body, units in ((BODY_1U, 1), (BODY_8U, 8), (BODY_15U, 15)):
        est = estimate(GenerationRequest.model_validate(body), [], "PAID_SHARED", cfg)
        assert (est.fairness_units, est.queue_class, est.provider_slot_units) == (units, "PAID_SHARED", 1), body
    assert set(build("whale-vs-small").config.lanes) >= {"PAID_SHARED", "ENTERPRISE_RESERVED"}
    two = build("two-accounts").config
    for model in (MODEL_A, MODEL_B):
        est = estimate(GenerationRequest.model_validate(with_model(BODY_1U, model)), [], "PAID_SHARED", two)
        assert (est.fairness_units, est.queue_class, est.provider_slot_units) == (1, "PAID_SHARED", 1), model


@pytest.mark.timeout(300)
def test_weighted_4_2_1_shares_follow_weights(redis_url):
    doc = run_scenario("weighted-4-2-1", admin_url=admin_url(), redis_url=redis_url, policies=("drr",),
                       params={"horizon": 450, "window": 150})
    drr = doc["runs"]["drr"]
    lane = drr["lanes"]["PAID_SHARED"]
    assert lane["saturated_windows"] >= 2
    assert lane["fairness_error"] <= 0.03, lane
    assert lane["jain_index"] >= 0.99
    shares = {name: t["share"] for name, t in lane["tenants"].items()}
    assert shares["w4"] > shares["w2"] > shares["w1"]
    assert drr["utilisation"]["when_work_queued"] >= 0.95
    assert drr["interventions"].get("HEAD_BLOCKED", 0) == 0  # a full lane is not a blocked head
    _invariants_hold(drr)


@pytest.mark.timeout(300)
def test_whale_does_not_delay_small_tenants_under_drr_but_does_under_fifo(redis_url):
    """base_quantum 1: the issue's DRR ideal ("as many slots as there are backlogged tenants") is a
    round of one slot per tenant, which is DRR with a quantum of one 1-unit task."""
    doc = run_scenario("whale-vs-small", admin_url=admin_url(), redis_url=redis_url, policies=("drr", "fifo"),
                       params={"whale_tasks": 300, "small_tasks": 6, "mean_gap": 20.0, "scheduler": {"base_quantum": 1}})
    drr, fifo = doc["runs"]["drr"], doc["runs"]["fifo"]
    fd, ff = drr["focus"], fifo["focus"]
    assert all(v["started"] == v["tasks"] for v in fd["small_tenants"].values())
    # Against the slots that actually freed after each task arrived (per-slot round robin on the run's
    # own completions): within 1.5x for every small tenant.
    assert fd["all_small_within_1_5x_realised"], fd
    # Against the rate-based ideal the tail also carries the randomness of completions; it is
    # reported, and it is far below FIFO's.
    assert fd["worst_p99_over_ideal"] is not None
    for name, v in fd["small_tenants"].items():
        assert v["p99_wait"] * 10 < ff["small_tenants"][name]["p99_wait"], name
    assert ff["worst_p99_over_realised_slot_ideal"] > 10 * fd["worst_p99_over_realised_slot_ideal"]
    for run in (drr, fifo):
        assert run["utilisation"]["when_work_queued"] >= 0.95
        _invariants_hold(run)


ACCOUNT = "provider-account:sim-provider:sim-01"
ACCOUNT_A, ACCOUNT_B = "provider-account:sim-a:acct-a", "provider-account:sim-b:acct-b"


def _figures(doc: dict) -> None:
    """Every run reports fairness error, Jain's index, waits and utilisation."""
    for run in doc["runs"].values():
        for lane in run["lanes"].values():
            assert lane["fairness_error"] is not None and 0 <= lane["fairness_error"] <= 1, lane
            assert lane["jain_index"] is not None and 0 < lane["jain_index"] <= 1, lane
            assert lane["wait_seconds"]["n"] > 0 and lane["wait_seconds"]["p99"] is not None
        assert run["utilisation"]["when_work_queued"] is not None


@pytest.mark.timeout(300)
def test_provider_bound_4_2_1_utilisation_is_of_the_account_that_binds(redis_url):
    """One provider account of 6 slots under a lane of 200 units. The account's max_concurrency from
    the config is what the claims hold (never more than 6 running), and utilisation is of those 6
    slots: full, while the lane's units stay nearly unused."""
    doc = run_scenario("provider-bound-4-2-1", admin_url=admin_url(), redis_url=redis_url, policies=("drr", "fifo"),
                       params={"horizon": 200, "window": 100})
    assert doc["simulation"]["provider_accounts"][ACCOUNT]["max_concurrency"] == 6
    assert doc["simulation"]["fresh_scheduler_per_tick"] is True
    _figures(doc)
    for run in doc["runs"].values():
        lane = run["lanes"]["PAID_SHARED"]
        assert lane["saturated_windows"] >= 2
        assert set(lane["tenants"]) == {"w4", "w2", "w1"}
        slots = run["invariants"]["provider_slots_never_above_max_concurrency"]["by_account"][ACCOUNT]
        assert slots == {"max_slots_in_use": 6, "max_concurrency": 6}
        u = run["utilisation"]
        assert u["by_account"][ACCOUNT]["when_account_queued"] >= 0.95
        assert u["when_work_queued"] >= 0.95
        assert u["by_lane"]["PAID_SHARED"]["when_lane_queued"] <= 0.05
        assert u["seconds_provider_slots_fuller_than_lane"] == u["seconds_with_work_queued"]
        _invariants_hold(run)
    # A new Scheduler per tick, as the tick handler builds one per call.
    drr = doc["runs"]["drr"]["run"]
    assert drr["schedulers_built"] == drr["dispatches"]
    fe = next(t for t in doc["targets"] if t["name"] == "fairness_error")
    assert fe["drr"] <= 0.03 and fe["fifo"] > 0.2, fe  # FIFO shares 1:1:1
    lane = doc["runs"]["drr"]["lanes"]["PAID_SHARED"]
    assert lane["jain_index"] >= 0.99
    shares = {name: t["share"] for name, t in lane["tenants"].items()}
    assert shares["w4"] > shares["w2"] > shares["w1"]


@pytest.mark.timeout(300)
def test_one_scheduler_for_the_run_when_asked(redis_url):
    doc = run_scenario("provider-bound-4-2-1", admin_url=admin_url(), redis_url=redis_url, policies=("drr",),
                       params={"horizon": 30, "window": 30, "fresh_scheduler_per_tick": False})
    run = doc["runs"]["drr"]
    assert doc["simulation"]["fresh_scheduler_per_tick"] is False
    assert run["run"]["schedulers_built"] == 1 and run["run"]["dispatches"] > 1
    _invariants_hold(run)


@pytest.mark.timeout(300)
def test_two_accounts_report_fairness_per_pool(redis_url):
    """Two accounts (6 slots for m-a, 3 for m-b) under one lane: shares are measured within each
    account's pool. FIFO, per pool head-of-line, serves each pool's two tenants alike and keeps both
    accounts full, so against weights 4:2 and 2:1 its per-pool error is 1/6 by construction."""
    doc = run_scenario("two-accounts", admin_url=admin_url(), redis_url=redis_url, policies=("drr", "fifo"),
                       params={"horizon": 240, "window": 120})
    _figures(doc)
    members = {ACCOUNT_A: {"a-w4", "a-w2"}, ACCOUNT_B: {"b-w2", "b-w1"}}
    for pol, run in doc["runs"].items():
        pools = run["pools"]["PAID_SHARED"]
        assert set(pools) == set(members)
        for pool, doc_ in pools.items():
            assert set(doc_["tenants"]) == members[pool]
            assert doc_["saturated_windows"] >= 2
            assert doc_["fairness_error"] is not None and doc_["jain_index"] is not None
            assert doc_["wait_seconds"]["p99"] is not None
        by_acct = run["invariants"]["provider_slots_never_above_max_concurrency"]["by_account"]
        assert by_acct[ACCOUNT_A]["max_slots_in_use"] <= 6 and by_acct[ACCOUNT_B]["max_slots_in_use"] <= 3
        assert set(run["utilisation"]["by_account"]) == {ACCOUNT_A, ACCOUNT_B}
        _invariants_hold(run)
    fifo = doc["runs"]["fifo"]
    for pool, d in fifo["pools"]["PAID_SHARED"].items():
        assert abs(d["fairness_error"] - 1 / 6) <= 0.02, (pool, d["fairness_error"])
        assert all(abs(t["share"] - 0.5) <= 0.02 for t in d["tenants"].values()), d["tenants"]
        assert fifo["utilisation"]["by_account"][pool]["when_account_queued"] >= 0.95
    # DRR: each account's shares follow the weights of the tenants with work for it (4:2 and 2:1), and
    # neither account idles while work for it waits. At this size the 3-slot account delivers about 36
    # units a window, one task being 0.03 of it, so the bound is 0.04 here; the full-size run is
    # held to the target of 0.03 (doc["targets"]).
    per_pool = next(t for t in doc["targets"] if t["name"] == "fairness_error_per_pool")
    assert set(per_pool["drr"]) == set(members)
    assert all(v <= 0.04 for v in per_pool["drr"].values()), per_pool
    assert doc["runs"]["drr"]["utilisation"]["when_work_queued"] >= 0.95


@pytest.mark.timeout(300)
def test_a_tenant_on_both_accounts_gets_its_weight_in_each(redis_url):
    """two-accounts with a fifth tenant, ab-both (weight 2), ordering for both accounts alternately:
    DRR per binding pool gives it 2/8 of account A and 2/5 of account B. One deficit per (lane,
    tenant) gave it 0.14 and 0.29 (error 0.11 in both pools): its quantum was split across the
    accounts, and a turn paused on a full account held back its work for the other. Run at full
    size (0.006 to 0.027 here): at half size the 3-slot account's windows are too few units for
    0.04 (one run measured 0.044)."""
    doc = run_scenario("two-accounts", admin_url=admin_url(), redis_url=redis_url, policies=("drr",),
                       params={"horizon": 480, "window": 120, "both_weight": 2})
    run = doc["runs"]["drr"]
    pools = run["pools"]["PAID_SHARED"]
    fair = {ACCOUNT_A: 2 / 8, ACCOUNT_B: 2 / 5}
    print({pool: (d["fairness_error"], {n: t["share"] for n, t in d["tenants"].items()}) for pool, d in pools.items()})
    for pool, d in pools.items():
        assert "ab-both" in d["tenants"], d["tenants"]
        assert abs(d["tenants"]["ab-both"]["share"] - fair[pool]) <= 0.04, (pool, d["tenants"])
        assert d["fairness_error"] <= 0.04, (pool, d["fairness_error"], d["tenants"])
    assert run["utilisation"]["when_work_queued"] >= 0.95
    _invariants_hold(run)


@pytest.mark.timeout(300)
def test_whale_provider_bound_reports_small_tenant_waits_against_the_account_slots(redis_url):
    """The whale and four small tenants on one account of 8 slots under a lane of 200 units: the
    realised-slot ideal counts that account's completions (about 8 slots / 10 s), and DRR's small
    tenants wait far less than FIFO's."""
    doc = run_scenario("whale-provider-bound", admin_url=admin_url(), redis_url=redis_url, policies=("drr", "fifo"),
                       params={"whale_tasks": 150, "small_tenants": 4, "small_tasks": 4, "mean_gap": 15.0, "window": 30.0})
    _figures(doc)
    fd, ff = doc["runs"]["drr"]["focus"], doc["runs"]["fifo"]["focus"]
    for f in (fd, ff):
        assert 0.6 <= f["completion_rate_per_second"] <= 1.0
        assert len(f["small_tenants"]) == 4
        for v in f["small_tenants"].values():
            assert v["started"] == v["tasks"] == 4
            assert v["p99_wait"] is not None and v["p99_realised_slot_ideal"] is not None
        assert f["worst_p99_over_realised_slot_ideal"] is not None and f["worst_p99_over_ideal"] is not None
    assert ff["worst_p99_over_realised_slot_ideal"] > fd["worst_p99_over_realised_slot_ideal"]
    assert fd["worst_p99_over_realised_slot_ideal"] <= 1.5, fd
    for run in doc["runs"].values():
        assert run["utilisation"]["by_account"][ACCOUNT]["max_concurrency"] == 8
        assert run["utilisation"]["when_work_queued"] >= 0.95
        _invariants_hold(run)
