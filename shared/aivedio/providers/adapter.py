"""Provider adapters: the platform's one interface to AI video providers, and the HTTP adapter for
docs/provider-protocol.md.

Every submit ends in exactly one of four outcomes, never an exception for anything the network or
the provider did:

| what came back                                        | outcome                                  |
|-------------------------------------------------------|------------------------------------------|
| 201, or 200 (same key seen before), JSON object with  | Accepted(job_id, status, replayed)       |
|   an `id` and a known `status`                        |                                          |
| 429 (Retry-After parsed when present)                 | NotAcceptedRetryable(reason=rate_limited)|
| no connection was made (refused, connect timeout, no  | NotAcceptedRetryable(reason=not_sent)    |
|   free pooled connection): the request never left     |                                          |
| 400 or 422                                            | RejectedFinal(code)                      |
| any 5xx                                               | Unknown(http_5xx)                        |
| a timeout after the connection was made (write, read, | Unknown(timeout)                         |
|   or the whole answer slower than the submit timeout) |                                          |
| the connection dropped or reset after sending         | Unknown(connection_dropped)              |
| a 2xx that is not 200/201, or whose body is not a job | Unknown(malformed_response)              |
| any other status (1xx, 3xx, 401, 403, 404, 409, ...)  | Unknown(unexpected_status)               |

The contract promises "nothing was created" only for 429, 400 and 422, so every other answer is
UNKNOWN: the caller resolves it by looking the key up, never by submitting blindly.

Durations the provider states (Retry-After, the idempotency window) are passed on as the provider
stated them. The built-in simulator states them in platform seconds (it runs under the platform's
time_scale), as a real provider does in real seconds when time_scale is 1; callers turn them into
waits with Clock.real_seconds.

The other calls (get, find_by_key, cancel, meta, invoices) return parsed documents, None for a 404
where the contract defines one, and raise ProviderError for anything else, so that a failed or
malformed lookup is never mistaken for an empty one.
"""
from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from decimal import Decimal, InvalidOperation
from email.utils import parsedate_to_datetime
from typing import Any, Literal, Protocol, Union, runtime_checkable
from urllib.parse import quote

import httpx

from aivedio.config import ConfigError, ProviderAccount, ProviderConfig
from aivedio.errors import DomainError
from aivedio.providers.webhooks import sign_webhook, verify_webhook  # noqa: F401 - part of this module's API

JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL_STATUSES = ("succeeded", "failed", "cancelled")
LINE_TYPES = ("charge", "credit_note")
RECORDED_HEADERS = ("content-type", "retry-after", "date", "location", "x-request-id", "request-id",
                    "idempotent-replayed", "x-ratelimit-remaining", "x-ratelimit-reset")
RAW_BODY_LIMIT = 4096  # characters of a response body kept for the record
# A job's cost is numeric(20, 8) in PostgreSQL. (An invoice line's amount is checked by the invoice
# reconciler, which turns a bad line into evidence on its document rather than refusing the document.)
MAX_AMOUNT = Decimal(10) ** 12
MAX_RESPONSE_BYTES = 8 * 1024 * 1024  # a bigger answer is abandoned (an invoice can be long)
META_CACHE_SECONDS = 300.0  # real seconds a /v1/meta answer is reused


# --- what was exchanged, for the record --------------------------------------------------------------

@dataclass(frozen=True)
class RawResponse:
    """One exchange as recorded: the request line, what came back (status None when nothing did),
    a subset of the headers, the body truncated, and the transport error if any."""

    method: str
    url: str
    status: int | None
    headers: dict[str, str] = field(default_factory=dict)
    body: str = ""
    body_truncated: bool = False
    elapsed_ms: float = 0.0
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "url": self.url, "status": self.status, "headers": dict(self.headers),
                "body": self.body, "body_truncated": self.body_truncated, "elapsed_ms": self.elapsed_ms,
                "error": self.error}


# --- submit outcomes -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Accepted:
    job_id: str
    status: str
    raw: RawResponse
    replayed: bool = False  # 200: the provider had seen this key and returned the job it created then
    kind: Literal["ACCEPTED"] = "ACCEPTED"


@dataclass(frozen=True)
class NotAcceptedRetryable:
    retry_after_seconds: float | None  # as the provider said it; None when it did not say
    raw: RawResponse
    reason: Literal["rate_limited", "not_sent"] = "rate_limited"
    kind: Literal["NOT_ACCEPTED_RETRYABLE"] = "NOT_ACCEPTED_RETRYABLE"


