"""The local API Gateway stand-in: every method reaches the handler as a proxy event, the 10 MiB
payload limit answers 413, and a handler that fails answers 502, as API Gateway does. The header
block is read by read_headers (not the email package): repeats kept in order, names in any case,
and a malformed block refused before any handler sees it."""
import base64
import http.client
import io
import json
import socket
import threading

import pytest

from aivedio import gateway_errors

from aivedio_tools.local.http_server import MAX_BODY_BYTES, LambdaHttpServer, read_headers


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


@pytest.mark.parametrize("size", [b"-1", b"+5", b"0x10", b"1_0", b" ", b"123456789"])
def test_a_chunk_size_that_is_not_plain_hex_is_400(server, size):
    """A size of -1 used to read to the end of the stream, past the body cap."""
    host, port = server.server_address[:2]
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"POST /chunked HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + size + b"\r\nabcde\r\n0\r\n\r\n")
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    assert json.loads(body)["error"] == "BAD_REQUEST"


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
    # The body API Gateway's REQUEST_TOO_LARGE response gives in AWS (the CDK app deploys the same table).
    assert doc == gateway_errors.body(gateway_errors.GATEWAY_ERRORS["REQUEST_TOO_LARGE"])


def test_body_of_exactly_10_mib_passes(server):
    status, _, body = request(server, "POST", "/big", body=b"a" * MAX_BODY_BYTES)
    assert status == 200 and len(json.loads(body)["body"]) == MAX_BODY_BYTES


@pytest.mark.parametrize("path", ["/raise", "/malformed"])
def test_failing_handler_is_502(server, path):
    status, _, body = request(server, "GET", path)
    assert status == 502
    doc = json.loads(body)
    assert doc["error"] == "INTERNAL" and set(doc) == {"error", "message", "details"} and doc["details"]["request_id"]


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


# --- the request's header block (read_headers: the email package's parser is not used) ---------------

def raw(server, data: bytes) -> bytes:
    """Send bytes as they are; everything the server answers until it closes (or 5 s pass)."""
    host, port = server.server_address[:2]
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        return out


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def test_headers_reach_the_event_in_order_with_repeats_and_any_case(server):
    answer = raw(server, b"GET /h HTTP/1.1\r\nHost: x\r\nX-Tag: one\r\nX-Tag:   two  \r\nConnection: close\r\n\r\n")
    assert status_of(answer) == 200
    # Every value of a repeated header, in order, each without its leading blanks.
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["tag"] == ["one", "two  "]
    h = read_headers(io.BytesIO(b"x-tag: one\r\nX-Tag: two\r\nContent-Length: 3\r\n\r\nabc"))
    assert h.items() == [("x-tag", "one"), ("X-Tag", "two"), ("Content-Length", "3")]
    assert h.get("X-TAG") == "one" and h["content-length"] == "3" and "CONTENT-LENGTH" in h and h.get("nope") is None


def test_an_obsolete_folded_line_continues_the_header_before_it():
    h = read_headers(io.BytesIO(b"X-Long: first\r\n   second\r\n\tthird\r\n\r\n"))
    assert h.items() == [("X-Long", "first second third")]


@pytest.mark.parametrize("block, status", [
    (b"NoColonHere\r\n\r\n", 400),
    (b"Bad Name: v\r\n\r\n", 400),          # no blank inside or before the name's colon
    (b": no name\r\n\r\n", 400),
    (b" starts-folded: v\r\nHost: x\r\n\r\n", 400),  # a continuation with nothing to continue
    (b"".join(b"X-%d: v\r\n" % i for i in range(101)) + b"\r\n", 431),
    (b"X-Big: " + b"a" * 70000 + b"\r\n\r\n", 431),
    (b"X-Fold: a\r\n" + b" b\r\n" * 100 + b"\r\n", 431),  # folded lines count too
    (b"".join(b"X-%d: " % i + b"v" * 1000 + b"\r\n" for i in range(70)) + b"\r\n", 431),  # 70 KB in all
])
def test_a_malformed_header_block_is_refused_and_never_reaches_the_handler(server, block, status):
    answer = raw(server, b"GET /h HTTP/1.1\r\n" + block)
    assert status_of(answer) == status
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]  # the API's error shape, not http.server's page
    assert b'"path"' not in answer


def test_connection_rules_of_http_1_0_and_1_1(server):
    # HTTP/1.0 closes after one answer; HTTP/1.1 keeps the connection unless told to close; 2.0 is refused.
    one = raw(server, b"GET /a HTTP/1.0\r\n\r\nGET /b HTTP/1.0\r\n\r\n")
    assert one.count(b"HTTP/1.") == 1 and b'"/a"' in one
    two = raw(server, b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                      b"GET /c HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b'"/a"' in two and b'"/b"' in two and b'"/c"' not in two
    # (An unusable version is answered without a status line, as http.server does: the code is in the body.)
    assert json.loads(raw(server, b"GET /a HTTP/2.0\r\n\r\n"))["error"] == "HTTP_VERSION_NOT_SUPPORTED"
    assert json.loads(raw(server, b"GET /a HTTP/1.x\r\n\r\n"))["error"] == "BAD_REQUEST"
    assert json.loads(raw(server, b"POST /a\r\n\r\n"))["error"] == "BAD_REQUEST"  # HTTP/0.9 knows GET only


def test_expect_100_continue_is_answered_before_the_body(server):
    host, port = server.server_address[:2]
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(b"POST /e HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\nConnection: close\r\n\r\n")
        first = s.recv(1024)
        assert first.startswith(b"HTTP/1.1 100")
        s.sendall(b"hi")
        rest = b""
        while chunk := s.recv(65536):
            rest += chunk
    assert b" 200 " in rest and json.loads(rest.split(b"\r\n\r\n", 1)[1])["body"] == "hi"
