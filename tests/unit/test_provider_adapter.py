"""The HTTP provider adapter's classification table, against a provider that answers every way the
protocol allows and several ways it does not (httpx.MockTransport: no sockets, no provider)."""
import json
import socket
import time
from decimal import Decimal
from email.utils import format_datetime
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from aivedio.config import ProviderAccount, ProviderConfig
from aivedio.providers.adapter import (Accepted, HttpProviderAdapter, NotAcceptedRetryable, ProviderAdapter,
                                       ProviderError, RejectedFinal, SubmitRequest, Unknown, build_adapters,
                                       parse_retry_after)

CONFIG = ProviderConfig(name="prov", base_url="http://provider.test", webhook_secret="whsec_dGVzdA==",
                        accounts=[ProviderAccount(account_id="a1", api_key="key-1"), ProviderAccount(account_id="a2", api_key="key-2")],
                        submit_timeout_seconds=0.5)
REQ = SubmitRequest(model="video-model-x", prompt="a cat", duration_seconds=4, resolution="720p",
                    client_request_id="crid-1", callback_url="http://platform.test/cb")
JOB = {"id": "job_1", "status": "queued", "created_at": "2025-01-01T00:00:00Z"}


def adapter(handler, **kw) -> HttpProviderAdapter:
    return HttpProviderAdapter(CONFIG, transport=httpx.MockTransport(handler), **kw)


def answer(status, body=None, headers=None, raw=None):
    def handler(request):
        content = raw if raw is not None else (json.dumps(body).encode() if body is not None else b"")
        return httpx.Response(status, content=content, headers=headers or {})
    return handler


def raising(exc_type):
    def handler(request):
        raise exc_type("injected", request=request)
    return handler


def submit(handler):
    with adapter(handler) as a:
        return a.submit("a1", "key-abc", REQ)


def test_the_http_adapter_is_a_provider_adapter():
    with adapter(answer(201, JOB)) as a:
        assert isinstance(a, ProviderAdapter)


def test_submit_sends_the_contract_request():
    seen = {}

    def handler(request):
        seen.update(method=request.method, url=str(request.url), auth=request.headers["authorization"],
                    key=request.headers["idempotency-key"], body=json.loads(request.content))
        return httpx.Response(201, json=JOB)

    with adapter(handler) as a:
        a.submit("a2", "key-abc", REQ)
    assert seen["method"] == "POST" and seen["url"] == "http://provider.test/v1/jobs"
    assert seen["auth"] == "Bearer key-2" and seen["key"] == "key-abc"
    assert seen["body"] == {"model": "video-model-x", "prompt": "a cat", "duration_seconds": 4, "resolution": "720p",
                            "with_audio": False, "inputs": [], "client_request_id": "crid-1",
                            "callback_url": "http://platform.test/cb"}


@pytest.mark.parametrize("status, replayed", [(201, False), (200, True)])
def test_201_and_200_are_accepted(status, replayed):
    out = submit(answer(status, JOB))
    assert isinstance(out, Accepted) and out.kind == "ACCEPTED"
    assert (out.job_id, out.status, out.replayed) == ("job_1", "queued", replayed)
    assert out.raw.status == status and json.loads(out.raw.body) == JOB


def test_a_replay_of_a_finished_job_is_still_accepted():
    out = submit(answer(200, {**JOB, "status": "succeeded"}))
    assert isinstance(out, Accepted) and out.status == "succeeded"


@pytest.mark.parametrize("status, body", [
    (201, None), (201, "not json"), (201, ["job_1"]), (201, {"status": "queued"}), (201, {"id": "", "status": "queued"}),
    (201, {"id": True, "status": "queued"}), (201, {"id": "job_1", "status": "pending"}), (201, {"id": "job_1"}),
    (200, {"job": JOB}), (202, JOB), (204, None),
])
def test_a_malformed_2xx_is_unknown(status, body):
    raw = body.encode() if isinstance(body, str) else None
    out = submit(answer(status, body if raw is None else None, raw=raw))
    assert isinstance(out, Unknown) and out.reason == "malformed_response" and out.kind == "UNKNOWN"


DEEP = b"[" * 30_000 + b"]" * 30_000  # JSON nested past the parser's depth: a RecursionError, not a ValueError


