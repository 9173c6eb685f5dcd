"""Provider webhooks (docs/tenant-api.md, docs/provider-protocol.md). Public to the gate: the
signature, not a tenant key, authenticates them."""
from __future__ import annotations

from aws_lambda_powertools.event_handler import Response, content_types
from aws_lambda_powertools.event_handler.router import APIGatewayRouter

from aivedio.attempts.callbacks import receive
from aivedio.context import get_platform
from functions._edge.errors import register_status

router = APIGatewayRouter()
register_status(STALE_ATTEMPT=409, CALLBACK_REFUSED=409)


@router.post("/v1/providers/<provider>/callbacks", tags=["providers"], summary="Provider webhook (Standard Webhooks)",
             responses={200: {"description": "applied, or a repeated webhook-id acknowledged"},
                        202: {"description": "parked: no attempt knows the job yet; kept and applied once it is mapped"},
                        401: {"description": "bad signature or timestamp"}, 404: {"description": "unknown provider"},
                        409: {"description": "the job's attempt was replaced"},
                        422: {"description": "malformed body"}})
def provider_callback(provider: str):
    event = router.current_event
    result = receive(get_platform(), provider, dict(event.headers or {}), event.decoded_body or "")
    if result.status == "parked":
        return Response(status_code=202, content_type=content_types.APPLICATION_JSON, body=result.body())
    return result.body()
