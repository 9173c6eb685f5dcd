"""GET /admin/v1/lanes (docs/admin-api.md): per lane, capacity, borrowable, queued and running
units, oldest wait. Thin over aivedio.admin.capacity.lane_report (the capacity in force, operators'
overrides included)."""
from __future__ import annotations

from aws_lambda_powertools.event_handler.api_gateway import Router

from aivedio.admin.capacity import lane_report
from aivedio.context import get_platform
from functions.admin_api.access import requires

router = Router()


@router.get("/admin/v1/lanes", tags=["lanes"], summary="Per lane: capacity, borrowable, queued and running units, oldest wait")
@requires("lane.read")
def list_lanes() -> dict:
    return {"items": lane_report(get_platform())}
