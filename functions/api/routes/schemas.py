"""Response models of the tenant API, so /openapi.json documents every answer it can give.

`responses(...)` builds a route's `responses={...}`: its success answer, and every error status it
can give, each with the model of its body. The gate in front of every route can answer 401, 413
and 422 (and 415 on a request with a body), so every tenant route documents those."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from aivedio.tasks import STATES

TaskState = Literal[STATES]  # type: ignore[valid-type]  # the contract's task states, one list for all


class ErrorBody(BaseModel):
    """Every error: {"error": CODE, "message": "...", "details": {...}}."""

    model_config = ConfigDict(extra="allow")

    error: str
    message: str
    details: dict[str, Any]


class FieldError(BaseModel):
    field: str
    type: str | None = None
    message: str


class ValidationDetails(BaseModel):
    model_config = ConfigDict(extra="allow")

    fields: dict[str, str]  # path ("body.duration_seconds", "query.limit", "header.Idempotency-Key") -> message
    errors: list[FieldError]


class ValidationErrorBody(BaseModel):
    """422: VALIDATION_ERROR, IDEMPOTENCY_KEY_REUSED, INPUT_NOT_MEDIA and the like, each naming its fields."""

    model_config = ConfigDict(extra="allow")

    error: str
    message: str
    details: ValidationDetails


class RejectedBody(BaseModel):
    """An admission (or cancel-rate) rejection; Retry-After repeats retry_after_seconds when it is set."""

    model_config = ConfigDict(extra="allow")

    error: Literal["REJECTED"]
    decision: str
    message: str
    retry_after_seconds: int | None = None
    details: dict[str, Any]


class QuoteBody(BaseModel):
    price_version_id: str
    quoted_amount: int
    max_reserve_amount: int
    unit: str


class QuoteResponse(QuoteBody):
    charge_policy_code: str
    queue_class: str
    resource_class: str
    fairness_units: int
    estimate_version: int


class Accepted(BaseModel):
    task_id: str
    state: Literal["QUEUED"]
    decision: Literal["ACCEPTED", "ACCEPTED_BEST_EFFORT"]
    queue_class: str
    estimated_start_at: str
    queue_position_level: Literal["LOW", "MEDIUM", "HIGH"]
    quote: QuoteBody


class AttemptView(BaseModel):
    attempt_no: int
    provider: str
    state: str


class ChargeView(BaseModel):
    quoted_amount: int
    reserved_amount: int | None = None
    final_charge_amount: int | None = None


class OutputView(BaseModel):
    asset_type: str
    url: str | None = None


class TaskError(BaseModel):
    code: str
    message: str


class TaskSummary(BaseModel):
    task_id: str
    state: TaskState
    queue_class: str
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    model: str
    mode: str
    duration_seconds: int
    resolution: str
    error: TaskError | None = None


class WaitingPosition(BaseModel):
    rank_in_tenant_lane: int  # 1: the tenant's next task in its lane
    tenant_tasks_ahead: int
    tenant_queued_tasks: int
    level: Literal["LOW", "MEDIUM", "HIGH"]


class Waiting(BaseModel):
    """Why a QUEUED task waits (aivedio.scheduling.why_waiting), for the tenant's own tasks only."""

    binding_limit: str  # USER_RUNNING_TASKS, TENANT_RUNNING_UNITS, LANE_CAPACITY, PROVIDER_SLOTS, BUDGET, NOT_YET_ELIGIBLE, FAIR_SHARE_TURN, ...
    detail: dict[str, Any]
    position: WaitingPosition
    estimated_start_at: str | None = None
    estimated_start_seconds: int | None = None


class TaskView(TaskSummary):
    attempts: list[AttemptView]
    charge: ChargeView | None = None
    outputs: list[OutputView]
    waiting: Waiting | None = None  # only while QUEUED


class TaskList(BaseModel):
    items: list[TaskSummary]
    next_cursor: str | None = None


class CancelResult(BaseModel):
    task_id: str
    state: Literal["CANCELLED", "CANCEL_REQUESTED"]


class LotView(BaseModel):
    lot_id: str
    kind: str
    remaining_amount: int
    reserved_amount: int
    expires_at: str | None = None
    expired: bool


class WalletView(BaseModel):
    wallet_id: str
    account_type: str
    unit: str
    available_amount: int
    reserved_amount: int
    consumed_amount: int
    credit_limit_amount: int
    frozen: bool
    lots: list[LotView]


class LedgerEntryView(BaseModel):
    bucket: str
    amount_delta: int
    unit: str
    lot_id: str | None = None


class LedgerTxnView(BaseModel):
    ledger_txn_id: str
    business_key: str
    event_type: str
    task_id: str | None = None
    reason_code: str | None = None
    reversal_of: str | None = None
    created_at: str
    entries: list[LedgerEntryView]


class LedgerPage(BaseModel):
    items: list[LedgerTxnView]
    next_cursor: str | None = None


ERROR_MODELS: dict[int, type[BaseModel]] = {422: ValidationErrorBody, 402: RejectedBody, 403: RejectedBody,
                                            429: RejectedBody, 503: RejectedBody}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait; present when the body has retry_after_seconds",
                               "schema": {"type": "integer", "minimum": 0}}}
# What the gate can answer on any tenant route (503: PostgreSQL unreachable, REJECT_DATABASE_UNAVAILABLE);
# 415 too when a body is sent.
GATE_ERRORS = (401, 413, 422, 503)
BEARER = [{"bearerAuth": []}]


def errors(*codes: int) -> dict[int, dict]:
    """OpenAPI `responses` entries for error statuses."""
    out: dict[int, dict] = {}
    for c in codes:
        entry: dict[str, Any] = {"description": "error", "content": {"application/json": {"model": ERROR_MODELS.get(c, ErrorBody)}}}
        if ERROR_MODELS.get(c) is RejectedBody:
            entry["description"] = "rejected"
            entry["headers"] = RETRY_AFTER
        out[c] = entry
    return out


def responses(status: int, model: type[BaseModel], description: str, *codes: int, body: bool = False) -> dict[int, dict]:
    """A tenant route's responses: `status` with `model`, the gate's errors, and the route's own `codes`."""
    gate = (*GATE_ERRORS, 415) if body else GATE_ERRORS
    return {status: {"description": description, "content": {"application/json": {"model": model}}},
            **errors(*sorted({*gate, *codes}))}
