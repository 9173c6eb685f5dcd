"""Provider webhooks (contracts/tenant-api.md, provider-protocol.md). Public to the gate: the
signature, not a tenant key, authenticates them."""
from __future__ import annotations

from aws_lambda_powertools.event_handler.router import APIGatewayRouter

from aivedio.attempts.callbacks import receive
from aivedio.context import get_platform
from functions.api.errors import register_status

router = APIGatewayRouter()
register_status(STALE_ATTEMPT=409, UNMAPPED=409, CALLBACK_REFUSED=409)


@router.post("/v1/providers/<provider>/callbacks", tags=["providers"], summary="Provider webhook (Standard Webhooks)",
             responses={200: {"description": "applied, or a repeated webhook-id acknowledged"},
                        401: {"description": "bad signature or timestamp"}, 404: {"description": "unknown provider"},
                        409: {"description": "the job's attempt was replaced, or no attempt knows the job yet"},
                        422: {"description": "malformed body"}})
def provider_callback(provider: str) -> dict:
    event = router.current_event
    return receive(get_platform(), provider, dict(event.headers or {}), event.decoded_body or "").body()
