"""The tenant's wallet and its ledger (docs/tenant-api.md)."""
from __future__ import annotations

from typing import Annotated

from aws_lambda_powertools.event_handler.openapi.params import Query
from aws_lambda_powertools.event_handler.router import APIGatewayRouter

from aivedio import views
from aivedio.context import get_platform
from functions.api.routes.auth import caller_of
from functions.api.routes.schemas import BEARER, LedgerPage, WalletView, responses

router = APIGatewayRouter()


@router.get("/v1/wallet", tags=["wallet"], summary="Balances and credit lots", security=BEARER,
            responses=responses(200, WalletView, "wallet", 404))
def get_wallet() -> WalletView:
    platform = get_platform()
    with platform.db.connection() as conn:
        return WalletView(**views.wallet_view(conn, caller_of(router).tenant_id, platform.clock.now()))


@router.get("/v1/wallet/ledger", tags=["wallet"], summary="Ledger transactions with their entries, newest first", security=BEARER,
            responses=responses(200, LedgerPage, "page"))
def get_ledger(
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> LedgerPage:
    platform = get_platform()
    with platform.db.connection() as conn:
        return LedgerPage(**views.ledger_view(conn, caller_of(router).tenant_id, limit=limit, cursor=cursor))
