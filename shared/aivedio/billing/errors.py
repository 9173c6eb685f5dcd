"""Billing's domain errors. Each is raised inside the transaction it concerns, so the operation that
raised it writes nothing; only the edge (HTTP, CLI) turns the code into a status or an exit code."""
from __future__ import annotations

from aivedio.errors import Conflict, Forbidden, InvalidRequest, NotFound


class RefundExceedsSettled(Conflict):
    code = "REFUND_EXCEEDS_SETTLED"


class RefundTenantMismatch(Forbidden):
    """The task belongs to another tenant than the one the refund names."""

    code = "REFUND_TENANT_MISMATCH"


class TaskNotFound(NotFound):
    code = "TASK_NOT_FOUND"


class RefundDailyLimitExceeded(Conflict):
    """The operator's refunds of this UTC day, with this one, would pass
    BillingConfig.refund_daily_limit_per_operator. `details` has the day, used, amount and limit."""

    code = "REFUND_DAILY_LIMIT_EXCEEDED"


class CompensationInvalid(InvalidRequest):
    code = "COMPENSATION_INVALID"


class ApprovalRefused(Conflict):
    """Self-approval, a second approval by the same operator, or a case no longer pending."""

    code = "APPROVAL_REFUSED"


class WalletFrozen(Conflict):
    """A wallet check found a mismatch: risky operations wait for a rebuild."""

    code = "WALLET_FROZEN"


class CorrectionRefused(Conflict):
    code = "CORRECTION_REFUSED"


# The money controls' refusals that leave an audit row of their own (ch. 20.13.5), written by the
# edge (the admin API, the CLI) in a transaction of its own: the refused one wrote nothing.
AUDITED_REFUSALS = (RefundDailyLimitExceeded.code, ApprovalRefused.code)

__all__ = ["RefundExceedsSettled", "RefundTenantMismatch", "TaskNotFound", "RefundDailyLimitExceeded", "CompensationInvalid",
           "ApprovalRefused", "WalletFrozen", "CorrectionRefused", "InvalidRequest"]
