"""Generations, quotes and cancel (docs/tenant-api.md). Thin: parse, call the core, shape."""
from __future__ import annotations

from typing import Annotated
from uuid import UUID

from aws_lambda_powertools.event_handler import Response, content_types
from aws_lambda_powertools.event_handler.openapi.params import Header, Query
from aws_lambda_powertools.event_handler.router import APIGatewayRouter

from aivedio import views
from aivedio.admission.cancel import cancel
from aivedio.admission.decisions import Rejected
from aivedio.admission.models import GenerationRequest
from aivedio.admission.service import admit, quote_only
from aivedio.context import get_platform
from aivedio.errors import InvalidRequest, NotFound
from functions._edge.errors import register_status
from functions.api.routes.auth import caller_of
from functions.api.routes.schemas import BEARER, Accepted, CancelResult, QuoteResponse, TaskList, TaskState, TaskView, responses

router = APIGatewayRouter()
register_status(IDEMPOTENCY_KEY_REUSED=422, IDEMPOTENCY_IN_PROGRESS=409, TASK_TERMINAL=409,
                INPUT_TOO_LARGE=422, INPUT_UNREACHABLE=422, INPUT_NOT_MEDIA=422, INPUT_TOO_LONG=422)


# 1 to 255 printable characters: a control character (NUL above all) has no business in a key, and
# PostgreSQL text cannot hold NUL.
IDEMPOTENCY_KEY_PATTERN = r"^[^\x00-\x1f\x7f]+$"


def rejected_response(r: Rejected) -> Response:
    headers = {"Retry-After": str(r.retry_after_seconds)} if r.retry_after_seconds is not None else None
    body = {**r.body(), "details": {}}  # the contract's error shape: details on every error body
    return Response(status_code=r.status, content_type=content_types.APPLICATION_JSON, body=body, headers=headers)


def _task_id(raw: str) -> UUID:
    try:
        return UUID(raw)
    except ValueError:
        raise NotFound("no such task") from None  # a malformed id reads like one that does not exist


@router.post("/v1/generations", tags=["generations"], summary="Submit a generation", status_code=202, security=BEARER,
             responses=responses(202, Accepted, "accepted (or the replay of the first answer to this Idempotency-Key)",
                                 402, 403, 409, 429, 503, body=True))
def create_generation(
    body: GenerationRequest,
    idempotency_key: Annotated[str, Header(alias="Idempotency-Key", min_length=1, max_length=255, pattern=IDEMPOTENCY_KEY_PATTERN,
                                           description="1 to 255 characters, no control characters")],
):
    platform = get_platform()
    try:
        result = admit(platform, caller_of(router), body, router.current_event.json_body, idempotency_key)
    except Rejected as r:
        return rejected_response(r)
    return Response(status_code=result.status, content_type=content_types.APPLICATION_JSON, body=result.body)


@router.post("/v1/quotes", tags=["generations"], summary="Quote a generation without reserving anything", security=BEARER,
             responses=responses(200, QuoteResponse, "quote", 429, body=True))
def create_quote(body: GenerationRequest):
    try:
        quote = quote_only(get_platform(), caller_of(router), body)
    except Rejected as r:  # the submit rate limits bind quotes too
        return rejected_response(r)
    return QuoteResponse(**quote)


@router.get("/v1/generations/<task_id>", tags=["generations"], summary="One task", security=BEARER,
            responses=responses(200, TaskView, "task", 404))
def get_generation(task_id: str) -> TaskView:
    platform = get_platform()
    with platform.db.connection() as conn:
        return TaskView(**views.get_task(conn, caller_of(router).tenant_id, _task_id(task_id), platform=platform))


@router.get("/v1/generations", tags=["generations"], summary="The tenant's tasks, newest first", security=BEARER,
            responses=responses(200, TaskList, "page"))
def list_generations(
    state: Annotated[TaskState | None, Query(description="only tasks in this state")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> TaskList:
    platform = get_platform()
    with platform.db.connection() as conn:
        return TaskList(**views.list_tasks(conn, caller_of(router).tenant_id, state=state, limit=limit, cursor=cursor))


@router.post("/v1/generations/<task_id>/cancel", tags=["generations"], summary="Cancel a task", status_code=202, security=BEARER,
             responses=responses(202, CancelResult, "cancel accepted", 404, 409, 429, body=True))
def cancel_generation(task_id: str):
    try:
        result = cancel(get_platform(), caller_of(router), _task_id(task_id))
    except Rejected as r:
        return rejected_response(r)
    return Response(status_code=202, content_type=content_types.APPLICATION_JSON, body=CancelResult(**result).model_dump())


__all__ = ["router", "InvalidRequest"]