def test_a_body_nested_past_the_parsers_depth_is_malformed_not_a_crash():
    out = submit(answer(201, raw=DEEP))
    assert isinstance(out, Unknown) and out.reason == "malformed_response"
    out = submit(answer(422, raw=DEEP))
    assert isinstance(out, RejectedFinal) and out.code == "HTTP_422"
    with adapter(routes({"/v1/jobs/job_1": (200, DEEP)})) as a:
        with pytest.raises(ProviderError) as e:
            a.get("a1", "job_1")
    assert e.value.reason == "malformed_response"


@pytest.mark.parametrize("header, expected", [("3", 3.0), ("0", 0.0), ("1.5", 1.5), ("-4", 0.0), (None, None),
                                              ("soon", None), ("nan", None)])
def test_429_is_retryable_with_retry_after(header, expected):
    out = submit(answer(429, {"error": {"code": "RATE_LIMITED"}}, headers={"Retry-After": header} if header else {}))
    assert isinstance(out, NotAcceptedRetryable) and out.kind == "NOT_ACCEPTED_RETRYABLE"
    assert out.retry_after_seconds == expected and out.reason == "rate_limited"
    if header:
        assert out.raw.headers["retry-after"] == header


def test_retry_after_as_an_http_date():
    when = datetime.now(timezone.utc) + timedelta(seconds=30)
    assert 25 <= parse_retry_after(format_datetime(when, usegmt=True)) <= 31
    assert parse_retry_after(format_datetime(datetime(2000, 1, 1, tzinfo=timezone.utc), usegmt=True)) == 0.0


@pytest.mark.parametrize("status, body, code", [
    (400, {"error": {"code": "MISSING_FIELD", "message": "x"}}, "MISSING_FIELD"),
    (422, {"error": {"code": "UNSUPPORTED_MODEL"}}, "UNSUPPORTED_MODEL"),
    (422, {"code": "FLAT_CODE"}, "FLAT_CODE"),
    (400, None, "HTTP_400"),
    (422, ["odd"], "HTTP_422"),
])
def test_400_and_422_are_final(status, body, code):
    out = submit(answer(status, body))
    assert isinstance(out, RejectedFinal) and out.code == code and out.kind == "REJECTED_FINAL"


@pytest.mark.parametrize("status", [500, 502, 503, 504, 599])
def test_every_5xx_is_unknown_even_with_retry_after(status):
    out = submit(answer(status, {"error": {"code": "X"}}, headers={"Retry-After": "2"}))
    assert isinstance(out, Unknown) and out.reason == "http_5xx"


@pytest.mark.parametrize("status", [301, 302, 304, 401, 403, 404, 405, 408, 409, 410, 413, 415, 418])
def test_any_other_status_is_unknown_because_the_contract_promises_nothing(status):
    out = submit(answer(status, {"error": {"code": "X"}}, headers={"Location": "http://elsewhere.test/"}))
    assert isinstance(out, Unknown) and out.reason == "unexpected_status"


@pytest.mark.parametrize("exc, reason", [
    (httpx.ReadTimeout, "timeout"), (httpx.WriteTimeout, "timeout"),
    (httpx.RemoteProtocolError, "connection_dropped"), (httpx.ReadError, "connection_dropped"),
    (httpx.WriteError, "connection_dropped"), (httpx.ProxyError, "transport_error"),
])
def test_failures_after_the_connection_is_made_are_unknown(exc, reason):
    out = submit(raising(exc))
    assert isinstance(out, Unknown) and out.reason == reason
    assert out.raw.status is None and exc.__name__ in out.raw.error


@pytest.mark.parametrize("exc", [httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout])
def test_no_connection_means_nothing_was_sent(exc):
    out = submit(raising(exc))
    assert isinstance(out, NotAcceptedRetryable) and out.reason == "not_sent" and out.retry_after_seconds is None


def test_a_refused_connection_on_a_real_socket_is_not_sent():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: the connect is refused
        cfg = CONFIG.model_copy(update={"base_url": f"http://127.0.0.1:{port}"})
        with HttpProviderAdapter(cfg) as a:
            out = a.submit("a1", "k", REQ)
    assert isinstance(out, NotAcceptedRetryable) and out.reason == "not_sent"


