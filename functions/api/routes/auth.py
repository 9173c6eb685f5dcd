"""The gate in front of every route: the body-size limit, then authentication, then the body's
envelope. It runs before request validation, so an unauthenticated caller learns nothing about the
request's shape, and an oversized body is refused before anything parses it. A bearer API key maps
to one tenant and one user.

The envelope check refuses what the validation layer would otherwise crash on rather than answer:
a body that is not UTF-8, JSON nested past the parser's recursion limit, an integer literal past
Python's 4300-digit limit, a media type other than JSON (Powertools' multipart parser raises bare
ValueErrors). Each answers 4xx with the field path "body"."""
from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from aivedio import degraded
from aivedio.admission.decisions import database_unavailable
from aivedio.auth import Caller, authenticate, cached_caller
from aivedio.context import get_platform
from aivedio.db.pool import UNAVAILABLE
from aivedio.errors import Unauthenticated
from functions.api.errors import field_errors

# /v1/media/: the outputs' signed URLs (functions/api/routes/media.py), whose signature is the credential.
PUBLIC_PREFIXES = ("/healthz", "/openapi.json", "/swagger", "/v1/providers/", "/v1/media/")
BODY_METHODS = ("POST", "PUT", "PATCH")


def _reply(status: int, code: str, message: str, details: dict[str, Any] | None = None) -> dict:
    return {"statusCode": status, "headers": {"Content-Type": "application/json"}, "isBase64Encoded": False,
            "body": json.dumps({"error": code, "message": message, "details": details or {}}, separators=(",", ":"))}


def _body_error(status: int, code: str, message: str, problem: str, error_type: str) -> dict:
    return _reply(status, code, message, field_errors({"body": problem}, error_type))


def _routed(app, method: str, path: str) -> bool:
    """Whether some route answers this method and path. An unknown route answers 404 to anyone: the
    route table is public in /openapi.json, so authenticating first would hide nothing."""
    routes = getattr(app, "_static_routes", None), getattr(app, "_dynamic_routes", None)
    if routes[0] is None or routes[1] is None:  # Powertools internals moved: authenticate everything
        return True
    return any(r.method == method and r.rule.match(path) for r in routes[0] + routes[1])


def _check_envelope(event: dict, headers: dict[str, str]) -> dict | None:
    """A request body, when there is one, must be a UTF-8 JSON object; None when it is."""
    raw = event.get("body")
    if not raw or (event.get("httpMethod") or "").upper() not in BODY_METHODS:
        return None
    media_type = (headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    if media_type and media_type != "application/json":
        return _body_error(415, "UNSUPPORTED_MEDIA_TYPE", f"unsupported content type {media_type!r}",
                           "send application/json", "unsupported_content_type")
    try:
        data = base64.b64decode(raw, validate=True) if event.get("isBase64Encoded") else raw
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        doc = json.loads(text)
    except (binascii.Error, UnicodeDecodeError):
        return _body_error(422, "VALIDATION_ERROR", "request validation failed", "not UTF-8 text", "json_invalid")
    except RecursionError:
        return _body_error(422, "VALIDATION_ERROR", "request validation failed", "JSON nested too deeply", "json_invalid")
    except ValueError as e:  # JSONDecodeError, and int literals past sys.get_int_max_str_digits()
        reason = e.msg if isinstance(e, json.JSONDecodeError) else "a number too long to read"
        return _body_error(422, "VALIDATION_ERROR", "request validation failed", f"not valid JSON: {reason}", "json_invalid")
    if not isinstance(doc, dict):
        return _body_error(422, "VALIDATION_ERROR", "request validation failed",
                           f"must be a JSON object, not {type(doc).__name__}", "model_type")
    return None


def _body_size(event: dict) -> int:
    body = event.get("body") or ""
    size = len(body.encode() if isinstance(body, str) else body)
    return size * 3 // 4 if event.get("isBase64Encoded") else size  # the bytes that were sent, not their base64


def gate(app, event: dict) -> dict | None:
    """None lets the request through (with the caller in app.context); otherwise the proxy answer."""
    platform = get_platform()
    limit = platform.config.limits.max_body_bytes
    if _body_size(event) > limit:
        return _body_error(413, "PAYLOAD_TOO_LARGE", f"request body over {limit} bytes", f"over {limit} bytes", "too_large")
    path = event.get("path") or ""
    if path.startswith(PUBLIC_PREFIXES) or not _routed(app, (event.get("httpMethod") or "").upper(), path):
        return None
    headers = {k.lower(): v for k, v in (event.get("headers") or {}).items()}
    ttl = platform.config.limits.api_key_cache_seconds
    try:
        caller = cached_caller(headers.get("authorization"), ttl)
        if caller is None:
            with platform.db.connection(timeout=platform.config.limits.api_database_wait_seconds) as conn:
                caller = authenticate(conn, headers.get("authorization"), cache=ttl > 0)
    except Unauthenticated as e:
        return _reply(401, "UNAUTHENTICATED", e.message)
    except UNAVAILABLE:  # PostgreSQL down: fail closed, and fast (ch. 18.18, 20.12.1)
        return database_unavailable_reply(platform)
    refused = _check_envelope(event, headers)
    if refused is not None:
        return refused
    app.append_context(caller=caller)
    return None


def database_unavailable_reply(platform) -> dict:
    """503 REJECT_DATABASE_UNAVAILABLE, with Retry-After: nothing was admitted or changed."""
    degraded.database_down(platform)
    r = database_unavailable()
    return {"statusCode": r.status, "isBase64Encoded": False,
            "headers": {"Content-Type": "application/json", "Retry-After": str(r.retry_after_seconds)},
            "body": json.dumps({**r.body(), "details": {}}, separators=(",", ":"))}


def caller_of(router) -> Caller:
    return router.context["caller"]
