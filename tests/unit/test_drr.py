"""Properties of the DRR arithmetic (aivedio.scheduling.drr), driven without a database."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from aivedio.scheduling import drr

weights = st.lists(st.integers(min_value=1, max_value=8), min_size=1, max_size=6)
sizes = st.integers(min_value=1, max_value=12)


@settings(max_examples=200, deadline=None)
@given(weights=weights, base=st.integers(min_value=1, max_value=4), burst=st.integers(min_value=1, max_value=4),
       rounds=st.integers(min_value=1, max_value=60), seed=st.randoms(use_true_random=False))
def test_backlogged_tenants_are_served_exactly_their_quanta_less_what_is_left(weights, base, burst, rounds, seed):
    """Every tenant always backlogged with tasks of random sizes: after R rounds each tenant was
    served exactly R quanta minus the deficit it holds, and that is less than one task. So shares
    follow the weights to within a task, whatever the sizes."""
    queues = [[seed.randint(1, 12) for _ in range(400)] for _ in weights]
    deficit = [0] * len(weights)
    served = [0] * len(weights)
    for r in range(rounds):
        for i, w in enumerate(weights):
            heads = queues[i][:8]
            t = drr.begin_turn(deficit=deficit[i], active=r > 0, fairness_debt=0, weight=w, base_quantum=base,
                               initial_burst_credit=2 * base * w, burst_rounds=burst, biggest_head=max(heads))
            d = t.deficit
            assert 0 <= d <= t.cap
            while queues[i] and drr.fits(queues[i][0], d):
                d -= queues[i][0]
                served[i] += queues[i].pop(0)
            deficit[i] = drr.end_turn(d, t.cap, continues=False)
    for i, w in enumerate(weights):
        assert served[i] + deficit[i] == rounds * base * w
        assert 0 <= deficit[i] < max(queues[i][:1] or [1])


@given(deficit=st.integers(min_value=0, max_value=1000), weight=st.integers(min_value=1, max_value=10),
       debt=st.integers(min_value=0, max_value=100), head=sizes, rounds=st.integers(min_value=1, max_value=10),
       active=st.booleans())
def test_a_turn_never_exceeds_its_cap_and_repays_at_most_half_a_quantum(deficit, weight, debt, head, rounds, active):
    t = drr.begin_turn(deficit=deficit, active=active, fairness_debt=debt, weight=weight, base_quantum=1,
                       initial_burst_credit=2 * weight, burst_rounds=2, biggest_head=head, rounds=rounds)
    assert t.cap == max(2 * weight, head + weight - 1)
    assert t.deficit <= t.cap * rounds
    assert 0 <= t.debt_paid <= min(debt, weight // 2)
    if not active:  # back from empty: at most its initial burst, plus this turn's quanta
        assert t.deficit <= 2 * weight + weight * rounds
    assert drr.end_turn(t.deficit, t.cap, continues=False) <= t.cap


@given(deficit=st.integers(min_value=0, max_value=50), weight=st.integers(min_value=1, max_value=10))
def test_a_resumed_turn_gets_no_new_quantum(deficit, weight):
    t = drr.begin_turn(deficit=deficit, active=True, fairness_debt=5, weight=weight, base_quantum=1,
                       initial_burst_credit=0, burst_rounds=100, biggest_head=1, resuming=True)
    assert (t.deficit, t.debt_paid) == (deficit, 0)


def test_abundance_is_not_banked_and_a_big_task_is_eventually_served():
    # A weight-1 tenant whose head is 5 units accumulates to it (the cap grows to the head's size) ...
    deficit = 0
    for turn in range(5):
        t = drr.begin_turn(deficit=deficit, active=True, fairness_debt=0, weight=1, base_quantum=1,
                           initial_burst_credit=2, burst_rounds=1, biggest_head=5)
        assert drr.fits(5, t.deficit) == (turn == 4)
        deficit = drr.end_turn(t.deficit, t.cap, continues=False)
    # ... and a turn of 10 rounds at once that spends nothing keeps one round's cap, not ten.
    t = drr.begin_turn(deficit=0, active=True, fairness_debt=0, weight=3, base_quantum=1, initial_burst_credit=6,
                       burst_rounds=1, biggest_head=1, rounds=10)
    assert t.deficit == 30 and drr.end_turn(t.deficit, t.cap, continues=False) == 3
    assert drr.end_turn(t.deficit, t.cap, continues=True) == 30
