"""Admission decision codes (ch. 18.11.1) and their HTTP status. One place for both."""
from __future__ import annotations

from aivedio.errors import DomainError

ACCEPTED = "ACCEPTED"
ACCEPTED_BEST_EFFORT = "ACCEPTED_BEST_EFFORT"

REJECT_STATUS = {
    "REJECT_USER_RATE_LIMIT": 429,
    "REJECT_TENANT_RATE_LIMIT": 429,
    "REJECT_CANCEL_RATE_LIMIT": 429,
    "REJECT_USER_QUEUE_FULL": 429,
    "REJECT_TENANT_QUEUE_FULL": 429,
    "REJECT_LANE_QUEUE_FULL": 429,
    "REJECT_EXPECTED_WAIT_TOO_LONG": 503,
    "REJECT_COST_BUDGET": 402,
    "REJECT_INSUFFICIENT_CREDIT": 402,
    "REJECT_RESOURCE_CLASS_DISABLED": 403,
    "REJECT_WALLET_FROZEN": 403,
    "REJECT_PLATFORM_OVERLOADED": 503,
    # Degraded modes (ch. 18.18, 20.12; aivedio.degraded): fail closed rather than admit unrecorded work.
    "REJECT_PRICING_UNAVAILABLE": 503,  # no price version readable, and no usable snapshot
    "REJECT_DATABASE_UNAVAILABLE": 503,  # PostgreSQL unreachable: no balance, no ledger, so nothing is admitted
}

DATABASE_RETRY_AFTER_SECONDS = 5


def database_unavailable() -> "Rejected":
    """The answer to any request while PostgreSQL cannot be reached (the API's gate and routes)."""
    return Rejected("REJECT_DATABASE_UNAVAILABLE", "the platform's database is unreachable: nothing was admitted "
                    "or changed; retry later", DATABASE_RETRY_AFTER_SECONDS)


class Rejected(DomainError):
    """An admission rejection. Raised inside the admission transaction, so nothing is written."""

    code = "REJECTED"

    def __init__(self, decision: str, message: str, retry_after_seconds: int | None = None):
        assert decision in REJECT_STATUS, decision
        super().__init__(message)
        self.decision = decision
        self.status = REJECT_STATUS[decision]
        self.retry_after_seconds = retry_after_seconds

    def body(self) -> dict:
        b = {"error": "REJECTED", "decision": self.decision, "message": self.message}
        if self.retry_after_seconds is not None:
            b["retry_after_seconds"] = int(self.retry_after_seconds)
        return b
