"""What API Gateway (and the WAF in front of it) answers on its own, before or instead of the
handler, in the API's error shape {error, message, details} (docs/tenant-api.md) rather than its
own {"message": ...}. One table read by both runtimes: the CDK app turns it into the APIs'
GatewayResponses and the WAF's custom responses, and the local server (aivedio_tools.local) answers
its stand-ins for API Gateway's own refusals from it, so local and AWS give the same bodies."""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayError:
    status: int | None  # None: keep the status API Gateway chose (DEFAULT_4XX/5XX cover several)
    code: str
    message: str
    retry_after_seconds: int | None = None  # sent as Retry-After


# API Gateway response type -> the answer. A type absent here falls to DEFAULT_4XX or DEFAULT_5XX.
GATEWAY_ERRORS: dict[str, GatewayError] = {
    "THROTTLED": GatewayError(429, "THROTTLED", "too many requests for the API as a whole; retry shortly", 1),
    "QUOTA_EXCEEDED": GatewayError(429, "QUOTA_EXCEEDED", "the API's daily request quota is spent; retry tomorrow", 3600),
    "REQUEST_TOO_LARGE": GatewayError(413, "PAYLOAD_TOO_LARGE", "the request is larger than the API accepts"),
    "WAF_FILTERED": GatewayError(403, "FORBIDDEN", "the request was refused by the API's firewall"),
    "INTEGRATION_TIMEOUT": GatewayError(504, "GATEWAY_TIMEOUT", "the request took too long; its effect, if any, "
                                                               "is found by retrying with the same Idempotency-Key"),
    "INTEGRATION_FAILURE": GatewayError(502, "INTERNAL", "internal error"),
    "UNSUPPORTED_MEDIA_TYPE": GatewayError(415, "UNSUPPORTED_MEDIA_TYPE", "send application/json"),
    "MISSING_AUTHENTICATION_TOKEN": GatewayError(404, "NOT_FOUND", "no such route"),
    "RESOURCE_NOT_FOUND": GatewayError(404, "NOT_FOUND", "no such route"),
    "BAD_REQUEST_PARAMETERS": GatewayError(400, "BAD_REQUEST", "the request's parameters are invalid"),
    "BAD_REQUEST_BODY": GatewayError(400, "BAD_REQUEST", "the request's body is invalid"),
    "DEFAULT_4XX": GatewayError(None, "BAD_REQUEST", "the request was refused before it reached the API"),
    "DEFAULT_5XX": GatewayError(None, "INTERNAL", "internal error"),
}

# The WAF rules whose block answers in this shape too (WAF custom responses, not a gateway response
# type): the body-size rule with the handler's own 413, the per-address rate with a 429.
WAF_BLOCKS: dict[str, GatewayError] = {
    "body-size": GatewayError(413, "PAYLOAD_TOO_LARGE", "the request body is over the API's limit"),
    "rate-per-ip": GatewayError(429, "THROTTLED", "too many requests from this address; retry in a few minutes", 300),
}


def body(error: GatewayError, request_id: str | None = None) -> dict:
    """The error body; a 5xx names the request, as the handler's own 500 does."""
    details = {"request_id": request_id} if request_id is not None and (error.status or 500) >= 500 else {}
    return {"error": error.code, "message": error.message, "details": details}


def response_template(error: GatewayError) -> str:
    """The body as an API Gateway mapping template: $context.requestId filled in by API Gateway."""
    doc = body(error, request_id="$context.requestId")
    return json.dumps(doc, separators=(",", ":"))