def test_a_silent_server_times_out_as_unknown():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # accepts (the kernel does), never answers
        cfg = CONFIG.model_copy(update={"base_url": f"http://127.0.0.1:{s.getsockname()[1]}", "submit_timeout_seconds": 0.3})
        t0 = time.monotonic()
        with HttpProviderAdapter(cfg) as a:
            out = a.submit("a1", "k", REQ)
    assert isinstance(out, Unknown) and out.reason == "timeout"
    assert time.monotonic() - t0 < 2


def test_raw_records_a_header_subset_and_truncates_the_body():
    out = submit(answer(201, {**JOB, "pad": "x" * 10_000}, headers={"Set-Cookie": "secret", "X-Request-Id": "r1"}))
    assert isinstance(out, Accepted)
    assert out.raw.headers.get("x-request-id") == "r1" and "set-cookie" not in out.raw.headers
    assert len(out.raw.body) == 4096 and out.raw.body_truncated
    doc = out.raw.as_dict()
    assert json.dumps(doc) and doc["status"] == 201 and doc["method"] == "POST"


def test_an_unknown_account_or_a_missing_key_is_a_programming_error():
    with adapter(answer(201, JOB)) as a:
        with pytest.raises(ValueError):
            a.submit("nope", "k", REQ)
        with pytest.raises(ValueError):
            a.submit("a1", "", REQ)


# --- the other calls ---------------------------------------------------------------------------------

def routes(table, calls=None):
    def handler(request):
        if calls is not None:
            calls.append(request.url.path)
        status, body = table[request.url.path]
        return httpx.Response(status, content=body if isinstance(body, bytes) else json.dumps(body).encode())
    return handler


FULL_JOB = {"id": "job_1", "status": "succeeded", "created_at": "2025-01-01T00:00:00Z", "finished_at": "2025-01-01T00:01:00.5Z",
            "output_url": "http://p/o.mp4", "usage": {"seconds": 4, "cost_amount": "0.4200", "currency": "USD"}, "charge_id": "ch_1"}


def test_get_parses_the_job_and_404_is_none():
    with adapter(routes({"/v1/jobs/job_1": (200, FULL_JOB), "/v1/jobs/nope": (404, {"error": {}})})) as a:
        job = a.get("a1", "job_1")
        assert job.status == "succeeded" and job.terminal and job.usage.cost_amount == Decimal("0.4200")
        assert job.finished_at == datetime(2025, 1, 1, 0, 1, 0, 500000, tzinfo=timezone.utc) and job.charge_id == "ch_1"
        assert a.get("a1", "nope") is None


@pytest.mark.parametrize("status, body, reason", [
    (500, {}, "http_5xx"), (429, {}, "rate_limited"), (401, {}, "unexpected_status"), (200, b"nope", "malformed_response"),
    (200, {**FULL_JOB, "status": "done"}, "malformed_response"), (200, {**FULL_JOB, "id": "job_2"}, "malformed_response"),
    (200, {**FULL_JOB, "usage": {"seconds": 4, "cost_amount": "lots", "currency": "USD"}}, "malformed_response"),
])
def test_get_raises_on_anything_else(status, body, reason):
    with adapter(routes({"/v1/jobs/job_1": (status, body)})) as a:
        with pytest.raises(ProviderError) as e:
            a.get("a1", "job_1")
    assert e.value.reason == reason


def test_get_raises_on_a_transport_failure():
    with adapter(raising(httpx.ReadTimeout)) as a:
        with pytest.raises(ProviderError) as e:
            a.get("a1", "job_1")
    assert e.value.reason == "timeout" and e.value.status is None


def test_find_by_key_returns_items_and_the_cached_window():
    calls: list[str] = []
    table = {"/v1/jobs": (200, {"items": [FULL_JOB]}), "/v1/meta": (200, {"idempotency_window_seconds": 3600})}
    with adapter(routes(table, calls)) as a:
        for _ in range(3):
            found = a.find_by_key("a1", idempotency_key="k")
        assert [j.id for j in found.items] == ["job_1"] and found.idempotency_window_seconds == 3600
        assert calls.count("/v1/meta") == 1 and calls.count("/v1/jobs") == 3
        assert not found.proves_absent(10)


