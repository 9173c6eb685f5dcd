"""The tenant's URLs of a task's outputs (issue 17: "the platform's own URLs, never the provider's"),
made at read time from the platform's object keys (task_output.object_key):

- in AWS (Settings.media_bucket): a presigned S3 GET URL of the media bucket's object, valid for
  [media] url_ttl_seconds;
- locally: a URL of this platform's own API, GET /v1/media/<ref>?expires=<unix s>&sig=<HMAC>, which
  functions/api/routes/media.py serves from the media directory. <ref> is the key, base64url; the
  signature is HMAC-SHA256 over the key and the expiry with [media] url_signing_key, a random key
  per process (no default secret), so a URL cannot be made for another key, nor kept past its
  expiry, nor used after the platform restarted with another key.

A row written by the old direct path ([media] enabled = false) keeps the URL it was written with."""
from __future__ import annotations

import base64
import hashlib
import hmac
import time
from pathlib import Path
from typing import Any

from aivedio.errors import DomainError, NotFound
from aivedio.media.pipeline import media_root

ROUTE = "/v1/media/"


class MediaUrlRefused(DomainError):
    code = "MEDIA_URL_REFUSED"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def signature(secret: str, key: str, expires: int) -> str:
    return _b64(hmac.new(secret.encode(), f"{key}\n{int(expires)}".encode(), hashlib.sha256).digest())


def ref_of(key: str) -> str:
    return _b64(key.encode())


def public_base(platform) -> str:
    """This API's own address: the local server's (it may listen on a port chosen at start), else
    the configured API base URL."""
    base = platform.extras.get("callback_base_url") or platform.settings.api_base_url or ""
    return base.rstrip("/")


def local_url(platform, key: str, *, now: float | None = None) -> str:
    m = platform.config.media
    expires = int((now if now is not None else time.time()) + m.url_ttl_seconds)
    return f"{public_base(platform)}{ROUTE}{ref_of(key)}?expires={expires}&sig={signature(m.url_signing_key, key, expires)}"


def presigned_url(platform, key: str) -> str:
    client = platform.extras.get("s3_client")
    if client is None:
        import boto3  # lazy: boto3 takes most of a second to import, and only the AWS path needs it

        client = platform.extras.setdefault("s3_client", boto3.client("s3"))
    return client.generate_presigned_url("get_object", Params={"Bucket": platform.settings.media_bucket, "Key": key},
                                         ExpiresIn=platform.config.media.url_ttl_seconds)


def output_url(platform, row: dict) -> str | None:
    """The tenant's URL of one task_output row."""
    if row.get("url"):
        return row["url"]  # the old direct path's row
    key = row["object_key"]
    if platform is None:
        return None
    if platform.settings.media_bucket:
        return presigned_url(platform, key)
    return local_url(platform, key)


def verify(platform, ref: str, expires: Any, sig: Any, *, now: float | None = None) -> str:
    """The key a signed local URL names, or MediaUrlRefused (tampered, expired, malformed)."""
    secret = platform.config.media.url_signing_key
    try:
        key = _unb64(ref).decode()
        exp = int(expires)
    except (ValueError, TypeError, UnicodeDecodeError):
        raise MediaUrlRefused("not a media URL this platform made") from None
    if not isinstance(sig, str) or not hmac.compare_digest(signature(secret, key, exp), sig):
        raise MediaUrlRefused("bad signature")
    if exp < (now if now is not None else time.time()):
        raise MediaUrlRefused("the URL has expired")
    return key


def local_path(platform, key: str) -> Path:
    """The file of a signed key under the media directory: MediaUrlRefused when the key would leave
    it, NotFound when it is not there (removed, or never written)."""
    root = media_root(platform)
    path = (root / key).resolve()
    if not key.startswith("outputs/") or root / "outputs" not in path.parents:
        raise MediaUrlRefused("not a media object")
    if not path.is_file():
        raise NotFound("no such media object")
    return path
