"""`aivedio simulate`: fairness measured, not assumed (issue 4). A discrete-event simulation that
drives the real admission, scheduler, claim and release code against a scratch PostgreSQL database
on a manual clock, under DRR and under a FIFO baseline, and reports shares, waits, utilisation,
borrowing, interventions and invariants."""
from aivedio_tools.simulate.runner import run_scenario
from aivedio_tools.simulate.scenarios import SCENARIOS, build

__all__ = ["run_scenario", "SCENARIOS", "build"]
