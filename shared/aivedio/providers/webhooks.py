"""Standard Webhooks signatures (https://www.standardwebhooks.com), as the provider contract uses them.

A message carries `webhook-id`, `webhook-timestamp` (Unix seconds) and `webhook-signature`: a
space-separated list of `v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`. The key is the
secret after its `whsec_` prefix, base64-decoded. A message verifies when its timestamp is within the
tolerance of now (either side) and any one of its v1 signatures matches; other versions are ignored.

Pure functions: no clock, no I/O. Replay protection (deduping on webhook-id) is the receiver's job.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Union

SECRET_PREFIX = "whsec_"
DEFAULT_TOLERANCE_SECONDS = 300  # Standard Webhooks' recommended five minutes
MAX_SIGNATURES = 16  # more than this in one header is refused rather than tried
MAX_TIMESTAMP_DIGITS = 12  # webhook-timestamp, Unix seconds

Headers = Union[Mapping[str, str], Iterable[tuple[str, str]]]


def decode_secret(secret: str) -> bytes:
    """The HMAC key of a `whsec_<base64>` secret (the prefix is optional, as in the reference
    libraries). A secret that is not base64 is a configuration error: ValueError."""
    raw = secret[len(SECRET_PREFIX):] if secret.startswith(SECRET_PREFIX) else secret
    try:
        key = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("webhook_secret: expected whsec_ followed by base64") from None
    if not key:
        raise ValueError("webhook_secret: the key is empty")
    return key


def _as_bytes(body: bytes | str) -> bytes:
    return body.encode("utf-8") if isinstance(body, str) else bytes(body)


def signature(secret: str, msg_id: str, timestamp: int | str, body: bytes | str) -> str:
    """One `v1,<base64>` signature of a message."""
    signed = f"{msg_id}.{timestamp}.".encode("utf-8") + _as_bytes(body)
    mac = hmac.new(decode_secret(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode("ascii")


def sign_webhook(secret: str, msg_id: str, timestamp: int, body: bytes | str) -> dict[str, str]:
    """The three headers that sign `body` as message `msg_id` sent at `timestamp` (Unix seconds)."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(timestamp)),
        "webhook-signature": signature(secret, msg_id, int(timestamp), body),
    }


def _lower(headers: Headers) -> dict[str, str]:
    items = headers.items() if hasattr(headers, "items") else headers
    out: dict[str, str] = {}
    for k, v in items:
        out.setdefault(str(k).lower(), str(v))  # the first value of a repeated header wins
    return out


def _epoch(now: datetime | float | int) -> float:
    if isinstance(now, datetime):
        if now.tzinfo is None:
            raise ValueError("now: a naive datetime is ambiguous; pass an aware UTC datetime")
        return now.timestamp()
    return float(now)


def verify_webhook(secret: str, headers: Headers, body: bytes | str, now: datetime | float | int,
                   tolerance_seconds: float = DEFAULT_TOLERANCE_SECONDS) -> bool:
    """True when the message is signed with `secret` and its timestamp is within tolerance of `now`
    (an aware datetime or Unix seconds). Header names are case-insensitive. Verify the raw body bytes
    as received: re-serialised JSON would not match."""
    h = _lower(headers)
    msg_id, ts_raw, sig_header = h.get("webhook-id", ""), h.get("webhook-timestamp", ""), h.get("webhook-signature", "")
    # At most 12 digits (Unix seconds until the year 33658): int() of a longer one is slow, and past
    # sys.get_int_max_str_digits() a ValueError, an unauthenticated 500.
    if not msg_id or not sig_header or not ts_raw.isascii() or not ts_raw.isdigit() or len(ts_raw) > MAX_TIMESTAMP_DIGITS:
        return False
    timestamp = int(ts_raw)
    if abs(_epoch(now) - timestamp) > tolerance_seconds:
        return False
    expected = signature(secret, msg_id, timestamp, body).split(",", 1)[1].encode("ascii")
    candidates = sig_header.split()
    if len(candidates) > MAX_SIGNATURES:
        return False
    for candidate in candidates:
        version, _, sig = candidate.partition(",")
        if version == "v1" and sig and hmac.compare_digest(sig.encode("ascii", "replace"), expected):
            return True
    return False
