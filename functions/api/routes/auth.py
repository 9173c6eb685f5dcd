"""The gate in front of every route of the tenant API: the body-size limit, then authentication, then
the body's envelope (functions._edge.envelope, as the admin API's gate). It runs before request
validation, so an unauthenticated caller learns nothing about the request's shape, and an oversized
body is refused before anything parses it. A bearer API key maps to one tenant and one user."""
from __future__ import annotations

from aivedio.auth import Caller, authenticate, cached_caller
from aivedio.context import get_platform
from aivedio.db.pool import UNAVAILABLE
from aivedio.errors import Unauthenticated
from functions._edge.envelope import body_error, body_size, check_envelope, database_unavailable_reply, reply

# /v1/media/: the outputs' signed URLs (functions/api/routes/media.py), whose signature is the credential.
PUBLIC_PREFIXES = ("/healthz", "/openapi.json", "/swagger", "/v1/providers/", "/v1/media/")


def _routed(app, method: str, path: str) -> bool:
    """Whether some route answers this method and path. An unknown route answers 404 to anyone: the
    route table is public in /openapi.json, so authenticating first would hide nothing."""
    routes = getattr(app, "_static_routes", None), getattr(app, "_dynamic_routes", None)
    if routes[0] is None or routes[1] is None:  # Powertools internals moved: authenticate everything
        return True
    return any(r.method == method and r.rule.match(path) for r in routes[0] + routes[1])


def gate(app, event: dict) -> dict | None:
    """None lets the request through (with the caller in app.context); otherwise the proxy answer."""
    platform = get_platform()
    limit = platform.config.limits.max_body_bytes
    if body_size(event) > limit:
        return body_error(413, "PAYLOAD_TOO_LARGE", f"request body over {limit} bytes", f"over {limit} bytes", "too_large")
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
        return reply(401, "UNAUTHENTICATED", e.message)
    except UNAVAILABLE:  # PostgreSQL down: fail closed, and fast (ch. 18.18, 20.12.1)
        return database_unavailable_reply(platform)
    refused = check_envelope(event, headers)
    if refused is not None:
        return refused
    app.append_context(caller=caller)
    return None


def caller_of(router) -> Caller:
    return router.context["caller"]
