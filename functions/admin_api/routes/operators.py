"""Operators of the admin API and their tokens (docs/admin-api.md): admin only. Thin over
aivedio.admin.operators; a token is in the answer of create and rotate, and nowhere else."""
from __future__ import annotations

from typing import Annotated
from uuid import UUID

from aws_lambda_powertools.event_handler import Response, content_types
from aws_lambda_powertools.event_handler.api_gateway import Router
from pydantic import BaseModel, ConfigDict, Field

from aivedio.admin import operators
from aivedio.context import get_platform
from aivedio.errors import NotFound
from functions.admin_api.access import operator_of, requires

router = Router()


class OperatorCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(description=f"1 to {operators.NAME_MAX} characters, unique")]
    role: Annotated[str, Field(description="viewer, operator, finance or admin")]


def _operator_id(raw: str) -> UUID:
    try:
        return UUID(raw)
    except ValueError:
        raise NotFound(f"no operator {raw}") from None  # a malformed id reads like one that does not exist


@router.post("/admin/v1/operators", tags=["operators"], summary="Create an operator and its token (shown once)")
@requires("operator.manage")
def create_operator(body: OperatorCreate):
    actor = operator_of(router).audit_name
    issued = get_platform().db.transaction(
        lambda conn: operators.create_operator(conn, actor=actor, name=body.name, role=body.role))
    return Response(status_code=201, content_type=content_types.APPLICATION_JSON, body=issued.as_dict())


@router.post("/admin/v1/operators/<operator_id>/rotate", tags=["operators"],
             summary="A new token for an operator (shown once); the old one stops working")
@requires("operator.manage")
def rotate_operator(operator_id: str) -> dict:
    actor, oid = operator_of(router).audit_name, _operator_id(operator_id)
    return get_platform().db.transaction(
        lambda conn: operators.rotate_operator_token(conn, actor=actor, operator_id=oid)).as_dict()


@router.delete("/admin/v1/operators/<operator_id>", tags=["operators"], summary="Revoke an operator and its token")
@requires("operator.manage")
def revoke_operator(operator_id: str) -> dict:
    actor, oid = operator_of(router).audit_name, _operator_id(operator_id)
    return get_platform().db.transaction(lambda conn: operators.revoke_operator(conn, actor=actor, operator_id=oid))


@router.get("/admin/v1/operators", tags=["operators"], summary="Operators, roles and token prefixes (never a token)")
@requires("operator.manage")
def list_operators() -> dict:
    with get_platform().db.connection() as conn:
        return {"items": operators.list_operators(conn), "next_cursor": None}
