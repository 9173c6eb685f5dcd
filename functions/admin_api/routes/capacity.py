"""Capacities, admission switches, price versions and budgets (docs/admin-api.md). Thin over
aivedio.admin.capacity, aivedio.admin.prices, aivedio.pricing.price_book and aivedio.spend.budgets,
the same cores as `aivedio admin lane|pool|provider-account|switch|price|budget ...`.

Bodies take any JSON values for the figures: the core checks each (an integer, in range, borrowable
within capacity, a known lane, pool, provider, account or resource class) and names every bad
field in one 422, having written nothing. GET /admin/v1/lanes is routes/lanes.py's (lane_report)."""
from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any
from uuid import UUID

from aws_lambda_powertools.event_handler.api_gateway import Router
from aws_lambda_powertools.event_handler.openapi.params import Query
from pydantic import BaseModel, ConfigDict, Field

from aivedio.admin import capacity, prices
from aivedio.context import get_platform
from aivedio.errors import InvalidRequest
from aivedio.policy.capacity import overrides
from aivedio.pricing import price_book
from aivedio.spend import budgets
from functions.admin_api.access import operator_of, requires

router = Router()

_UNITS = {"type": "integer", "minimum": 0}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LanePatch(_Body):
    capacity_units: Any = Field(default=None, json_schema_extra=_UNITS)
    borrowable_units: Any = Field(default=None, json_schema_extra=_UNITS,
                                  description="at most capacity_units (the enterprise lane lends these to PAID_SHARED and STANDARD)")
    min_headroom_units: Any = Field(default=None, json_schema_extra=_UNITS)
    max_queue_units: Any = Field(default=None, json_schema_extra=_UNITS)
    reason: Any = Field(default=None, json_schema_extra={"type": "string"}, description="why; kept in the audit log")


class PoolPatch(_Body):
    capacity_units: Any = Field(default=None, json_schema_extra=_UNITS)
    reason: Any = Field(default=None, json_schema_extra={"type": "string"})


class AccountPatch(_Body):
    max_concurrency: Any = Field(default=None, json_schema_extra={"type": "integer", "minimum": 1})
    reason: Any = Field(default=None, json_schema_extra={"type": "string"})


class SwitchPut(_Body):
    lane: Any = Field(default=None, json_schema_extra={"type": "string"}, description="a lane, or")
    resource_class: Any = Field(default=None, json_schema_extra={"type": "string"}, description="a resource class")
    open: Any = Field(default=None, json_schema_extra={"type": "boolean"})
    reason: Any = Field(default=None, json_schema_extra={"type": "string"})


class PriceRules(_Body):
    models: dict[str, Any] = Field(default_factory=dict, description="model -> price fields; those left out keep the "
                                                                     "version this one follows")


class PricePost(_Body):
    product_code: str = price_book.PRODUCT_CODE
    effective_from: datetime | None = Field(default=None, description="default now; with its timezone")
    effective_to: datetime | None = None
    rules: PriceRules = Field(default_factory=PriceRules)
    reason: Any = Field(default=None, json_schema_extra={"type": "string"})


class BudgetPut(_Body):
    scope_type: str = Field(description=", ".join(budgets.SCOPES))
    scope_id: str
    period_start: datetime
    period_end: datetime
    limit_amount: Decimal
    currency: str
    tenant_id: UUID | None = None


def _op() -> str:
    return operator_of(router).audit_name


def _change(fn) -> dict:
    p = get_platform()
    return capacity.run_change(p, lambda conn: fn(p, conn))


# --- lanes --------------------------------------------------------------------------------------------

@router.patch("/admin/v1/lanes/<lane>", tags=["capacity"],
              summary="Change a lane's capacity, borrowing or queue limit (the pool is resized at once; running work is never cut)")
@requires("capacity.write")
def patch_lane(lane: str, body: LanePatch):
    return _change(lambda p, c: capacity.set_lane(c, p.config, operator=_op(), lane=lane, reason=body.reason,
                                                  capacity_units=body.capacity_units, borrowable_units=body.borrowable_units,
                                                  min_headroom_units=body.min_headroom_units,
                                                  max_queue_units=body.max_queue_units, now=p.clock.now()))


# --- pools --------------------------------------------------------------------------------------------

def _pools(key: str | None = None) -> list[dict]:
    p = get_platform()
    with p.db.connection() as conn:
        return capacity.pool_report(conn, p.config, overrides(p, conn), key)


@router.get("/admin/v1/pools", tags=["capacity"], summary="Resource pools: configured and effective capacity, use")
@requires("capacity.read")
def list_pools():
    return {"items": _pools()}


