"""Domain errors carry a code; only the edge maps them to HTTP status codes."""
from __future__ import annotations

from typing import Any


class DomainError(Exception):
    code = "DOMAIN_ERROR"

    def __init__(self, message: str, *, code: str | None = None, details: dict[str, Any] | None = None):
        super().__init__(message)
        if code:
            self.code = code
        self.message = message
        self.details = details or {}


class NotFound(DomainError):
    code = "NOT_FOUND"


class Conflict(DomainError):
    code = "CONFLICT"


class InvalidRequest(DomainError):
    """Bad input, reported with the path of each bad field."""

    code = "VALIDATION_ERROR"

    def __init__(self, message: str, fields: dict[str, str], code: str | None = None):
        super().__init__(message, code=code, details={"fields": fields})
        self.fields = fields


class Unauthenticated(DomainError):
    code = "UNAUTHENTICATED"


class Forbidden(DomainError):
    code = "FORBIDDEN"
