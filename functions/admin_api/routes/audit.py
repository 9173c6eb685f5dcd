"""The audit log (docs/admin-api.md `GET /admin/v1/audit`) and its chain's verification. Thin
over aivedio.audit."""
from __future__ import annotations

from typing import Annotated

from aws_lambda_powertools.event_handler.api_gateway import Router
from aws_lambda_powertools.event_handler.openapi.params import Query

from aivedio import audit
from aivedio.context import get_platform
from functions.admin_api.access import requires

router = Router()


@router.get("/admin/v1/audit", tags=["audit"], summary="The audit log, newest first")
@requires("audit.read")
def list_audit(
    limit: Annotated[int, Query(ge=1, le=audit.MAX_LIMIT)] = audit.DEFAULT_LIMIT,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> dict:
    with get_platform().db.connection() as conn:
        return audit.list_audit(conn, limit=limit, cursor=cursor)


@router.post("/admin/v1/audit/verify", tags=["audit"],
             summary="Recompute the audit chain; ok is false when a row was edited or deleted")
@requires("audit.verify")
def verify_audit() -> dict:
    with get_platform().db.connection() as conn:
        return audit.verify(conn)
