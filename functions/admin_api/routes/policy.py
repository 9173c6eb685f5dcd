"""Tenant scheduling policies (docs/admin-api.md): show, change, history. Thin over
aivedio.policy.tenant_policy, the same core as `aivedio admin tenant policy show|set`."""
from __future__ import annotations

from typing import Annotated, Any

from aws_lambda_powertools.event_handler.api_gateway import Router
from aws_lambda_powertools.event_handler.openapi.params import Query
from pydantic import BaseModel, ConfigDict, Field

from aivedio.context import get_platform
from aivedio.policy import tenant_policy as policy
from functions.admin_api.access import operator_of, requires

router = Router()
PATH = "/admin/v1/tenants/<tenant_id>/policy"


class PolicyPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Any JSON values: the core checks each against policy.COLUMNS and the whole result, and names
    # each bad field in one 422 (a per-field pydantic type would split that into two answers).
    changes: dict[str, Any] = Field(
        description="column: new value; the whole resulting policy is validated",
        json_schema_extra={"properties": {c.name: c.schema() for c in policy.COLUMNS}, "additionalProperties": False,
                           "minProperties": 1})
    reason: str | None = Field(default=None, max_length=policy.MAX_REASON)


@router.get(PATH, tags=["policies"], summary="The tenant's scheduling policy in force, with its policy_version")
@requires("policy.read")
def get_policy(tenant_id: str):
    with get_platform().db.connection() as conn:
        return policy.show_policy(conn, tenant_id)


@router.patch(PATH, tags=["policies"], summary="Change columns of the policy; the whole result is validated and "
                                               "policy_version moves on")
@requires("policy.write")
def patch_policy(tenant_id: str, body: PolicyPatch):
    return policy.change_policy(get_platform(), operator=operator_of(router).audit_name, tenant_id=tenant_id,
                                changes=body.changes, reason=body.reason)


@router.get(PATH + "/history", tags=["policies"], summary="Every version of the tenant's policy, newest first")
@requires("policy.read")
def get_policy_history(tenant_id: str, limit: Annotated[int, Query(ge=1, le=500)] = 50,
                       cursor: Annotated[str | None, Query(max_length=512)] = None):
    with get_platform().db.connection() as conn:
        return policy.policy_history(conn, tenant_id, limit=limit, cursor=cursor)
