"""The arithmetic of weighted Deficit Round Robin in cost units (ch. 18.6.3, 18.6.4; the fair-queue
article), apart from the database: Scheduler.visit reads a tenant's DRR row and heads, asks
`begin_turn` what the turn may spend, claims while `fits`, and stores `end_turn`'s deficit. Pure
functions of numbers, so a property test can drive thousands of rounds.

- A turn's quantum is base_quantum x weight, `rounds` of them at once when the lane has room for
  that many rounds of every tenant (Scheduler._rounds); a turn resumed after capacity paused it
  (or continued after its batch filled) gets no new quantum.
- A tenant coming back from empty keeps no more credit than its initial burst.
- Fairness debt (a correction for a big task claimed on credit) is repaid from the quantum, at most
  half a quantum per turn.
- The deficit never exceeds the cap: burst_rounds quanta, or the biggest head's size plus a quantum
  less one when that is more (so a task bigger than a quantum is eventually served, and a
  backlogged tenant never loses earned credit), times the rounds granted; what a finished turn
  leaves is cut back to one round's cap, so abundance is never banked as a burst."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TurnStart:
    deficit: int  # what the turn may spend
    debt_paid: int  # fairness debt repaid from this turn's quantum
    cap: int  # one round's ceiling on the deficit


def quantum(base_quantum: int, weight: int) -> int:
    return base_quantum * weight


def begin_turn(*, deficit: int, active: bool, fairness_debt: int, weight: int, base_quantum: int,
               initial_burst_credit: int, burst_rounds: int, biggest_head: int, rounds: int = 1,
               resuming: bool = False) -> TurnStart:
    q = quantum(base_quantum, weight)
    if not active:  # back from empty: no hoarded credit beyond the initial burst
        deficit = min(deficit, initial_burst_credit)
    # Room for the biggest head plus a quantum less one: a backlogged tenant ends a turn with less
    # than its next head (or it would have claimed it), so adding a quantum never hits the cap and
    # no earned credit is cut. A cap of just the biggest head cut up to a quantum per turn from
    # tenants whose tasks are bigger than their quantum (mixed-cost shares drifted by that).
    cap = max(q * max(1, burst_rounds), biggest_head + q - 1)
    if resuming:
        return TurnStart(deficit, 0, cap)
    debt_paid = min(fairness_debt, q // 2)
    return TurnStart(min(deficit + q * rounds - debt_paid, cap * rounds), debt_paid, cap)


def fits(units: int, deficit: int) -> bool:
    """A head is claimed only while the turn's deficit covers its cost units."""
    return units <= deficit


def end_turn(deficit: int, cap: int, *, continues: bool) -> int:
    """The deficit stored after a visit: a turn that continues at once keeps all of it; one that
    is over (or waits for room) keeps at most one round's cap."""
    left = deficit if continues else min(deficit, cap)
    return max(0, left)
