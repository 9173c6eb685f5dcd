"""Room service `credit-expiry` (aivedio.billing.subscriptions, aivedio.billing.expiry): subscription
period grants, the EXPIRE of credit lots past their expiry (only their available part), then a retry
of settlement events parked because their task was not known yet."""
from __future__ import annotations

from aivedio.billing import expiry, subscriptions
from aivedio.billing.settlement import retry_parked
from aivedio.reconcile.room import Defaults, Report

NAME = "credit-expiry"
DEFAULTS = Defaults(interval_seconds=300.0)  # locally billing.credit_expiry_seconds


def run_once(platform) -> Report:
    now = platform.clock.now()
    granted = subscriptions.grant_due(platform, now)
    expired = expiry.sweep(platform, now)
    retried = retry_parked(platform, now)
    return Report(NAME, examined=expired["wallets"], repaired=expired["credits_expired"], batches=1,
                  complete=True, details={"subscriptions": granted, "expiry": expired, "parked_settlements": retried})
