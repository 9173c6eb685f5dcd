"""What both APIs' gates do the same way (functions/api/routes/auth.py, functions/admin_api/access.py):
the body-size limit, the body's envelope, an error reply in the API's shape, and the answer while
the database is unreachable.

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
from functions._edge.errors import field_errors

BODY_METHODS = ("POST", "PUT", "PATCH")


def reply(status: int, code: str, message: str, details: dict[str, Any] | None = None) -> dict:
    return {"statusCode": status, "headers": {"Content-Type": "application/json"}, "isBase64Encoded": False,
            "body": json.dumps({"error": code, "message": message, "details": details or {}}, separators=(",", ":"))}


def body_error(status: int, code: str, message: str, problem: str, error_type: str) -> dict:
    return reply(status, code, message, field_errors({"body": problem}, error_type))


def check_envelope(event: dict, headers: dict[str, str]) -> dict | None:
    """A request body, when there is one, must be a UTF-8 JSON object; None when it is."""
    raw = event.get("body")
    if not raw or (event.get("httpMethod") or "").upper() not in BODY_METHODS:
        return None
    media_type = (headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    if media_type and media_type != "application/json":
        return body_error(415, "UNSUPPORTED_MEDIA_TYPE", f"unsupported content type {media_type!r}",
                           "send application/json", "unsupported_content_type")
    try:
        data = base64.b64decode(raw, validate=True) if event.get("isBase64Encoded") else raw
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        doc = json.loads(text)
    except (binascii.Error, UnicodeDecodeError):
        return body_error(422, "VALIDATION_ERROR", "request validation failed", "not UTF-8 text", "json_invalid")
    except RecursionError:
        return body_error(422, "VALIDATION_ERROR", "request validation failed", "JSON nested too deeply", "json_invalid")
    except ValueError as e:  # JSONDecodeError, and int literals past sys.get_int_max_str_digits()
        reason = e.msg if isinstance(e, json.JSONDecodeError) else "a number too long to read"
        return body_error(422, "VALIDATION_ERROR", "request validation failed", f"not valid JSON: {reason}", "json_invalid")
    if not isinstance(doc, dict):
        return body_error(422, "VALIDATION_ERROR", "request validation failed",
                           f"must be a JSON object, not {type(doc).__name__}", "model_type")
    return None


def body_size(event: dict) -> int:
    body = event.get("body") or ""
    size = len(body.encode() if isinstance(body, str) else body)
    return size * 3 // 4 if event.get("isBase64Encoded") else size  # the bytes that were sent, not their base64


def database_unavailable_reply(platform) -> dict:
    """503 REJECT_DATABASE_UNAVAILABLE, with Retry-After: nothing was admitted or changed."""
    degraded.database_down(platform)
    r = database_unavailable()
    return {"statusCode": r.status, "isBase64Encoded": False,
            "headers": {"Content-Type": "application/json", "Retry-After": str(r.retry_after_seconds)},
            "body": json.dumps({**r.body(), "details": {}}, separators=(",", ":"))}
