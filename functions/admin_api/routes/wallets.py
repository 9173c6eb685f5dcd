"""A tenant's wallet partitioning (ch. 20.11.4; aivedio.billing.allowances): a hot wallet's credit
handed out as spend allowances per slot, so its users' admissions do not queue on one row. Thin over
the same core as `aivedio admin wallet partition|unpartition`; both are audited."""
from __future__ import annotations

from typing import Annotated
from uuid import UUID

from aws_lambda_powertools.event_handler.api_gateway import Router
from pydantic import BaseModel, ConfigDict, Field

from aivedio.billing import allowances
from aivedio.context import get_platform
from aivedio.errors import NotFound
from functions.admin_api.access import operator_of, requires

router = Router()
PATH = "/admin/v1/tenants/<tenant_id>/wallet"


class Partitioning(BaseModel):
    model_config = ConfigDict(extra="forbid")
    slots: Annotated[int, Field(ge=2, le=256, description="spend allowances the wallet is split into")] = allowances.DEFAULT_SLOTS
    chunk_amount: Annotated[int, Field(gt=0, description="credits a slot is refilled with at a time")]
    fast_max_units: Annotated[int, Field(gt=0, description="a task with more fairness units takes the merged path")] = \
        allowances.DEFAULT_FAST_MAX_UNITS
    reason: Annotated[str | None, Field(max_length=500)] = None


class Reason(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: Annotated[str | None, Field(max_length=500)] = None


def _tenant(raw: str) -> UUID:
    try:
        return UUID(raw)
    except ValueError:
        raise NotFound(f"no tenant {raw}") from None


@router.post(PATH + "/partition", tags=["billing"],
             summary="Partition the tenant's wallet into spend allowances per slot (or change its partitioning)")
@requires("contract_budget.manage")
def partition_wallet(tenant_id: str, body: Partitioning) -> dict:
    tid, actor = _tenant(tenant_id), operator_of(router).audit_name
    return get_platform().db.transaction(lambda conn: allowances.partition(
        conn, operator=actor, tenant_id=tid, slots=body.slots, chunk_amount=body.chunk_amount,
        fast_max_units=body.fast_max_units, reason=body.reason))


@router.post(PATH + "/unpartition", tags=["billing"],
             summary="Back to one wallet row: every allowance returned to it, the partitioning removed")
@requires("contract_budget.manage")
def unpartition_wallet(tenant_id: str, body: Reason) -> dict:
    tid, actor = _tenant(tenant_id), operator_of(router).audit_name
    return get_platform().db.transaction(lambda conn: allowances.unpartition(conn, operator=actor, tenant_id=tid,
                                                                             reason=body.reason))
