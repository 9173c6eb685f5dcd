"""Operations over the same cores as the CLI (docs/admin-api.md): MANUAL_REVIEW tasks and their
resolution (aivedio.attempts.review), outbox dead letters and their redrive
(aivedio.admin.dead_letters), refunds and compensation with their approvals (aivedio.billing). The
gate checked the token's role against each route's permission; each core writes its audit rows in
its transaction, as the operator's audit name. A refusal by a money control (the daily refund
limit, an approval refused) is audited in a transaction of its own, as the CLI does: the refused
one wrote nothing."""
from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any
from uuid import UUID

from aws_lambda_powertools.event_handler import Response, content_types
from aws_lambda_powertools.event_handler.api_gateway import Router
from aws_lambda_powertools.event_handler.openapi.params import Query
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from aivedio import audit, outbox
from aivedio.admin import dead_letters
from aivedio.attempts import review
from aivedio.billing import compensation, refunds
from aivedio.billing.errors import AUDITED_REFUSALS
from aivedio.context import get_platform
from aivedio.errors import DomainError, NotFound
from functions._edge.errors import register_status
from functions.admin_api.access import operator_of, requires

router = Router()
register_status(
    REVIEW_REFUSED=409, TASK_NOT_IN_REVIEW=409, JOB_ALREADY_MAPPED=409, JOB_OF_ANOTHER_ATTEMPT=409,
    JOB_MISMATCH=409, PROVIDER_UNKNOWN=409, PROVIDER_UNAVAILABLE=503, JOB_NOT_FOUND=409, JOB_EXISTS=409,
    JOB_ID_KNOWN=409, ABSENCE_NOT_PROVEN=409,
    REFUND_EXCEEDS_SETTLED=409, REFUND_TENANT_MISMATCH=404, TASK_NOT_FOUND=404, REFUND_DAILY_LIMIT_EXCEEDED=409,
    COMPENSATION_INVALID=422, APPROVAL_REFUSED=409, CURRENCY_MISMATCH=409, WALLET_FROZEN=409, REFUND_KEY_REUSED=409,
    REFUND_NOT_FOUND=404, COMPENSATION_CASE_EXISTS=409)

def _id(raw: str, what: str) -> UUID:
    try:
        return UUID(raw)
    except ValueError:
        raise NotFound(f"no {what} {raw}") from None  # a malformed id reads like one that does not exist


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, (UUID, datetime)):
        return str(v) if isinstance(v, UUID) else v.isoformat()
    return v


def _money(action: str, target: str, tenant_id: UUID | None, amount: int | None, fn: Callable[[Any], dict]) -> dict:
    """fn(conn) in one transaction; a money control's refusal is audited as `<action>.refused`."""
    platform, actor = get_platform(), operator_of(router).audit_name
    try:
        return _plain(platform.db.transaction(fn))
    except DomainError as e:
        if e.code in AUDITED_REFUSALS:
            platform.db.transaction(lambda c: audit.append(
                c, operator=actor, action=f"{action}.refused", target=target, tenant_id=tenant_id,
                new={"error": e.code, "amount": amount, "details": e.details}, reason=e.message))
        raise


# --- MANUAL_REVIEW ---------------------------------------------------------------------------------------

class ReviewResolve(BaseModel):
    model_config = ConfigDict(extra="forbid")
    action: Annotated[str, Field(description=", ".join(review.ACTIONS))]
    reason: Annotated[str, Field(min_length=1, max_length=2000, description="why, for the audit log")]
    provider_job_id: Annotated[str | None, Field(max_length=256, description="adopt: the provider's job id")] = None
    confirm_absent: Annotated[bool, Field(description="requeue: no job exists, where no lookup can prove it")] = False
    tenant_id: UUID | None = None


