"""The local API Gateway stand-in: every method reaches the handler as a proxy event, the 10 MiB
payload limit answers 413, and a handler that fails answers 502, as API Gateway does."""
import base64
import http.client
import json
import socket
import threading

import pytest

from aivedio.local.http_server import MAX_BODY_BYTES, LambdaHttpServer


def echo_handler(event, context):
    if event["path"] == "/raise":
        raise RuntimeError("boom")
    if event["path"] == "/malformed":
        return "not a dict"
    if event["path"] == "/binary":
        return {"statusCode": 200, "isBase64Encoded": True, "body": base64.b64encode(b"\x00\x01\xff").decode(),
                "multiValueHeaders": {"Content-Type": ["application/octet-stream"]}}
    doc = {
        "method": event["httpMethod"],
        "path": event["path"],
        "query": event["multiValueQueryStringParameters"],
        "body": event["body"],
        "b64": event["isBase64Encoded"],
        "tag": (event["multiValueHeaders"] or {}).get("X-Tag"),
        "remaining_ms": context.get_remaining_time_in_millis(),
        "request_id": context.aws_request_id,
        "arn": context.invoked_function_arn,
    }
    return {"statusCode": 200, "headers": {"Content-Type": "application/json"},
            "multiValueHeaders": {"Set-Cookie": ["a=1", "b=2"]}, "body": json.dumps(doc)}


@pytest.fixture
def server():
    s = LambdaHttpServer(("127.0.0.1", 0), echo_handler, function_name="echo")
    s.start()
    yield s
    s.stop()


def request(server, method, path, body=None, headers=None):
    host, port = server.server_address[:2]
    c = http.client.HTTPConnection(host, port, timeout=10)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.getheaders(), r.read()
    finally:
        c.close()


@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
def test_every_method_reaches_the_handler(server, method):
    status, headers, body = request(server, method, "/v1/things?x=1&x=2", body=b'{"a":1}' if method != "GET" else None,
                                    headers={"X-Tag": "t"})
    assert status == 200
    doc = json.loads(body)
    assert doc["method"] == method and doc["path"] == "/v1/things" and doc["query"] == {"x": ["1", "2"]}
    assert doc["tag"] == ["t"]
    assert 0 < doc["remaining_ms"] <= 29_000
    assert doc["arn"].endswith(":function:echo")
    assert [v for k, v in headers if k == "Set-Cookie"] == ["a=1", "b=2"]


def test_head_has_no_body(server):
    status, headers, body = request(server, "HEAD", "/x")
    assert status == 200 and body == b""
    assert int(dict(headers)["Content-Length"]) > 0


def test_binary_request_and_response(server):
    status, _, body = request(server, "POST", "/echo", body=b"\xff\xfe\x00")
    assert json.loads(body)["b64"] is True
    status, headers, body = request(server, "GET", "/binary")
    assert body == b"\x00\x01\xff" and dict(headers)["Content-Type"] == "application/octet-stream"


def test_chunked_body(server):
    host, port = server.server_address[:2]
    c = http.client.HTTPConnection(host, port, timeout=10)
    c.request("POST", "/chunked", body=iter([b'{"a":', b"1}"]), encode_chunked=True,
              headers={"Transfer-Encoding": "chunked"})
    doc = json.loads(c.getresponse().read())
    c.close()
    assert doc["body"] == '{"a":1}'


def test_body_over_10_mib_is_413(server):
    host, port = server.server_address[:2]
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(f"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    doc = json.loads(body)
    assert doc["error"] == "PAYLOAD_TOO_LARGE" and doc["message"] == "Request Too Long"


def test_body_of_exactly_10_mib_passes(server):
    status, _, body = request(server, "POST", "/big", body=b"a" * MAX_BODY_BYTES)
    assert status == 200 and len(json.loads(body)["body"]) == MAX_BODY_BYTES


@pytest.mark.parametrize("path", ["/raise", "/malformed"])
def test_failing_handler_is_502(server, path):
    status, _, body = request(server, "GET", path)
    assert status == 502
    assert json.loads(body)["error"] == "INTERNAL"


def test_keep_alive_serves_several_requests_on_one_connection(server):
    host, port = server.server_address[:2]
    c = http.client.HTTPConnection(host, port, timeout=10)
    for i in range(3):
        c.request("GET", f"/n{i}")
        assert json.loads(c.getresponse().read())["path"] == f"/n{i}"
    c.close()


def test_invocations_run_concurrently():
    # Each request has its own thread, as concurrent Lambda environments would: five requests that
    # each wait for all five to be inside the handler complete only if none waits for another.
    barrier = threading.Barrier(5, timeout=5)

    def gathered(event, context):
        barrier.wait()
        return {"statusCode": 200, "body": "ok"}

    s = LambdaHttpServer(("127.0.0.1", 0), gathered)
    s.start()
    statuses = []
    try:
        threads = [threading.Thread(target=lambda: statuses.append(request(s, "GET", "/")[0])) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        s.stop()
    assert statuses == [200] * 5
