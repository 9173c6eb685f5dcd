"""The live operations dashboard (docs/admin-api.md "The dashboard"): the page, its
sign-in into a server-side session whose id rides in an HttpOnly cookie, and the JSON it polls
(aivedio.admin.dashboard).

The page routes are public to the gate (a browser arrives without a token) and check the token
themselves: without a valid one GET /dashboard shows only the sign-in form, no figures. The
JSON is behind the gate like every admin route (dashboard.read; the gate accepts the cookie for
GETs only, so a cross-site POST carrying it can do nothing). The cookie never holds the operator
token: a session lasts SESSION_MAX_AGE_SECONDS, ends at sign-out, and dies with a rotation of the
token it was opened with or the operator's revocation (aivedio.admin.operators). A sign-in posted
from another site is refused (login CSRF). Every
page carries a CSP of `default-src 'self'`: the script and styles are files served here, no inline
code, nothing fetched from elsewhere; every value reaches the DOM through textContent."""
from __future__ import annotations

import base64
import binascii
import json
from functools import lru_cache
from html import escape
from pathlib import Path
from string import Template
from urllib.parse import parse_qs, urlsplit

from aws_lambda_powertools.event_handler import Response, content_types
from aws_lambda_powertools.event_handler.api_gateway import Router
from aws_lambda_powertools.shared.cookies import Cookie, SameSite

from aivedio.admin import dashboard
from aivedio.admin.operators import Operator, authenticate_operator, end_session, open_session
from aivedio.context import get_platform
from aivedio.db.pool import UNAVAILABLE
from aivedio.errors import Forbidden, Unauthenticated
from aivedio.observability import logger
from aivedio.policy import roles
from functions.admin_api.access import SESSION_COOKIE, operator_of, public, requires, session_token

router = Router()

PERMISSION = "dashboard.read"
STATIC = Path(__file__).resolve().parent.parent / "static"
ASSETS = {"dashboard.js": "application/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
TOKEN_FIELD = "token"
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'; "
                               "object-src 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    # Not no-referrer: under it a browser sends `Origin: null` with the page's own sign-in form, which
    # _cross_site could not tell from another site's. same-origin never sends a referrer elsewhere.
    "Referrer-Policy": "same-origin",
}
NO_STORE = {"Cache-Control": "no-store"}
ASSET_CACHE = {"Cache-Control": "public, max-age=300"}
HTML = "text/html; charset=utf-8"
# How long a dashboard session lasts, in the database and as the cookie's Max-Age: one working day
# of an on-call shift; after this the operator signs in again.
SESSION_MAX_AGE_SECONDS = 12 * 3600