@router.get("/admin/v1/reviews", tags=["operations"], summary="Tasks in MANUAL_REVIEW, oldest first")
@requires("review.read")
def list_reviews(
    tenant_id: Annotated[UUID | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict:
    actor = operator_of(router).audit_name
    with get_platform().db.connection() as conn:
        return _plain(review.list_reviews(conn, operator=actor, tenant_id=tenant_id, limit=limit))


@router.get("/admin/v1/reviews/<task_id>", tags=["operations"],
            summary="One task's review: reason, attempts, what it holds, what the provider said, its audit")
@requires("review.read")
def show_review(task_id: str, tenant_id: Annotated[UUID | None, Query()] = None) -> dict:
    tid, actor = _id(task_id, "task"), operator_of(router).audit_name
    with get_platform().db.connection() as conn:
        return _plain(review.show(conn, operator=actor, task_id=tid, tenant_id=tenant_id))


@router.post("/admin/v1/reviews/<task_id>/resolve", tags=["operations"],
             summary="Adopt the provider's job, requeue (absence proven or confirmed), or fail the task")
@requires("review.resolve")
def resolve_review(task_id: str, body: ReviewResolve) -> dict:
    tid, actor = _id(task_id, "task"), operator_of(router).audit_name
    return _plain(review.resolve(get_platform(), operator=actor, task_id=tid, action=body.action, reason=body.reason,
                                 provider_job_id=body.provider_job_id, confirm_absent=body.confirm_absent,
                                 tenant_id=body.tenant_id))


# --- the outbox's dead letters ---------------------------------------------------------------------------

class OutboxRedrive(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: Annotated[str, Field(min_length=1, max_length=2000)]
    event_ids: Annotated[list[UUID] | None, Field(max_length=dead_letters.MAX_LIST)] = None
    all_failed: bool = False
    event_type: str | None = None


@router.get("/admin/v1/outbox", tags=["operations"], summary="Outbox events of one status (FAILED: the dead letters)")
@requires("outbox.read")
def list_outbox(
    status: Annotated[str, Query(description="PENDING, PUBLISHED or FAILED")] = outbox.FAILED,
    event_type: Annotated[str | None, Query(max_length=128)] = None,
    tenant_id: Annotated[UUID | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=dead_letters.MAX_LIST)] = 100,
) -> dict:
    actor = operator_of(router).audit_name
    with get_platform().db.connection() as conn:
        return _plain(dead_letters.list_outbox(conn, operator=actor, status=status, event_type=event_type,
                                               tenant_id=tenant_id, limit=limit))


@router.post("/admin/v1/outbox/redrive", tags=["operations"],
             summary="FAILED outbox events back to PENDING (named ones, or all_failed), audited with the reason")
@requires("outbox.redrive")
def redrive_outbox(body: OutboxRedrive) -> dict:
    actor = operator_of(router).audit_name
    return get_platform().db.transaction(lambda conn: dead_letters.redrive_outbox(
        conn, operator=actor, reason=body.reason, event_ids=body.event_ids, all_failed=body.all_failed,
        event_type=body.event_type))


# --- refunds ---------------------------------------------------------------------------------------------

class RefundCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant_id: UUID
    task_id: UUID
    amount: Annotated[int, Field(gt=0, description="credit units of the task's settled charge")]
    reason: Annotated[str, Field(min_length=1, max_length=2000)]
    request_key: Annotated[str, Field(min_length=1, max_length=255, description="idempotency: one key never refunds twice")]


class Rejection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: Annotated[str, Field(min_length=1, max_length=2000)]


@router.get("/admin/v1/tenants/<tenant_id>/refunds", tags=["billing"], summary="A tenant's refund requests")
@requires("wallet.check")
def list_refunds(tenant_id: str, task_id: Annotated[UUID | None, Query()] = None) -> dict:
    tid = _id(tenant_id, "tenant")
    with get_platform().db.connection() as conn:
        return {"items": _plain([dict(r) for r in refunds.list_refunds(conn, tenant_id=tid, task_id=task_id)])}


@router.post("/admin/v1/refunds", tags=["billing"],
             summary="Refund part or all of a task's settled charge (above the threshold: awaits a second approval)")
@requires("refund.create")
def create_refund(body: RefundCreate):
    p, actor = get_platform(), operator_of(router).audit_name
    doc = _money("refund.request", f"task:{body.task_id}", body.tenant_id, body.amount, lambda conn: refunds.request_refund(
        conn, operator=actor, tenant_id=body.tenant_id, task_id=body.task_id, amount=body.amount, reason=body.reason,
        request_key=body.request_key, now=p.clock.now(), dual_approval_above=p.config.billing.refund_dual_approval_above,
        daily_limit=p.config.billing.refund_daily_limit_per_operator))
    return Response(status_code=200 if doc.get("replayed") else 201, content_type=content_types.APPLICATION_JSON, body=doc)


@router.post("/admin/v1/refunds/<refund_id>/approve", tags=["billing"],
             summary="A second operator approves a refund awaiting approval")
@requires("refund.approve")
def approve_refund(refund_id: str) -> dict:
    rid, p, actor = _id(refund_id, "refund"), get_platform(), operator_of(router).audit_name
    return _money("refund.approve", f"refund:{rid}", None, None, lambda conn: refunds.approve_refund(
        conn, operator=actor, refund_id=rid, now=p.clock.now(), daily_limit=p.config.billing.refund_daily_limit_per_operator))


@router.post("/admin/v1/refunds/<refund_id>/reject", tags=["billing"],
             summary="Turn down a refund awaiting approval (no money moves)")
@requires("refund.reject")
def reject_refund(refund_id: str, body: Rejection) -> dict:
    rid, p, actor = _id(refund_id, "refund"), get_platform(), operator_of(router).audit_name
    return _plain(p.db.transaction(lambda conn: refunds.reject_refund(conn, operator=actor, refund_id=rid,
                                                                      reason=body.reason, now=p.clock.now())))


# --- compensation ----------------------------------------------------------------------------------------

class CompensationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant_id: UUID
    case_id: Annotated[str, Field(min_length=1, max_length=compensation.MAX_CASE_ID)]
    amount: Annotated[int, Field(gt=0)]
    reason_code: Annotated[str, Field(description=", ".join(compensation.REASON_CODES))]
    evidence: Annotated[dict[str, Any], Field(description="ticket links, incident ids...")]
    expires_at: AwareDatetime | None = None
    task_id: UUID | None = None


@router.post("/admin/v1/compensations", tags=["billing"],
             summary="Open a compensation case (applied at once at or below the threshold, else awaits approval)")
@requires("compensation.request")
def request_compensation(body: CompensationRequest):
    p, actor = get_platform(), operator_of(router).audit_name
    doc = _money("compensation.request", f"compensation:{body.case_id}", body.tenant_id, body.amount,
                 lambda conn: compensation.request_compensation(
                     conn, operator=actor, tenant_id=body.tenant_id, case_id=body.case_id, amount=body.amount,
                     reason_code=body.reason_code, evidence=body.evidence, now=p.clock.now(), expires_at=body.expires_at,
                     task_id=body.task_id, dual_approval_above=p.config.billing.compensation_dual_approval_above))
    return Response(status_code=200 if doc.get("replayed") else 201, content_type=content_types.APPLICATION_JSON, body=doc)


@router.post("/admin/v1/tenants/<tenant_id>/compensations/<case_id>/approve", tags=["billing"],
             summary="Approve a compensation case (not its requester; a second approver above the threshold)")
@requires("compensation.approve")
def approve_compensation(tenant_id: str, case_id: str) -> dict:
    tid, p, actor = _id(tenant_id, "tenant"), get_platform(), operator_of(router).audit_name
    return _money("compensation.approve", f"compensation:{case_id}", tid, None, lambda conn: compensation.approve_compensation(
        conn, operator=actor, tenant_id=tid, case_id=case_id, now=p.clock.now()))


@router.post("/admin/v1/tenants/<tenant_id>/compensations/<case_id>/reject", tags=["billing"],
             summary="Turn down a compensation case awaiting approval")
@requires("compensation.reject")
def reject_compensation(tenant_id: str, case_id: str, body: Rejection) -> dict:
    tid, p, actor = _id(tenant_id, "tenant"), get_platform(), operator_of(router).audit_name
    return _plain(p.db.transaction(lambda conn: compensation.reject_compensation(
        conn, operator=actor, tenant_id=tid, case_id=case_id, reason=body.reason, now=p.clock.now())))