@router.get("/admin/v1/pools/<key>", tags=["capacity"], summary="One resource pool (e.g. worker:gpu)")
@requires("capacity.read")
def get_pool(key: str):
    return _pools(key)[0]


@router.patch("/admin/v1/pools/<key>", tags=["capacity"], summary="Change a resource pool's capacity")
@requires("capacity.write")
def patch_pool(key: str, body: PoolPatch):
    return _change(lambda p, c: capacity.set_pool(c, p.config, operator=_op(), key=key, capacity_units=body.capacity_units,
                                                  reason=body.reason, now=p.clock.now()))


# --- provider accounts --------------------------------------------------------------------------------

@router.get("/admin/v1/providers/<provider>/accounts", tags=["capacity"],
            summary="A provider's accounts: max_concurrency, what claims obey now, slots in use")
@requires("capacity.read")
def list_accounts(provider: str):
    p = get_platform()
    if p.config.provider(provider) is None:
        raise InvalidRequest("unknown provider", {"provider": "unknown provider; providers are "
                                                              + ", ".join(q.name for q in p.config.providers)})
    with p.db.connection() as conn:
        rows = capacity.provider_account_report(conn, p.config, overrides(p, conn))
    return {"items": [r for r in rows if r["provider"] == provider]}


@router.patch("/admin/v1/providers/<provider>/accounts/<account_id>", tags=["capacity"],
              summary="Change a provider account's max_concurrency (running jobs finish; new claims obey the new limit)")
@requires("capacity.write")
def patch_account(provider: str, account_id: str, body: AccountPatch):
    return _change(lambda p, c: capacity.set_provider_account(c, p.config, operator=_op(), provider=provider,
                                                              account_id=account_id, max_concurrency=body.max_concurrency,
                                                              reason=body.reason, now=p.clock.now()))


# --- switches -----------------------------------------------------------------------------------------

@router.get("/admin/v1/switches", tags=["switches"], summary="Admission switches of lanes and resource classes")
@requires("switch.read")
def list_switches():
    p = get_platform()
    return {"items": capacity.switch_report(p.config, overrides(p))}


@router.put("/admin/v1/switches", tags=["switches"],
            summary="Open or close admission to a lane or resource class (closed: 403 REJECT_RESOURCE_CLASS_DISABLED)")
@requires("switch.write")
def put_switch(body: SwitchPut):
    return _change(lambda p, c: capacity.set_switch(c, p.config, operator=_op(), open=body.open, reason=body.reason,
                                                    lane=body.lane, resource_class=body.resource_class, now=p.clock.now()))


# --- price versions -----------------------------------------------------------------------------------

@router.get("/admin/v1/prices", tags=["prices"], summary="Price versions, newest effective_from first")
@requires("price.read")
def list_prices(limit: Annotated[int, Query(ge=1, le=500)] = 50, cursor: Annotated[str | None, Query(max_length=512)] = None,
                product_code: Annotated[str | None, Query(max_length=100)] = None):
    with get_platform().db.connection() as conn:
        return price_book.list_price_versions(conn, product_code=product_code, limit=limit, cursor=cursor)


@router.post("/admin/v1/prices", tags=["prices"],
             summary="A new price version (immutable); one that overlaps another ACTIVE version is 422 on effective_from")
@requires("price.write")
def post_price(body: PricePost):
    def fn(p, c):
        return prices.create_price_version(c, p.config, operator=_op(), effective_from=body.effective_from,
                                               effective_to=body.effective_to, models=body.rules.models,
                                               reason=body.reason, now=p.clock.now(), product_code=body.product_code)

    return _change(fn), 201


# --- budgets ------------------------------------------------------------------------------------------

@router.get("/admin/v1/budgets", tags=["budgets"], summary="Provider spend budgets in force, usage and threshold level")
@requires("budget.read")
def list_budgets():
    p = get_platform()
    with p.db.connection() as conn:
        return {"items": budgets.status(conn, now=p.clock.now(), config=p.config.billing)}


@router.put("/admin/v1/budgets", tags=["budgets"], summary="Create or change a budget (scope, period, limit, currency)")
@requires("budget.manage")
def put_budget(body: BudgetPut):
    p = get_platform()
    row = p.db.transaction(lambda c: budgets.set_budget(
        c, operator=_op(), scope_type=body.scope_type, scope_id=body.scope_id, period_start=body.period_start,
        period_end=body.period_end, limit_amount=body.limit_amount, currency=body.currency, tenant_id=body.tenant_id))
    return {k: (str(v) if v is not None else None) for k, v in row.items()}
