"""Answers no anchor gives (issue 16, part 5): a tenant's usage against its fair share, and why a
queued task waits. Thin over aivedio.admin.fair_share and aivedio.scheduling.why_waiting."""
from __future__ import annotations

from typing import Annotated, Any
from uuid import UUID

from aws_lambda_powertools.event_handler.api_gateway import Router
from aws_lambda_powertools.event_handler.openapi.params import Query
from pydantic import BaseModel

from aivedio.admin import fair_share
from aivedio.context import get_platform
from aivedio.errors import NotFound
from aivedio.scheduling import why_waiting
from functions.admin_api.access import requires

router = Router()


class LaneShare(BaseModel):
    lane: str
    delivered_units: int
    entitled_units: float
    share: float  # of the lane's delivered units
    weight_share: float  # of the weight backlogged in the lane
    ratio: float | None = None  # delivered / entitled; null when nothing was entitled
    claims: int
    weight: int
    backlogged: bool
    lane_delivered_units: int
    backlogged_tenants: int
    backlogged_weight: int


class FairShare(BaseModel):
    tenant_id: str
    window_seconds: int
    lanes: list[LaneShare]


class TaskWaiting(BaseModel):
    task_id: str
    tenant_id: str
    state: str
    queue_class: str
    binding_limit: str | None = None  # null once the task is no longer QUEUED
    detail: dict[str, Any] | None = None
    position: dict[str, Any] | None = None
    estimated_start_at: str | None = None
    estimated_start_seconds: int | None = None


def _uuid(raw: str, what: str) -> UUID:
    try:
        return UUID(raw)
    except ValueError:
        raise NotFound(f"no such {what}") from None  # a malformed id reads like one that does not exist


@router.get("/admin/v1/tenants/<tenant_id>/fair-share", tags=["insight"],
            summary="The tenant's delivered cost units over a trailing window against its weight's entitlement, per lane")
@requires("fair_share.read")
def get_fair_share(
    tenant_id: str,
    window_seconds: Annotated[int, Query(ge=1, le=fair_share.MAX_WINDOW_SECONDS, description="trailing window")] = 3600,
    lane: Annotated[str | None, Query(max_length=64, description="one lane only")] = None,
) -> FairShare:
    platform = get_platform()
    with platform.db.connection() as conn:
        return FairShare(**fair_share.tenant_fair_share(platform, conn, _uuid(tenant_id, "tenant"),
                                                        window_seconds=window_seconds, lane=lane))


@router.get("/admin/v1/tasks/<task_id>/waiting", tags=["insight"],
            summary="Why a queued task waits: the limit that binds now, its position and an estimated start")
@requires("tenant.read")
def get_task_waiting(task_id: str) -> TaskWaiting:
    platform = get_platform()
    with platform.db.connection() as conn:
        return TaskWaiting(**why_waiting.for_operator(platform, conn, _uuid(task_id, "task")))
