"""`aivedio reconcile ...` (contracts/operations.md): the reconciliations, run on demand. `wallets`
checks every wallet's snapshot against its ledger, reservations and lots (aivedio.billing.wallet_checks)."""
from __future__ import annotations


def register(sub) -> None:
    from aivedio.billing.cli import register_reconcile

    reconcile = sub.add_parser("reconcile", help="reconciliations, run on demand").add_subparsers(
        dest="reconcile_command", required=True)
    register_reconcile(reconcile)
