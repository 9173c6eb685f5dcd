"""Scheduled wallet consistency checks (ch. 20.8.5): every wallet's snapshot against its ledger,
reservations and credit lots (aivedio.billing.wallet_checks). A mismatch freezes the wallet's risky
operations, is recorded in wallet_discrepancy and logged as an alert; an operator repairs it with
`aivedio admin wallet rebuild`."""
from __future__ import annotations

from aivedio.billing import wallet_checks
from aivedio.context import get_platform
from aivedio.observability import logger


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    out = wallet_checks.check_all(get_platform())
    return {"wallets": out["wallets"], "mismatched": out["mismatched"],
            "mismatched_wallets": [f["wallet_id"] for f in out["findings"]]}
