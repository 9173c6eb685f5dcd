"""The local API Gateway adapter builds the REST (v1) proxy event API Gateway would send, and reads
a proxy response back the way API Gateway does."""
import base64
import json
from datetime import datetime, timezone

import pytest

from aivedio_tools.local.apigw import MalformedProxyResponse, from_response, to_event

NOW = datetime(2026, 6, 24, 8, 5, 0, tzinfo=timezone.utc)


def test_get_without_query_or_body():
    ev = to_event("get", "/healthz", "", [("Host", "127.0.0.1:8080")], b"", request_id="r-1", now=NOW)
    assert ev["httpMethod"] == "GET"
    assert ev["path"] == ev["resource"] == "/healthz"
    assert ev["queryStringParameters"] is None and ev["multiValueQueryStringParameters"] is None
    assert ev["pathParameters"] is None
    assert ev["body"] is None and ev["isBase64Encoded"] is False
    rc = ev["requestContext"]
    assert rc["requestId"] == "r-1"
    assert rc["stage"] == "local"
    assert rc["identity"]["sourceIp"] == "127.0.0.1"
    assert rc["requestTimeEpoch"] == int(NOW.timestamp() * 1000)
    assert rc["requestTime"] == "24/Jun/2026:08:05:00 +0000"
    assert rc["path"] == "/healthz"  # no stage prefix, so Swagger's base path stays "/"


def test_query_is_decoded_last_wins_single_and_complete_multi():
    ev = to_event("GET", "/v1/generations", "state=QUEUED&state=RUNNING&q=a%20b%26c&empty=", [], b"")
    assert ev["queryStringParameters"] == {"state": "RUNNING", "q": "a b&c", "empty": ""}
    assert ev["multiValueQueryStringParameters"] == {"state": ["QUEUED", "RUNNING"], "q": ["a b&c"], "empty": [""]}


def test_headers_keep_case_and_repeats():
    headers = [("Content-Type", "application/json"), ("X-Tag", "a"), ("X-Tag", "b"), ("User-Agent", "t/1")]
    ev = to_event("POST", "/x", "", headers, b"{}", source_ip="10.1.2.3")
    assert ev["headers"] == {"Content-Type": "application/json", "X-Tag": "b", "User-Agent": "t/1"}
    assert ev["multiValueHeaders"]["X-Tag"] == ["a", "b"]
    assert ev["requestContext"]["identity"] == {"sourceIp": "10.1.2.3", "userAgent": "t/1"}


def test_headers_as_mapping():
    ev = to_event("GET", "/", "", {"Authorization": "Bearer k"}, b"")
    assert ev["multiValueHeaders"] == {"Authorization": ["Bearer k"]}


def test_text_body_is_passed_as_str():
    body = json.dumps({"prompt": "un renard roux dans la neige ❄"}).encode()
    ev = to_event("POST", "/v1/quotes", "", [], body)
    assert ev["isBase64Encoded"] is False
    assert ev["body"] == body.decode()


def test_binary_body_is_base64():
    body = bytes(range(256))
    ev = to_event("PUT", "/blob", "", [], body)
    assert ev["isBase64Encoded"] is True
    assert base64.b64decode(ev["body"]) == body


def test_percent_encoded_path_is_decoded():
    assert to_event("GET", "/a%20b/c", "", [], b"")["path"] == "/a b/c"


def test_response_with_multi_value_headers_wins_over_single():
    resp = from_response({
        "statusCode": 201,
        "headers": {"Content-Type": "application/json", "X-One": "single"},
        "multiValueHeaders": {"x-one": ["m1", "m2"], "Set-Cookie": ["a=1", "b=2"]},
        "body": '{"ok":true}',
        "isBase64Encoded": False,
    })
    assert resp.status == 201
    assert ("Content-Type", "application/json") in resp.headers
    assert [v for k, v in resp.headers if k.lower() == "x-one"] == ["m1", "m2"]
    assert [v for k, v in resp.headers if k == "Set-Cookie"] == ["a=1", "b=2"]
    assert resp.body == b'{"ok":true}'
    assert resp.header("content-type") == "application/json"


def test_response_base64_body_is_decoded():
    raw = b"\x00\xffbinary"
    resp = from_response({"statusCode": 200, "body": base64.b64encode(raw).decode(), "isBase64Encoded": True})
    assert resp.body == raw


def test_response_defaults():
    resp = from_response({"statusCode": 204})
    assert (resp.status, resp.headers, resp.body) == (204, [], b"")


@pytest.mark.parametrize("bad", [None, "text", {"statusCode": "x"}, {"statusCode": 200, "body": {"a": 1}},
                                 {"statusCode": 200, "body": "***", "isBase64Encoded": True}])
def test_malformed_responses_are_rejected(bad):
    with pytest.raises(MalformedProxyResponse):
        from_response(bad)


def test_event_drives_the_real_api_handler_to_a_404(platform):
    from aivedio_tools.local.lambda_context import FakeLambdaContext
    from functions.api.handler import lambda_handler

    out = from_response(lambda_handler(to_event("GET", "/no/such/route", "", [], b""), FakeLambdaContext("api")))
    assert out.status == 404
    body = json.loads(out.body)
    assert body["error"] == "NOT_FOUND" and isinstance(body["message"], str) and body["details"] == {}
