"""The API's error contract (docs/tenant-api.md): every error body is
`{"error": CODE, "message": "...", "details": {...}}`.

Route modules raise `ApiError` for edge concerns (authentication, headers) and let domain errors
(`aivedio.errors.DomainError`) propagate; `install(app)` maps both here, in one place. A route
module that introduces domain codes declares their HTTP status with `register_status`."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from http import HTTPStatus
from typing import Any

from aws_lambda_powertools.event_handler import APIGatewayRestResolver, Response, content_types
from aws_lambda_powertools.event_handler.exceptions import NotFoundError, ServiceError
from aws_lambda_powertools.event_handler.openapi.exceptions import RequestUnsupportedContentType, RequestValidationError

from aivedio import degraded
from aivedio.admission.decisions import database_unavailable
from aivedio.context import get_platform
from aivedio.db.pool import UNAVAILABLE
from aivedio.errors import DomainError
from aivedio.observability import logger

# Domain error code -> HTTP status. Codes absent here answer 400 (and are logged, so they get added).
STATUS_BY_CODE: dict[str, int] = {
    "NOT_FOUND": 404,
    "CONFLICT": 409,
    "VALIDATION_ERROR": 422,  # aivedio.errors.InvalidRequest
    "UNAUTHENTICATED": 401,
    "FORBIDDEN": 403,
}


def register_status(codes: Mapping[str, int] | None = None, /, **by_code: int) -> None:
    """Declare the HTTP status of domain error codes: register_status({"TASK_TERMINAL": 409})."""
    STATUS_BY_CODE.update(codes or {})
    STATUS_BY_CODE.update(by_code)


class ApiError(Exception):
    """An error decided at the edge. `extra` adds top-level fields (the REJECTED body carries
    `decision` and `retry_after_seconds` beside `error`)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str = "",
        *,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ):
        super().__init__(message or code)
        self.status = int(status)
        self.code = code
        self.message = message or HTTPStatus(self.status).phrase
        self.details = details or {}
        self.headers = headers or {}
        self.extra = extra or {}


def error_response(
    status: int,
    code: str,
    message: str,
    details: dict[str, Any] | None = None,
    *,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> Response:
    body: dict[str, Any] = {"error": code, "message": message, "details": details or {}}
    body.update(extra or {})
    return Response(status_code=int(status), content_type=content_types.APPLICATION_JSON, body=body, headers=headers)


def header_name(name: str) -> str:
    """HTTP header names in their canonical spelling: "idempotency-key" -> "Idempotency-Key"."""
    return "-".join(part[:1].upper() + part[1:].lower() for part in name.split("-"))


def field_path(loc: Iterable[Any]) -> str:
    """("body", "inputs", 0, "url") -> "body.inputs.0.url"; ("header", "idempotency-key") -> "header.Idempotency-Key"
    (Powertools lowercases header names; the contract spells them canonically)."""
    parts = [str(p) for p in loc]
    if len(parts) >= 2 and parts[0] == "header":
        parts[1] = header_name(parts[1])
    return ".".join(parts)


def field_errors(fields: Mapping[str, str], error_type: str) -> dict[str, Any]:
    """details for an error already keyed by field path (aivedio.errors.InvalidRequest and the edge's own
    checks): the same {fields, errors} shape request validation gives."""
    return {"fields": dict(fields), "errors": [{"field": f, "type": error_type, "message": m} for f, m in fields.items()]}


def validation_details(errors: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    # Pydantic's own msg is kept (it names the rule, not our code); its input and ctx are dropped.
    items = [
        {
            # A JSON syntax error's loc ends in a character offset, not a field: it names the body.
            "field": "body" if e.get("type") == "json_invalid" else field_path(e.get("loc", ())),
            "type": e.get("type"),
            "message": e.get("msg", "invalid"),
        }
        for e in errors
    ]
    # fields: path -> message, the same shape aivedio.errors.InvalidRequest gives domain validation.
    fields: dict[str, str] = {}
    for i in items:
        fields[i["field"]] = f"{fields[i['field']]}; {i['message']}" if i["field"] in fields else i["message"]
    return {"fields": fields, "errors": items}


def install(app: APIGatewayRestResolver) -> None:
    """Register the handlers that make every failure answer in the contract's shape."""

    @app.exception_handler(RequestValidationError)
    def _validation(e: RequestValidationError) -> Response:
        return error_response(422, "VALIDATION_ERROR", "request validation failed", validation_details(e.errors()))

    @app.exception_handler(RequestUnsupportedContentType)
    def _content_type(e: RequestUnsupportedContentType) -> Response:
        return error_response(415, "UNSUPPORTED_MEDIA_TYPE", str(e) or "unsupported content type", validation_details(e.errors()))

    @app.not_found
    def _not_found(_e: NotFoundError) -> Response:
        ev = app.current_event
        return error_response(404, "NOT_FOUND", f"no route for {ev.http_method} {ev.path}")

    @app.exception_handler(ApiError)
    def _api_error(e: ApiError) -> Response:
        return error_response(e.status, e.code, e.message, e.details, headers=e.headers, extra=e.extra)

    @app.exception_handler(DomainError)
    def _domain(e: DomainError) -> Response:
        status = STATUS_BY_CODE.get(e.code)
        if status is None:
            logger.warning("domain error code without an HTTP status", extra={"code": e.code})
            status = 400
        details = e.details
        if status == 422:
            # Every 422 names its fields by path, with the list form beside the map, whatever raised it.
            fields = details.get("fields") if isinstance(details.get("fields"), dict) else {}
            details = {**details, **field_errors(fields, e.code.lower())} if "errors" not in details else details
        return error_response(status, e.code, e.message, details)

    @app.exception_handler(list(UNAVAILABLE))
    def _database_down(e: Exception) -> Response:
        # PostgreSQL went away after the gate let the request in: fail closed, like the gate (503).

        logger.warning("database unavailable in an API route", extra={"error": repr(e)[:300]})
        degraded.database_down(get_platform())
        r = database_unavailable()
        return Response(status_code=r.status, content_type=content_types.APPLICATION_JSON, body={**r.body(), "details": {}},
                        headers={"Retry-After": str(r.retry_after_seconds)})

    @app.exception_handler(ServiceError)
    def _service(e: ServiceError) -> Response:
        # Powertools' own BadRequestError & co.
        status = HTTPStatus(e.status_code)
        return error_response(status, status.name, e.msg if isinstance(e.msg, str) else status.phrase)

    @app.exception_handler(Exception)
    def _internal(e: Exception) -> Response:
        logger.exception("unhandled error in API route")
        rid = app.current_event.request_context.request_id
        return error_response(500, "INTERNAL", "internal error", {"request_id": rid})
