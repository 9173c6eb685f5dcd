"""GET /healthz: whether this process can reach its database and Redis, which degraded modes are
active (aivedio.degraded, probed by aivedio.health), the backlogs an operator watches, and how the local loops fare."""
from __future__ import annotations

from typing import Any, Literal

from aws_lambda_powertools.event_handler.router import APIGatewayRouter
from pydantic import BaseModel, Field

from aivedio import degraded, health
from aivedio.context import get_platform
from functions.api.routes.schemas import errors

router = APIGatewayRouter()


class DegradedModeView(BaseModel):
    reason: str  # what failed and what the platform does meanwhile
    since: str  # ISO 8601: when it began (as this process saw it, or as the facts date it)
    detail: dict[str, Any]


class Health(BaseModel):
    status: Literal["ok", "degraded"]  # degraded while any mode of `degraded` is active
    database: Literal["ok", "down"]
    redis: Literal["ok", "down", "disabled"]  # disabled: configured without Redis (conservative mode by choice)
    degraded: dict[str, DegradedModeView] = Field(
        description="active degraded modes by name: " + ", ".join(degraded.MODES))
    # None while the database cannot be asked.
    outbox_pending: int | None = None
    outbox_oldest_pending_seconds: float | None = None  # platform seconds
    outbox_dead_letters: int | None = None  # FAILED outbox events waiting for `aivedio admin outbox redrive`
    manual_review_open: int | None = None  # tasks in MANUAL_REVIEW, waiting for `aivedio admin review resolve`
    loops: dict[str, dict[str, Any]]


@router.get("/healthz", tags=["operations"], summary="Liveness, dependency health and degraded modes",
            responses={200: {"description": "health", "content": {"application/json": {"model": Health}}},
                       **errors(413, 422)})  # the gate's size limit applies here too; 422 replaces Powertools' own shape
def healthz() -> Health:
    platform = get_platform()
    h = health.evaluate(platform)
    return Health(status=h.status, database=h.database, redis=h.redis,
                  degraded={m.mode: DegradedModeView(reason=m.reason, since=m.since.isoformat(), detail=m.detail) for m in h.modes},
                  outbox_pending=h.outbox_pending, outbox_oldest_pending_seconds=h.outbox_oldest_pending_seconds,
                  outbox_dead_letters=h.outbox_dead_letters, manual_review_open=h.manual_review_open,
                  loops=dict(platform.extras.get("loop_status", {})))