@dataclass(frozen=True)
class RejectedFinal:
    code: str  # the provider's error.code, else HTTP_400 / HTTP_422
    raw: RawResponse
    kind: Literal["REJECTED_FINAL"] = "REJECTED_FINAL"


@dataclass(frozen=True)
class Unknown:
    reason: str  # timeout | connection_dropped | http_5xx | malformed_response | unexpected_status | too_large | transport_error
    raw: RawResponse
    kind: Literal["UNKNOWN"] = "UNKNOWN"


SubmitOutcome = Union[Accepted, NotAcceptedRetryable, RejectedFinal, Unknown]


# --- documents -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SubmitRequest:
    model: str
    prompt: str
    duration_seconds: float
    resolution: str
    client_request_id: str
    with_audio: bool = False
    inputs: list[Any] = field(default_factory=list)
    callback_url: str | None = None

    def body(self) -> dict[str, Any]:
        doc = {"model": self.model, "prompt": self.prompt, "duration_seconds": self.duration_seconds,
               "resolution": self.resolution, "with_audio": self.with_audio, "inputs": list(self.inputs),
               "client_request_id": self.client_request_id}
        if self.callback_url is not None:
            doc["callback_url"] = self.callback_url
        return doc


@dataclass(frozen=True)
class Usage:
    seconds: float
    cost_amount: Decimal
    currency: str


@dataclass(frozen=True)
class JobError:
    code: str
    message: str


@dataclass(frozen=True)
class ProviderJob:
    id: str
    status: str
    created_at: datetime | None
    finished_at: datetime | None = None
    output_url: str | None = None
    error: JobError | None = None
    usage: Usage | None = None
    charge_id: str | None = None
    doc: dict[str, Any] = field(default_factory=dict, compare=False)  # the job as the provider sent it

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


@dataclass(frozen=True)
class Lookup:
    """Jobs found by idempotency key or client_request_id, with the provider's idempotency window
    (None when /v1/meta could not be read: then an empty list proves nothing)."""

    items: list[ProviderJob]
    idempotency_window_seconds: int | None
    raw: RawResponse

    def proves_absent(self, key_age_seconds: float) -> bool:
        """The contract's one way to know a job does not exist: an empty answer for a key younger
        than the provider's window. Pass the age from the *first* send of the key, in the window's
        unit, with whatever safety margin the caller wants already added."""
        return (not self.items and self.idempotency_window_seconds is not None
                and 0 <= key_age_seconds < self.idempotency_window_seconds)


@dataclass(frozen=True)
class CancelResult:
    job_id: str
    status: str
    raw: RawResponse


@dataclass(frozen=True)
class ProviderMeta:
    idempotency_window_seconds: int
    raw: RawResponse


@dataclass(frozen=True)
class InvoiceLine:
    line_id: str
    charge_id: str
    account_id: str
    model: str
    type: str  # charge | credit_note (a credit note's amount is what is credited back)
    amount: Decimal
    currency: str
    occurred_at: datetime
    job_id: str | None = None
    idempotency_key: str | None = None


@dataclass(frozen=True)
class Invoice:
    date: date
    lines: list[InvoiceLine]
    raw: RawResponse
    body: bytes = b""  # the document exactly as received (raw.body is truncated): what the invoice archive keeps


class ProviderError(DomainError):
    """A provider call other than submit did not give a usable answer (transport error, 5xx,
    unexpected status, malformed body). `raw` is the exchange; `status` is None when nothing came back."""

    code = "PROVIDER_ERROR"

    def __init__(self, message: str, raw: RawResponse, reason: str, body: bytes | None = None):
        super().__init__(message, details={"reason": reason, "status": raw.status})
        self.raw, self.reason, self.status = raw, reason, raw.status
        self.body = body  # a malformed answer's whole body, where the caller archives it (invoices)


class MalformedDocument(ValueError):
    pass


# --- the interface ------------------------------------------------------------------------------------

@runtime_checkable
class ProviderAdapter(Protocol):
    """What the platform needs from a provider. `account_id` names the ProviderAccount whose
    credentials a call uses; a job is owned by the account that submitted it."""

    name: str

    def submit(self, account_id: str, provider_request_key: str, request: SubmitRequest) -> SubmitOutcome: ...

    def get(self, account_id: str, job_id: str) -> ProviderJob | None: ...

    def find_by_key(self, account_id: str, *, idempotency_key: str | None = None,
                    client_request_id: str | None = None) -> Lookup: ...

    def cancel(self, account_id: str, job_id: str) -> CancelResult | None: ...

    def meta(self, account_id: str | None = None) -> ProviderMeta: ...

    def invoices(self, day: date | str, account_id: str | None = None) -> Invoice: ...

    def close(self) -> None: ...


