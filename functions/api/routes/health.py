"""GET /healthz: whether this process can reach its database and Redis, and how the local loops fare."""
from __future__ import annotations

from typing import Any, Literal

from aws_lambda_powertools.event_handler.router import APIGatewayRouter
from pydantic import BaseModel

from aivedio.context import get_platform
from functions.api.routes.schemas import errors

router = APIGatewayRouter()

# Short, so a dead dependency makes the probe answer "down" instead of hanging.
PROBE_TIMEOUT_SECONDS = 2.0


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    database: Literal["ok", "down"]
    redis: Literal["ok", "down", "disabled"]
    loops: dict[str, dict[str, Any]]


@router.get("/healthz", tags=["operations"], summary="Liveness and dependency health",
            responses={200: {"description": "health", "content": {"application/json": {"model": Health}}},
                       **errors(413, 422)})  # the gate's size limit applies here too; 422 replaces Powertools' own shape
def healthz() -> Health:
    platform = get_platform()
    database = "ok" if platform.db.healthy(timeout=PROBE_TIMEOUT_SECONDS) else "down"
    if platform.cache is None:
        redis = "disabled"  # conservative mode: running without Redis is a configured state, not a fault
    else:
        redis = "ok" if platform.cache.healthy() else "down"
    status = "ok" if database == "ok" and redis != "down" else "degraded"
    return Health(status=status, database=database, redis=redis, loops=dict(platform.extras.get("loop_status", {})))