@lru_cache(maxsize=None)
def _static(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def _html(status: int, body: str, cookies: list[Cookie] | None = None) -> Response:
    return Response(status_code=status, content_type=HTML, body=body, headers={**SECURITY_HEADERS, **NO_STORE},
                    cookies=cookies)


def _render(name: str, **values: str) -> str:
    """A page with its links made absolute under the page's own path (it is also served from
    /dashboard/session, where relative links would point elsewhere); every value HTML-escaped."""
    return Template(_static(name)).safe_substitute(base=escape(_page_path()), **{k: escape(v) for k, v in values.items()})


def _signin_page(status: int, message: str = "", cookies: list[Cookie] | None = None) -> Response:
    return _html(status, _render("signin.html", message=message), cookies)


def _headers() -> dict[str, str]:
    return {k.lower(): v for k, v in (router.current_event.raw_event.get("headers") or {}).items()}


def _over_https(headers: dict[str, str]) -> bool:
    """Whether the browser talks https to us (API Gateway and load balancers say so in X-Forwarded-Proto)."""
    return headers.get("x-forwarded-proto", "").split(",")[0].strip().lower() == "https"


def _session_cookie(session_id: str, headers: dict[str, str]) -> Cookie:
    return Cookie(SESSION_COOKIE, session_id, path="/", secure=_over_https(headers), http_only=True, same_site=SameSite.STRICT_MODE,
                  max_age=SESSION_MAX_AGE_SECONDS)


def _cross_site(headers: dict[str, str]) -> bool:
    """Whether a browser sent this from another site (login CSRF: a page elsewhere signing the
    browser into the attacker's token). Sec-Fetch-Site, when sent, must not be cross-site; Origin,
    when sent, must be this request's own host. An opaque origin ("null": a page elsewhere may ask
    for one with its own referrer policy) passes only when the browser says same-origin. A client
    that sends neither header (curl, a test) is no browser and passes."""
    fetch_site = headers.get("sec-fetch-site", "").strip().lower()
    if fetch_site == "cross-site":
        return True
    origin = headers.get("origin")
    if origin is None:
        return False
    if origin.strip().lower() == "null":
        return fetch_site != "same-origin"
    host = (headers.get("host") or "").strip().lower()
    try:
        netloc = urlsplit(origin.strip()).netloc.lower()
    except ValueError:
        return True
    return not host or netloc != host


def _cleared_cookie(headers: dict[str, str]) -> Cookie:
    return Cookie(SESSION_COOKIE, "", path="/", secure=_over_https(headers), http_only=True, same_site=SameSite.STRICT_MODE,
                  max_age=0)


def _page_path() -> str:
    """The page's own path as the browser sees it (with an API Gateway stage prefix when there is one)."""
    event = router.current_event.raw_event
    path = ((event.get("requestContext") or {}).get("path") or event.get("path") or "/dashboard").rstrip("/") or "/dashboard"
    for suffix in ("/session", "/logout"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def _authenticate(authorization: str | None, session_id: str | None) -> Operator:
    platform = get_platform()
    with platform.db.connection(timeout=platform.config.limits.api_database_wait_seconds) as conn:
        return authenticate_operator(conn, authorization, session_id=session_id)


@router.get("/dashboard", include_in_schema=False)
@public
def page():
    """The page with a valid bearer token or session; otherwise the sign-in form, no data.
    /dashboard/ redirects to /dashboard: the script's data URL is relative to the page."""
    if (router.current_event.raw_event.get("path") or "").endswith("/"):
        return Response(status_code=308, content_type=content_types.TEXT_PLAIN, body="moved",
                        headers={"Location": _page_path(), **NO_STORE})
    headers = _headers()
    authorization, cookie = headers.get("authorization"), session_token(headers)
    if not authorization and not cookie:
        return _signin_page(200)
    try:
        op = _authenticate(authorization, cookie)
    except Unauthenticated:
        # A stale cookie (session ended or expired, token rotated, operator revoked) is dropped.
        return _signin_page(401, "That session has ended, or the token is unknown or revoked: sign in again.",
                            [_cleared_cookie(headers)] if cookie else None)
    except Forbidden:
        return _signin_page(403, "A tenant API key cannot open the operations dashboard: use an operator token.",
                            [_cleared_cookie(headers)] if cookie else None)
    if not roles.allowed(op.role, PERMISSION):
        return _signin_page(403, f"Role {op.role} may not read the dashboard.")
    return _html(200, _render("dashboard.html"))


@router.get("/dashboard/assets/<name>", include_in_schema=False)
@public
def asset(name: str):
    """The page's script and stylesheet: code only, no data, so served without a token."""
    if name not in ASSETS:
        return Response(status_code=404, content_type=content_types.TEXT_PLAIN, body="not found",
                        headers={"X-Content-Type-Options": "nosniff"})
    return Response(status_code=200, content_type=ASSETS[name], body=_static(name),
                    headers={**SECURITY_HEADERS, **ASSET_CACHE})


def _posted_token() -> tuple[str | None, bool]:
    """The token of a sign-in, and whether it came as JSON (else an HTML form)."""
    event = router.current_event
    raw = event.raw_event.get("body") or ""
    media_type = (_headers().get("content-type") or "").split(";", 1)[0].strip().lower()
    try:
        body = base64.b64decode(raw).decode("utf-8") if event.raw_event.get("isBase64Encoded") else raw
    except (binascii.Error, UnicodeDecodeError):
        return None, media_type == "application/json"
    if media_type == "application/json":
        try:
            doc = json.loads(body or "{}")
        except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth, before sign-in
            return None, True
        value = doc.get(TOKEN_FIELD) if isinstance(doc, dict) else None
        return (value.strip() if isinstance(value, str) and value.strip() else None), True
    values = parse_qs(body, keep_blank_values=False).get(TOKEN_FIELD) or [None]
    return (values[0].strip() if values[0] else None), False


def _json(status: int, doc: dict, cookies: list[Cookie] | None = None) -> Response:
    return Response(status_code=status, content_type=content_types.APPLICATION_JSON, body=json.dumps(doc),
                    headers=NO_STORE, cookies=cookies)


@router.post("/dashboard/session", include_in_schema=False)
@public
def sign_in():
    """Form (`token=`) or JSON (`{"token": ...}`): a valid operator token opens a session whose id
    becomes the cookie (303 back to the page for a form, 200 for JSON); anything else is 401 and
    sets nothing. A cross-site post (_cross_site) is 403 and sets nothing."""
    headers = _headers()
    token, as_json = _posted_token()
    if _cross_site(headers):
        message = "a sign-in must come from this site's own page"
        if as_json:
            return _json(403, {"error": "FORBIDDEN", "message": message, "details": {}})
        return _signin_page(403, "That sign-in was refused: " + message + ".")
    try:
        if not token:
            raise Unauthenticated("an operator token is required")
        # Only the posted token counts: a cookie or bearer already present must not sign this in.
        op = _authenticate(f"Bearer {token}", None)
        if not roles.allowed(op.role, PERMISSION):
            raise Forbidden(f"role {op.role} may not read the dashboard")
        previous = session_token(headers)

        def reopen(c):  # a browser signing in again ends the session its cookie held
            end_session(c, previous)
            return open_session(c, op, token, max_age_seconds=SESSION_MAX_AGE_SECONDS)

        session_id = get_platform().db.transaction(reopen)
    except (Unauthenticated, Forbidden) as e:
        status, code = (401, "UNAUTHENTICATED") if isinstance(e, Unauthenticated) else (403, "FORBIDDEN")
        if as_json:
            return _json(status, {"error": code, "message": e.message, "details": {}})
        return _signin_page(status, "That token was not accepted: " + e.message + ".")
    logger.info("dashboard session opened", extra={"operator": op.audit_name, "role": op.role})
    cookie = _session_cookie(session_id, headers)
    if as_json:
        return _json(200, {"signed_in": True, "operator": op.name, "role": op.role}, [cookie])
    return Response(status_code=303, content_type=content_types.TEXT_PLAIN, body="signed in",
                    headers={"Location": _page_path(), **NO_STORE}, cookies=[cookie])


@router.post("/dashboard/logout", include_in_schema=False)
@public
def sign_out():
    """Ends the session in the database and clears its cookie (the operator token is untouched). The
    cookie is cleared even when the database cannot be reached; the session then ends at its expiry."""
    headers = _headers()
    session_id = session_token(headers)
    if session_id:
        try:
            if get_platform().db.transaction(lambda c: end_session(c, session_id)):
                logger.info("dashboard session ended")
        except UNAVAILABLE:
            logger.warning("dashboard sign-out: database unavailable, the session ends at its expiry")
    if (headers.get("content-type") or "").split(";", 1)[0].strip().lower() == "application/json":
        return _json(200, {"signed_in": False}, [_cleared_cookie(headers)])
    return Response(status_code=303, content_type=content_types.TEXT_PLAIN, body="signed out",
                    headers={"Location": _page_path(), **NO_STORE}, cookies=[_cleared_cookie(headers)])


@router.get("/admin/v1/dashboard", tags=["dashboard"],
            summary="The operations dashboard's figures: lanes, tenants' shares, providers, reviews, reconciliation, audit")
@requires(PERMISSION)
def snapshot():
    op = operator_of(router)
    doc = dashboard.snapshot(get_platform())
    return _json(200, {**doc, "viewer": {"name": op.name, "role": op.role}})
