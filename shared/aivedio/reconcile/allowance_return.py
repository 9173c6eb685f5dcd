"""Room service `allowance-return` (ch. 20.11.4 "再定期归并"): gives every spend allowance of a
partitioned wallet back to the wallet, on a schedule (aivedio.billing.allowances, migration 0195).

An allowance is credit the wallet reserved for one admission slot. Left where it is, it would keep
the wallet's credit split: spendable through one slot, shown as reserved, and, in a lot that
expires, kept from the expiry sweep (which expires a lot's available part only). Each run returns
every allowance of up to `batch_size` wallets per batch, a wallet per transaction: the allowance
rows locked first, then the wallet (the lock order of refills and wallet checks), one RELEASE
(reason ALLOWANCE_RETURN) to the very lots, the rows deleted. Admissions refill their slots again
from the wallet when they next need credit. A wallet whose partitioning was removed is returned
too. Nothing but allowance moves: reservations of admitted tasks are settlement's."""
from __future__ import annotations

from aivedio.billing import allowances
from aivedio.observability import logger
from aivedio.reconcile.room import Defaults, Report, in_batches, tuning

NAME = "allowance-return"
# Every minute, 200 wallets per transaction batch, at most 50 batches per run.
DEFAULTS = Defaults(interval_seconds=60.0, batch_size=200, max_batches=50)

# Wallets holding allowance rows, after the cursor (rows are deleted once returned).
DUE = """
select distinct wallet_id from wallet_allowance where wallet_id > %(after)s order by wallet_id limit %(limit)s
"""
NIL = "00000000-0000-0000-0000-000000000000"


def run_once(platform) -> Report:
    t = tuning(platform, NAME)
    report = Report(NAME)
    cursor = {"after": NIL}

    def batch(limit: int) -> tuple[int, int]:
        ids = [r["wallet_id"] for r in platform.db.fetchall(DUE, {"after": cursor["after"], "limit": limit})]
        repaired = 0
        for wallet_id in ids:
            amount = platform.db.transaction(lambda conn, w=wallet_id: allowances.return_all(conn, w))
            report.count("credits_returned", amount)
            repaired += 1
        if ids:
            cursor["after"] = ids[-1]
        return len(ids), repaired

    in_batches(report, t, batch)
    if report.repaired:
        logger.info("allowances returned", extra={"wallets": report.repaired, "credits": report.details.get("credits_returned", 0)})
    return report
