"""HTTP request <-> API Gateway REST (v1) Lambda proxy event, so the local server hands the `api`
handler exactly what API Gateway would, and turns its answer back into HTTP the same way."""
from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from urllib.parse import parse_qsl, unquote

from aivedio import gateway_errors

Headers = Mapping[str, str] | Iterable[tuple[str, str]]

ACCOUNT_ID = "000000000000"
API_ID = "local"


def _header_pairs(headers: Headers) -> list[tuple[str, str]]:
    return list(headers.items()) if isinstance(headers, Mapping) else list(headers)


def to_event(
    method: str,
    path: str,
    query_string: str = "",
    headers: Headers = (),
    body: bytes = b"",
    *,
    source_ip: str = "127.0.0.1",
    stage: str = "local",
    request_id: str | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """The proxy event API Gateway sends for one request. Like API Gateway: header and query
    values that repeat appear last-wins in the single-value maps and in full in the multi-value
    ones; query values are URL-decoded; a body that is not UTF-8 text is base64 with
    isBase64Encoded; an empty body is None."""
    now = now or datetime.now(timezone.utc)
    request_id = request_id or str(uuid.uuid4())
    path = unquote(path) or "/"

    single_h: dict[str, str] = {}
    multi_h: dict[str, list[str]] = {}
    for k, v in _header_pairs(headers):
        single_h[k] = v
        multi_h.setdefault(k, []).append(v)

    single_q: dict[str, str] = {}
    multi_q: dict[str, list[str]] = {}
    for k, v in parse_qsl(query_string or "", keep_blank_values=True):
        single_q[k] = v
        multi_q.setdefault(k, []).append(v)

    body_str: str | None
    is_b64 = False
    if not body:
        body_str = None
    else:
        try:
            body_str = body.decode("utf-8")
        except UnicodeDecodeError:
            body_str, is_b64 = base64.b64encode(body).decode("ascii"), True

    user_agent = next((v for k, v in single_h.items() if k.lower() == "user-agent"), None)
    host = next((v for k, v in single_h.items() if k.lower() == "host"), "localhost")
    epoch_ms = int(now.timestamp() * 1000)
    return {
        "resource": path,
        "path": path,
        "httpMethod": method.upper(),
        "headers": single_h or None,
        "multiValueHeaders": multi_h or None,
        "queryStringParameters": single_q or None,
        "multiValueQueryStringParameters": multi_q or None,
        "pathParameters": None,
        "stageVariables": None,
        "requestContext": {
            "accountId": ACCOUNT_ID,
            "apiId": API_ID,
            "resourceId": "local",
            "resourcePath": path,
            "httpMethod": method.upper(),
            "path": path,  # no stage prefix: the local server is like a custom domain
            "stage": stage,
            "protocol": "HTTP/1.1",
            "requestId": request_id,
            "extendedRequestId": request_id,
            "requestTime": now.strftime("%d/%b/%Y:%H:%M:%S +0000"),
            "requestTimeEpoch": epoch_ms,
            "domainName": host.split(":")[0],
            "identity": {"sourceIp": source_ip, "userAgent": user_agent},
        },
        "body": body_str,
        "isBase64Encoded": is_b64,
    }


@dataclass
class HttpResponse:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""

    def header(self, name: str) -> str | None:
        found = [v for k, v in self.headers if k.lower() == name.lower()]
        return found[-1] if found else None


class MalformedProxyResponse(ValueError):
    """What API Gateway answers 502 for: the function returned something that is not a proxy response."""


def from_response(resp: Any) -> HttpResponse:
    """The HTTP response API Gateway builds from a proxy response: multiValueHeaders win over
    headers of the same name; the body is base64-decoded when isBase64Encoded."""
    if not isinstance(resp, Mapping):
        raise MalformedProxyResponse(f"expected a dict, got {type(resp).__name__}")
    try:
        status = int(resp.get("statusCode", 200))
    except (TypeError, ValueError):
        raise MalformedProxyResponse(f"bad statusCode {resp.get('statusCode')!r}") from None

    multi = resp.get("multiValueHeaders") or {}
    single = resp.get("headers") or {}
    out: list[tuple[str, str]] = []
    multi_names = {k.lower() for k in multi}
    for k, v in single.items():
        if k.lower() not in multi_names:
            out.append((k, str(v)))
    for k, vs in multi.items():
        for v in vs if isinstance(vs, list) else [vs]:
            out.append((k, str(v)))

    raw = resp.get("body")
    if raw is None:
        body = b""
    elif resp.get("isBase64Encoded"):
        try:
            body = base64.b64decode(raw, validate=True)
        except (binascii.Error, TypeError):
            raise MalformedProxyResponse("isBase64Encoded but the body is not base64") from None
    elif isinstance(raw, str):
        body = raw.encode("utf-8")
    else:
        raise MalformedProxyResponse(f"body must be a string, got {type(raw).__name__}")
    return HttpResponse(status, out, body)


def gateway_error(status: int, code: str, message: str) -> HttpResponse:
    """An answer the local server gives on its own for a request it could not read (a bad
    Content-Length or chunk), in our error shape."""
    body = json.dumps({"error": code, "message": message, "details": {}}).encode()
    return HttpResponse(status, [("Content-Type", "application/json"), ("x-amzn-ErrorType", code)], body)


def gateway_response(response_type: str, *, status: int | None = None) -> HttpResponse:
    """What API Gateway answers on its own for `response_type` (REQUEST_TOO_LARGE, DEFAULT_5XX...),
    from the table the CDK app deploys (aivedio.gateway_errors); `status` where the type keeps
    API Gateway's own."""
    error = gateway_errors.GATEWAY_ERRORS[response_type]
    code = error.status or status
    assert code is not None, response_type
    headers = [("Content-Type", "application/json"), ("x-amzn-ErrorType", error.code)]
    if error.retry_after_seconds is not None:
        headers.append(("Retry-After", str(error.retry_after_seconds)))
    return HttpResponse(code, headers, json.dumps(gateway_errors.body(error, request_id=str(uuid.uuid4()))).encode())
