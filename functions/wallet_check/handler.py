"""Scheduled wallet consistency checks (ch. 20.8.5), room service `wallet-check`
(aivedio.reconcile.room): every wallet's snapshot against its ledger, reservations and credit lots.
A mismatch freezes the wallet's risky operations, is recorded in wallet_discrepancy and logged as an
alert; an operator repairs it with `aivedio admin wallet rebuild`."""
from __future__ import annotations

from aivedio.context import get_platform
from aivedio.observability import logger
from aivedio.reconcile import room


@logger.inject_lambda_context(clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    return room.run(get_platform(), "wallet-check").as_dict()
