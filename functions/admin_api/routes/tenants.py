"""Tenants, their users and API keys (docs/admin-api.md). Thin over aivedio.admin.tenants,
users and api_keys; a secret (api_key) is in the answer that issues it and nowhere else. Another
tenant's key or user reads like one that does not exist (404)."""
from __future__ import annotations

from typing import Annotated
from uuid import UUID

from aws_lambda_powertools.event_handler import Response, content_types
from aws_lambda_powertools.event_handler.api_gateway import Router
from aws_lambda_powertools.event_handler.openapi.params import Query
from pydantic import BaseModel, ConfigDict, Field

from aivedio.admin import api_keys, tenants, users
from aivedio.config import SERVICE_CLASSES
from aivedio.context import get_platform
from aivedio.errors import NotFound
from functions._edge.errors import register_status
from functions.admin_api.access import operator_of, requires

router = Router()
register_status(TENANT_EXISTS=409)

MAX_LIMIT = 200


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(min_length=1, max_length=128)]
    service_class: Annotated[str, Field(description=f"one of {', '.join(SERVICE_CLASSES)}")]
    weight: Annotated[int, Field(ge=1, le=1000)]
    credits: Annotated[int, Field(ge=0, description="initial credits, granted as a lot")] = 0
    account_type: Annotated[str, Field(description=", ".join(tenants.ACCOUNT_TYPES))] = "PREPAID"
    policy: Annotated[dict[str, int | bool] | None, Field(description="scheduling policy columns over the class's defaults")] = None


class UserCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Annotated[str, Field(description=", ".join(users.USER_ROLES))] = "MEMBER"
    name: Annotated[str | None, Field(min_length=1, max_length=200)] = None


class ApiKeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: Annotated[UUID | None, Field(description="the tenant's user (default: its first OWNER)")] = None
    project: Annotated[str | None, Field(description="the project the key's work is budgeted to")] = None


def _id(raw: str, what: str) -> UUID:
    try:
        return UUID(raw)
    except ValueError:
        raise NotFound(f"no {what} {raw}") from None  # a malformed id reads like one that does not exist


def _created(doc: dict) -> Response:
    return Response(status_code=201, content_type=content_types.APPLICATION_JSON, body=doc)


@router.get("/admin/v1/tenants", tags=["tenants"], summary="Tenants with their class, weight and policy version")
@requires("tenant.read")
def list_tenants(
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> dict:
    with get_platform().db.connection() as conn:
        return tenants.list_tenants(conn, limit=limit, cursor=cursor)


@router.post("/admin/v1/tenants", tags=["tenants"],
             summary="Create a tenant, its first user, wallet and API key (shown once)")
@requires("tenant.manage")
def create_tenant(body: TenantCreate):
    created = tenants.create_tenant(get_platform(), name=body.name, service_class=body.service_class, weight=body.weight,
                                    credits=body.credits, account_type=body.account_type,
                                    operator=operator_of(router).audit_name, policy_overrides=body.policy)
    return _created(created.as_dict())


@router.post("/admin/v1/tenants/<tenant_id>/users", tags=["tenants"],
             summary="Another user of a tenant, with its own API key (shown once)")
@requires("tenant.manage")
def create_user(tenant_id: str, body: UserCreate):
    tid, actor = _id(tenant_id, "tenant"), operator_of(router).audit_name
    created = get_platform().db.transaction(
        lambda conn: users.create_user(conn, operator=actor, tenant_id=tid, role=body.role, name=body.name))
    return _created(created.as_dict())


@router.post("/admin/v1/tenants/<tenant_id>/api-keys", tags=["api-keys"],
             summary="A new API key of one of the tenant's users (shown once)")
@requires("tenant.manage")
def create_api_key(tenant_id: str, body: ApiKeyCreate):
    tid, actor = _id(tenant_id, "tenant"), operator_of(router).audit_name
    created = get_platform().db.transaction(lambda conn: api_keys.create_api_key(
        conn, operator=actor, tenant_id=tid, project=body.project, user_id=body.user_id))
    return _created(created.as_dict())


@router.get("/admin/v1/tenants/<tenant_id>/api-keys", tags=["api-keys"],
            summary="A tenant's API keys by prefix (never a secret or its hash)")
@requires("tenant.read")
def list_api_keys(
    tenant_id: str,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> dict:
    tid = _id(tenant_id, "tenant")
    with get_platform().db.connection() as conn:
        return api_keys.list_api_keys(conn, tenant_id=tid, limit=limit, cursor=cursor)


@router.post("/admin/v1/api-keys/<key_id>/rotate", tags=["api-keys"],
             summary="A new key for the same user and project (shown once); the old one stops working")
@requires("tenant.manage")
def rotate_api_key(key_id: str, tenant_id: Annotated[UUID | None, Query(description="the key's tenant, checked")] = None):
    kid, actor, p = _id(key_id, "API key"), operator_of(router).audit_name, get_platform()
    created = p.db.transaction(lambda conn: api_keys.rotate_api_key(conn, operator=actor, key_id=kid, now=p.clock.now(),
                                                                     tenant_id=tenant_id))
    return _created(created.as_dict())


@router.delete("/admin/v1/api-keys/<key_id>", tags=["api-keys"],
               summary="Revoke an API key: refused by the tenant API from the next request on")
@requires("tenant.manage")
def revoke_api_key(key_id: str, tenant_id: Annotated[UUID | None, Query(description="the key's tenant, checked")] = None) -> dict:
    kid, actor, p = _id(key_id, "API key"), operator_of(router).audit_name, get_platform()
    return p.db.transaction(lambda conn: api_keys.revoke_api_key(conn, operator=actor, key_id=kid, now=p.clock.now(),
                                                                  tenant_id=tenant_id))
