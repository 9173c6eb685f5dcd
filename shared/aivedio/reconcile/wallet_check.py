"""Room service `wallet-check` (aivedio.billing.wallet_checks, ch. 20.8.5): every wallet's snapshot
against its ledger, reservations and lots. A mismatch freezes the wallet's risky operations and is
recorded in wallet_discrepancy; `aivedio admin wallet rebuild` repairs it by appended adjustments."""
from __future__ import annotations

from aivedio.billing import wallet_checks
from aivedio.reconcile.room import Defaults, Report

NAME = "wallet-check"
DEFAULTS = Defaults(interval_seconds=1800.0)  # locally billing.wallet_check_seconds


def run_once(platform) -> Report:
    out = wallet_checks.check_all(platform)
    return Report(NAME, examined=out["wallets"], repaired=0, batches=1,
                  details={"wallets": out["wallets"], "mismatched": out["mismatched"],
                           "mismatched_wallets": [f["wallet_id"] for f in out["findings"]]})