# --- parsing -------------------------------------------------------------------------------------------

def _decimal(v: Any, what: str, *, bounded: bool = False) -> Decimal:
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise MalformedDocument(f"{what}: expected a decimal string")
    try:
        d = Decimal(str(v))
    except InvalidOperation:
        raise MalformedDocument(f"{what}: {v!r} is not a decimal") from None
    if not d.is_finite():
        raise MalformedDocument(f"{what}: {v!r} is not finite")
    if bounded and abs(d) >= MAX_AMOUNT:  # it would not fit numeric(20, 8), where costs are kept
        raise MalformedDocument(f"{what}: {v!r} is out of range (at most {MAX_AMOUNT - 1})")
    return d


def _str(v: Any, what: str, optional: bool = False) -> str | None:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (str, int)) or (isinstance(v, str) and not v):
        raise MalformedDocument(f"{what}: expected a non-empty string")
    return str(v)


def _time(v: Any, what: str, optional: bool = True) -> datetime | None:
    if v is None and optional:
        return None
    if not isinstance(v, str):
        raise MalformedDocument(f"{what}: expected an ISO 8601 timestamp")
    try:
        t = datetime.fromisoformat(v.replace("Z", "+00:00") if v.endswith("Z") else v)
    except ValueError:
        raise MalformedDocument(f"{what}: {v!r} is not an ISO 8601 timestamp") from None
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


def parse_job(doc: Any) -> ProviderJob:
    """A job document of the contract; MalformedDocument when it is not one."""
    if not isinstance(doc, dict):
        raise MalformedDocument("job: expected a JSON object")
    job_id = _str(doc.get("id"), "id")
    status = doc.get("status")
    if status not in JOB_STATUSES:
        raise MalformedDocument(f"status: {status!r} is not one of {', '.join(JOB_STATUSES)}")
    error = None
    if doc.get("error") is not None:
        e = doc["error"]
        if not isinstance(e, dict):
            raise MalformedDocument("error: expected an object")
        error = JobError(code=str(e.get("code") or "UNKNOWN"), message=str(e.get("message") or ""))
    usage = None
    if doc.get("usage") is not None:
        u = doc["usage"]
        if not isinstance(u, dict):
            raise MalformedDocument("usage: expected an object")
        secs = u.get("seconds", 0)
        if isinstance(secs, bool) or not isinstance(secs, (int, float, str)):
            raise MalformedDocument("usage.seconds: expected a number")
        usage = Usage(seconds=float(_decimal(secs, "usage.seconds")),
                      cost_amount=_decimal(u.get("cost_amount"), "usage.cost_amount", bounded=True),
                      currency=_str(u.get("currency"), "usage.currency"))
    output_url = doc.get("output_url")
    if output_url is not None and not isinstance(output_url, str):
        raise MalformedDocument("output_url: expected a string")
    return ProviderJob(id=job_id, status=status, created_at=_time(doc.get("created_at"), "created_at"),
                       finished_at=_time(doc.get("finished_at"), "finished_at"), output_url=output_url or None,
                       error=error, usage=usage, charge_id=_str(doc.get("charge_id"), "charge_id", optional=True), doc=doc)


