"""The gate in front of every admin route (docs/admin-api.md): the body-size limit, then the
operator's token, then the matched route's permission, then the body's envelope.

It runs before request validation, so a caller without the right role learns nothing about a
route's body shape, and a denied attempt is refused (403, audited) before anything parses it.
Each route declares its permission with @requires (below its @router.<verb>(...) line); a route
the dashboard serves before sign-in is marked @public instead. A route with neither is a
programming error, answered 500 rather than served to anyone."""
from __future__ import annotations

from collections.abc import Callable
from http.cookies import CookieError, SimpleCookie
from typing import TypeVar
from uuid import UUID

from aivedio import audit
from aivedio.admin.operators import authenticate_operator
from aivedio.context import get_platform
from aivedio.db.pool import UNAVAILABLE
from aivedio.errors import Forbidden, Unauthenticated
from aivedio.observability import logger
from aivedio.policy import roles
from functions._edge.envelope import body_error, body_size, check_envelope, database_unavailable_reply, reply

SESSION_COOKIE = "aivedio_admin_session"  # a session id set by the dashboard's sign-in (routes/dashboard.py)
OPENAPI_PATH = "/admin/v1/openapi.json"

F = TypeVar("F", bound=Callable)


def requires(permission: str) -> Callable[[F], F]:
    """Declare the permission a route needs (a permission of aivedio.policy.roles); the function is unchanged."""

    def mark(fn: F) -> F:
        fn.admin_permission = permission  # type: ignore[attr-defined]
        return fn

    return mark


def public(fn: F) -> F:
    """A route served without a token (the OpenAPI document, the dashboard's sign-in)."""
    fn.admin_public = True  # type: ignore[attr-defined]
    return fn


def operator_of(router):
    """The aivedio.admin.operators.Operator the gate authenticated for this request."""
    return router.context["operator"]


def matched_route(app, method: str, path: str):
    """The route Powertools will call for this method and path (static routes first, as it does),
    or None. Raises RuntimeError when Powertools' route tables are not where we read them."""
    static, dynamic = getattr(app, "_static_routes", None), getattr(app, "_dynamic_routes", None)
    if static is None or dynamic is None:
        raise RuntimeError("Powertools route tables not found")
    for route in (*static, *dynamic):
        if route.method == method and route.rule.match(path):
            return route
    return None


def session_token(headers: dict[str, str]) -> str | None:
    """The session id in the dashboard's session cookie, if any (headers lower-cased)."""
    raw = headers.get("cookie")
    if not raw:
        return None
    try:
        morsel = SimpleCookie(raw).get(SESSION_COOKIE)
    except CookieError:
        return None
    return morsel.value if morsel is not None and morsel.value else None


def _internal(message: str, **extra) -> dict:
    logger.error(message, extra=extra)
    return reply(500, "INTERNAL", "internal error")


def _named_tenant(route, path: str) -> UUID | None:
    """The tenant a route's path names ({tenant_id}), when it is a UUID; the tenant need not exist."""
    m = route.rule.match(path)
    raw = (m.groupdict() if m else {}).get("tenant_id")
    try:
        return UUID(raw) if raw else None
    except ValueError:
        return None


def gate(app, event: dict) -> dict | None:
    """None lets the request through (with the operator in app.context); otherwise the proxy answer."""
    platform = get_platform()
    limit = platform.config.limits.max_body_bytes
    if body_size(event) > limit:
        return body_error(413, "PAYLOAD_TOO_LARGE", f"request body over {limit} bytes", f"over {limit} bytes", "too_large")
    method = (event.get("httpMethod") or "").upper()
    path = event.get("path") or ""
    try:
        route = matched_route(app, method, path)
    except RuntimeError:
        return _internal("admin gate cannot read the route table")
    if route is None:  # 404 to anyone: the route table is public in the OpenAPI document
        return None
    if getattr(route.func, "admin_public", False):
        return None  # its own body handling (a sign-in form may not be JSON)
    permission = getattr(route.func, "admin_permission", None)
    if not permission:
        return _internal("admin route without a permission", method=method, rule=route.func.__name__)
    headers = {k.lower(): v for k, v in (event.get("headers") or {}).items()}
    # The session cookie only for reads: a cookie rides along on a cross-site POST, a bearer never does.
    cookie = session_token(headers) if method in ("GET", "HEAD") else None
    try:
        with platform.db.connection(timeout=platform.config.limits.api_database_wait_seconds) as conn:
            operator = authenticate_operator(conn, headers.get("authorization"), session_id=cookie)
    except Unauthenticated as e:
        return reply(401, "UNAUTHENTICATED", e.message)
    except Forbidden as e:  # a tenant API key: a valid credential, but not for this API
        return reply(403, "FORBIDDEN", e.message)
    except UNAVAILABLE:
        return database_unavailable_reply(platform)
    if not roles.allowed(operator.role, permission):
        reason = f"role {operator.role} lacks {permission}"
        try:
            audit.append_denied(platform, operator=operator.audit_name, action=permission,
                                target=f"{method} {path}", reason=reason, tenant_id=_named_tenant(route, path))
        except UNAVAILABLE:
            return database_unavailable_reply(platform)
        return reply(403, "FORBIDDEN", f"operator {operator.name!r} may not {permission}",
                      {"permission": permission, "role": operator.role})
    refused = check_envelope(event, headers)
    if refused is not None:
        return refused
    app.append_context(operator=operator)
    return None