def test_an_empty_lookup_proves_absence_only_inside_the_window():
    table = {"/v1/jobs": (200, {"items": []}), "/v1/meta": (200, {"idempotency_window_seconds": 3600})}
    with adapter(routes(table)) as a:
        found = a.find_by_key("a1", client_request_id="c")
    assert found.items == [] and found.proves_absent(3599) and not found.proves_absent(3600)


def test_without_meta_an_empty_lookup_proves_nothing():
    table = {"/v1/jobs": (200, {"items": []}), "/v1/meta": (503, {})}
    with adapter(routes(table)) as a:
        found = a.find_by_key("a1", idempotency_key="k")
    assert found.idempotency_window_seconds is None and not found.proves_absent(0)


@pytest.mark.parametrize("status, body", [(200, {}), (200, {"items": None}), (200, {"items": [{"id": "x"}]}),
                                          (200, b"[]"), (500, {"items": []}), (404, {"items": []})])
def test_a_failed_or_malformed_lookup_is_never_an_empty_one(status, body):
    table = {"/v1/jobs": (status, body), "/v1/meta": (200, {"idempotency_window_seconds": 3600})}
    with adapter(routes(table)) as a:
        with pytest.raises(ProviderError):
            a.find_by_key("a1", idempotency_key="k")


@pytest.mark.parametrize("window", [0, -5, "3600", 1.5, True, None])
def test_meta_must_state_a_positive_integer_window(window):
    with adapter(routes({"/v1/meta": (200, {"idempotency_window_seconds": window})})) as a:
        with pytest.raises(ProviderError):
            a.meta()


def test_cancel_and_invoices():
    line = {"line_id": "l1", "charge_id": "ch_1", "job_id": "job_1", "idempotency_key": "k", "account_id": "a1",
            "model": "video-model-x", "type": "charge", "amount": "1.2500", "currency": "USD", "occurred_at": "2025-01-01T10:00:00Z"}
    table = {"/v1/jobs/job_1/cancel": (200, {"id": "job_1", "status": "cancelled"}), "/v1/jobs/nope/cancel": (404, {}),
             "/v1/invoices": (200, {"lines": [line, {**line, "type": "credit_note", "line_id": "l2"}]})}
    with adapter(routes(table)) as a:
        assert a.cancel("a1", "job_1").status == "cancelled"
        assert a.cancel("a1", "nope") is None
        inv = a.invoices("2025-01-01")
        assert [(ln.type, ln.amount) for ln in inv.lines] == [("charge", Decimal("1.2500")), ("credit_note", Decimal("1.2500"))]
    bad = {"/v1/invoices": (200, {"lines": [{**line, "type": "refund"}]})}
    with adapter(routes(bad)) as a:
        with pytest.raises(ProviderError):
            a.invoices("2025-01-01")


def test_a_provider_is_a_config_entry():
    second = ProviderConfig(name="prov-b", base_url="http://b.test/", webhook_secret="whsec_dGVzdA==",
                            accounts=[ProviderAccount(account_id="b1", api_key="key-b1")])
    sim = ProviderConfig(name="prov-c")  # no base_url: a built-in simulator supplies it
    adapters = build_adapters([CONFIG, second, sim], {"prov-c": "http://127.0.0.1:9"})
    assert {n: a.base_url for n, a in adapters.items()} == {"prov": "http://provider.test", "prov-b": "http://b.test",
                                                             "prov-c": "http://127.0.0.1:9"}
    for a in adapters.values():
        a.close()
    with pytest.raises(ValueError):
        HttpProviderAdapter(sim)


def test_an_amount_that_would_not_fit_the_database_is_a_malformed_document():
    from aivedio.providers.adapter import MalformedDocument, parse_job

    job = {"id": "job_1", "status": "succeeded", "created_at": "2026-12-01T00:00:00Z",
           "usage": {"seconds": "5", "cost_amount": "1000000000000", "currency": "USD"}}
    with pytest.raises(MalformedDocument, match="out of range"):
        parse_job(job)
    job["usage"]["cost_amount"] = "999999999999.5"
    assert parse_job(job).usage.cost_amount == Decimal("999999999999.5")