def parse_invoice_line(doc: Any) -> InvoiceLine:
    if not isinstance(doc, dict):
        raise MalformedDocument("invoice line: expected a JSON object")
    kind = doc.get("type")
    if kind not in LINE_TYPES:
        raise MalformedDocument(f"type: {kind!r} is not one of {', '.join(LINE_TYPES)}")
    occurred = _time(doc.get("occurred_at"), "occurred_at", optional=False)
    assert occurred is not None
    return InvoiceLine(line_id=_str(doc.get("line_id"), "line_id"), charge_id=_str(doc.get("charge_id"), "charge_id"),
                       account_id=_str(doc.get("account_id"), "account_id"), model=_str(doc.get("model"), "model"),
                       type=kind, amount=_decimal(doc.get("amount"), "amount"), currency=_str(doc.get("currency"), "currency"),
                       occurred_at=occurred, job_id=_str(doc.get("job_id"), "job_id", optional=True),
                       idempotency_key=_str(doc.get("idempotency_key"), "idempotency_key", optional=True))


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Retry-After as seconds: delta-seconds (a decimal is tolerated) or an HTTP-date; None when
    absent or unreadable. Never negative."""
    if value is None:
        return None
    v = value.strip()
    try:
        secs = float(v)
        return max(0.0, secs) if math.isfinite(secs) else None
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(v)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _error_code(body: str, status: int) -> str:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: a body nested past the parser's depth
        return f"HTTP_{status}"
    if isinstance(doc, dict):
        err = doc.get("error")
        code = err.get("code") if isinstance(err, dict) else doc.get("code")
        if isinstance(code, str) and code:
            return code[:100]
    return f"HTTP_{status}"


# --- the HTTP adapter ----------------------------------------------------------------------------------

class _Exchange:
    """The result of one HTTP exchange: the response (status, headers, body) or the transport error."""

    def __init__(self, raw: RawResponse, body: bytes | None, sent: bool, error_kind: str | None):
        self.raw, self.body, self.sent, self.error_kind = raw, body, sent, error_kind

    @property
    def status(self) -> int | None:
        return self.raw.status

    def json(self) -> Any:
        if self.body is None:
            raise MalformedDocument("no body")
        try:
            return json.loads(self.body)
        except (ValueError, RecursionError):  # RecursionError: a body nested past the parser's depth
            raise MalformedDocument("body is not JSON") from None


class HttpProviderAdapter:
    """The adapter for docs/provider-protocol.md. One per provider config entry: a second
    provider that speaks the protocol is another entry, not more code.

    `base_url` overrides the config's (a built-in simulator's address is only known once it runs).
    `transport` is for tests (httpx.MockTransport). Thread-safe: one pooled httpx client."""

    def __init__(self, provider_config: ProviderConfig, base_url: str | None = None, *,
                 transport: httpx.BaseTransport | None = None, meta_cache_seconds: float = META_CACHE_SECONDS,
                 max_connections: int = 100):
        url = base_url or provider_config.base_url
        if not url or not url.startswith(("http://", "https://")):
            raise ValueError(f"provider {provider_config.name}: no http(s) base_url to talk to")
        if not provider_config.has_credentials:  # a function loaded without the provider secret
            raise ConfigError(f"providers.{provider_config.name}: no credentials in this process (AIVEDIO_PROVIDER_SECRET_ARN "
                              "is not set for it)")
        self.config = provider_config
        self.name = provider_config.name
        self.base_url = url.rstrip("/")
        self.timeout_seconds = provider_config.submit_timeout_seconds
        self._accounts: dict[str, ProviderAccount] = {a.account_id: a for a in provider_config.accounts}
        t = self.timeout_seconds
        self._client = httpx.Client(
            timeout=httpx.Timeout(connect=t, read=t, write=t, pool=t),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=min(20, max_connections),
                                keepalive_expiry=5.0),  # below any sane server idle timeout: fewer stale-connection races
            follow_redirects=False,
            transport=transport,
            headers={"User-Agent": "aivedio-provider-adapter/1", "Accept": "application/json"},
        )
        self._meta_cache_seconds = meta_cache_seconds
        self._meta: tuple[float, ProviderMeta] | None = None
        self._meta_lock = threading.Lock()

    # -- plumbing --

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "HttpProviderAdapter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _account(self, account_id: str | None) -> ProviderAccount:
        if account_id is None:
            return self.config.accounts[0]
        try:
            return self._accounts[account_id]
        except KeyError:
            raise ValueError(f"provider {self.name}: no account {account_id!r} in its config") from None

    def _exchange(self, method: str, path: str, account_id: str | None, *, params: dict[str, str] | None = None,
                  json_body: Any = None, headers: Mapping[str, str] | None = None) -> _Exchange:
        """One request with an overall deadline of the configured timeout; never raises for what
        the network or the provider does."""
        account = self._account(account_id)
        hdrs = {"Authorization": f"Bearer {account.api_key}"}
        content = None
        if json_body is not None:
            content = json.dumps(json_body, separators=(",", ":")).encode("utf-8")
            hdrs["Content-Type"] = "application/json"
        hdrs.update(headers or {})
        url = self.base_url + path
        shown_url = url + ("?" + "&".join(f"{k}={quote(str(v), safe='')}" for k, v in params.items()) if params else "")
        t0 = time.monotonic()
        deadline = t0 + self.timeout_seconds
        status: int | None = None
        rec_headers: dict[str, str] = {}

        def raw(body: bytes | None, error: str | None) -> RawResponse:
            text = (body or b"").decode("utf-8", "replace")
            return RawResponse(method=method, url=shown_url, status=status, headers=rec_headers,
                               body=text[:RAW_BODY_LIMIT], body_truncated=len(text) > RAW_BODY_LIMIT,
                               elapsed_ms=round((time.monotonic() - t0) * 1000, 1), error=error)

        try:
            with self._client.stream(method, url, params=params, content=content, headers=hdrs) as resp:
                status = resp.status_code
                rec_headers = {k: resp.headers[k] for k in RECORDED_HEADERS if k in resp.headers}
                chunks: list[bytes] = []
                size = 0
                for chunk in resp.iter_bytes():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > MAX_RESPONSE_BYTES:
                        return _Exchange(raw(b"".join(chunks), "response too large"), None, True, "too_large")
                    if time.monotonic() > deadline:
                        return _Exchange(raw(b"".join(chunks), "deadline passed while reading the body"), None, True, "timeout")
                body = b"".join(chunks)
                return _Exchange(raw(body, None), body, True, None)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as e:
            # No connection was made, so no byte of the request left: the provider saw nothing.
            return _Exchange(raw(None, f"{type(e).__name__}: {e}"), None, False, "not_sent")
        except httpx.TimeoutException as e:
            return _Exchange(raw(None, f"{type(e).__name__}: {e}"), None, True, "timeout")
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.CloseError) as e:
            return _Exchange(raw(None, f"{type(e).__name__}: {e}"), None, True, "connection_dropped")
        except (httpx.HTTPError, OSError) as e:
            return _Exchange(raw(None, f"{type(e).__name__}: {e}"), None, True, "transport_error")

    # -- submit --

    def submit(self, account_id: str, provider_request_key: str, request: SubmitRequest) -> SubmitOutcome:
        if not provider_request_key or len(provider_request_key) > 255 or not provider_request_key.isascii() \
                or not provider_request_key.isprintable():
            raise ValueError("provider_request_key: 1 to 255 printable ASCII characters, stable for the attempt")
        ex = self._exchange("POST", "/v1/jobs", account_id, json_body=request.body(),
                            headers={"Idempotency-Key": provider_request_key})
        return classify_submit(ex)

    # -- reads and cancel --

    def _document(self, ex: _Exchange, what: str, allow_404: bool = False) -> Any:
        if ex.status is None:
            raise ProviderError(f"{self.name} {what}: {ex.raw.error}", ex.raw, ex.error_kind or "transport_error")
        if ex.status == 404 and allow_404:
            return None
        if ex.error_kind is not None:
            raise ProviderError(f"{self.name} {what}: {ex.raw.error}", ex.raw, ex.error_kind)
        if ex.status != 200:
            reason = "http_5xx" if ex.status >= 500 else "rate_limited" if ex.status == 429 else "unexpected_status"
            raise ProviderError(f"{self.name} {what}: HTTP {ex.status}", ex.raw, reason)
        try:
            return ex.json()
        except MalformedDocument as e:
            raise ProviderError(f"{self.name} {what}: {e}", ex.raw, "malformed_response", ex.body) from None

    def _malformed(self, ex: _Exchange, what: str, e: Exception) -> ProviderError:
        return ProviderError(f"{self.name} {what}: {e}", ex.raw, "malformed_response", ex.body)

    def get(self, account_id: str, job_id: str) -> ProviderJob | None:
        ex = self._exchange("GET", f"/v1/jobs/{quote(job_id, safe='')}", account_id)
        doc = self._document(ex, "get job", allow_404=True)
        if doc is None:
            return None
        try:
            job = parse_job(doc)
        except MalformedDocument as e:
            raise self._malformed(ex, "get job", e) from None
        if job.id != job_id:
            raise self._malformed(ex, "get job", ValueError(f"asked for {job_id!r}, got {job.id!r}"))
        return job

    def find_by_key(self, account_id: str, *, idempotency_key: str | None = None,
                    client_request_id: str | None = None) -> Lookup:
        if (idempotency_key is None) == (client_request_id is None):
            raise ValueError("find_by_key: give exactly one of idempotency_key and client_request_id")
        params = {"idempotency_key": idempotency_key} if idempotency_key is not None else {"client_request_id": client_request_id}
        ex = self._exchange("GET", "/v1/jobs", account_id, params=params)  # type: ignore[arg-type]
        doc = self._document(ex, "find jobs")
        try:
            if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
                raise MalformedDocument("expected {\"items\": [...]}")
            items = [parse_job(j) for j in doc["items"]]
        except MalformedDocument as e:
            raise self._malformed(ex, "find jobs", e) from None
        try:
            window: int | None = self.meta(account_id).idempotency_window_seconds
        except ProviderError:
            window = None
        return Lookup(items=items, idempotency_window_seconds=window, raw=ex.raw)

    def cancel(self, account_id: str, job_id: str) -> CancelResult | None:
        ex = self._exchange("POST", f"/v1/jobs/{quote(job_id, safe='')}/cancel", account_id)
        doc = self._document(ex, "cancel job", allow_404=True)
        if doc is None:
            return None
        if not isinstance(doc, dict) or doc.get("status") not in JOB_STATUSES or not doc.get("id"):
            raise self._malformed(ex, "cancel job", ValueError("expected {\"id\", \"status\"}"))
        return CancelResult(job_id=str(doc["id"]), status=doc["status"], raw=ex.raw)

    def meta(self, account_id: str | None = None, *, refresh: bool = False) -> ProviderMeta:
        with self._meta_lock:
            if not refresh and self._meta is not None and time.monotonic() - self._meta[0] < self._meta_cache_seconds:
                return self._meta[1]
        ex = self._exchange("GET", "/v1/meta", account_id)
        doc = self._document(ex, "meta")
        window = doc.get("idempotency_window_seconds") if isinstance(doc, dict) else None
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise self._malformed(ex, "meta", ValueError("idempotency_window_seconds: expected a positive integer"))
        meta = ProviderMeta(idempotency_window_seconds=window, raw=ex.raw)
        with self._meta_lock:
            self._meta = (time.monotonic(), meta)
        return meta

    def invoices(self, day: date | str, account_id: str | None = None) -> Invoice:
        d = day if isinstance(day, date) else date.fromisoformat(day)
        ex = self._exchange("GET", "/v1/invoices", account_id, params={"date": d.isoformat()})
        doc = self._document(ex, "invoices")
        try:
            if not isinstance(doc, dict) or not isinstance(doc.get("lines"), list):
                raise MalformedDocument("expected {\"lines\": [...]}")
            lines = [parse_invoice_line(x) for x in doc["lines"]]
        except MalformedDocument as e:
            raise self._malformed(ex, "invoices", e) from None
        return Invoice(date=d, lines=lines, raw=ex.raw, body=ex.body or b"")


def classify_submit(ex: _Exchange) -> SubmitOutcome:
    """The classification table of this module's docstring."""
    raw = ex.raw
    status = ex.status
    if status is None:
        if ex.error_kind == "not_sent":
            return NotAcceptedRetryable(retry_after_seconds=None, raw=raw, reason="not_sent")
        return Unknown(reason=ex.error_kind or "transport_error", raw=raw)
    # The status line alone settles these, even if the body then failed to arrive.
    if status == 429:
        return NotAcceptedRetryable(retry_after_seconds=parse_retry_after(raw.headers.get("retry-after")), raw=raw)
    if status in (400, 422):
        return RejectedFinal(code=_error_code(raw.body, status), raw=raw)
    if status >= 500:
        return Unknown(reason="http_5xx", raw=raw)
    if status not in (200, 201):
        return Unknown(reason="malformed_response" if 200 <= status < 300 else "unexpected_status", raw=raw)
    if ex.error_kind is not None:  # a 2xx whose body never fully arrived
        return Unknown(reason=ex.error_kind, raw=raw)
    try:
        doc = ex.json()
        if not isinstance(doc, dict):
            raise MalformedDocument("expected a JSON object")
        job_id = _str(doc.get("id"), "id")
        job_status = doc.get("status")
        if job_status not in JOB_STATUSES:
            raise MalformedDocument(f"status: {job_status!r}")
    except MalformedDocument:
        return Unknown(reason="malformed_response", raw=raw)
    return Accepted(job_id=job_id, status=job_status, raw=raw, replayed=status == 200)  # type: ignore[arg-type]


# --- registry ------------------------------------------------------------------------------------------

def build_adapters(providers: list[ProviderConfig], base_urls: Mapping[str, str] | None = None,
                   **kw: Any) -> dict[str, HttpProviderAdapter]:
    """One adapter per provider config entry; `base_urls` supplies the address of providers whose
    entry has none (the built-in simulators)."""
    base_urls = base_urls or {}
    return {p.name: HttpProviderAdapter(p, base_urls.get(p.name) or p.base_url, **kw) for p in providers}
