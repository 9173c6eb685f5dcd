"""The local stand-in for API Gateway: a threaded HTTP server that turns each request into a REST
proxy event, invokes a Lambda handler in-process, and turns its answer back into HTTP.

It enforces only what API Gateway does: a 10 MiB payload limit (413), and a 502 when the handler
raises or returns something that is not a proxy response. Each request is invoked on its own
thread, concurrently, as API Gateway would spread them over several Lambda environments: a handler
served here keeps no per-request state in shared places (the `api` handler's resolver keeps it per
thread, functions/_edge/resolver.py), so one slow request (an input probe waiting on a slow server)
never holds up the others.

One server can stand in for several API Gateway APIs on one port: `mounts` send a path under
one of their prefixes to another handler (`aivedio serve` sends /admin/... and /dashboard to the
admin API's), every other path goes to the main handler."""
from __future__ import annotations

import logging
import os
import re
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from aivedio_tools.local import apigw, prometheus
from aivedio_tools.local.lambda_context import FakeLambdaContext

log = logging.getLogger("aivedio_tools.local.http")

MAX_BODY_BYTES = 10 * 1024 * 1024  # API Gateway's payload quota
CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,8}")  # a chunk size: hex digits only, at most 4 GiB (the cap refuses sooner)
MAX_HEADER_LINE_BYTES = 65536  # http.client's limits for a header line and the number of header lines
MAX_HEADERS = 100
MAX_HEADER_BLOCK_BYTES = 65536  # all of them together
_HEADER_NAME = re.compile(r"[\x21-\x39\x3b-\x7e]+")  # printable, no colon: the email parser's rule
LambdaHandler = Callable[[dict, Any], Any]


class Headers:
    """A request's headers as the handler reads them: get() the first value of a name in any case,
    items() every (name, value) in order. What http.server builds instead (an email.message.Message,
    through the email package's parser) cost more CPU than the rest of the server's part of a request."""

    __slots__ = ("_items", "_first")

    def __init__(self, items: list[tuple[str, str]]):
        self._items = items
        self._first: dict[str, str] = {}
        for name, value in items:
            self._first.setdefault(name.lower(), value)

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._first.get(name.lower(), default)

    def __getitem__(self, name: str) -> str | None:
        return self._first.get(name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._first

    def items(self) -> list[tuple[str, str]]:
        return list(self._items)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._items)


class BadHeaders(ValueError):
    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


def read_headers(rfile) -> Headers:
    """The header block of a request, up to its empty line: `Name: value` lines (the value without
    its leading blanks and its line end; an obsolete folded line continues the value before it), at
    most MAX_HEADERS lines (folded ones count) of at most MAX_HEADER_LINE_BYTES, and at most
    MAX_HEADER_BLOCK_BYTES in all. Raises BadHeaders for anything else."""
    items: list[tuple[str, str]] = []
    lines = size = 0
    while True:
        raw = rfile.readline(MAX_HEADER_LINE_BYTES + 1)
        if len(raw) > MAX_HEADER_LINE_BYTES:
            raise BadHeaders(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Line too long")
        if raw in (b"\r\n", b"\n", b""):
            return Headers(items)
        lines, size = lines + 1, size + len(raw)
        if lines > MAX_HEADERS:
            raise BadHeaders(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Too many headers")
        if size > MAX_HEADER_BLOCK_BYTES:
            raise BadHeaders(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Headers too large")
        line = raw.decode("iso-8859-1")
        if line[0] in " \t":
            if not items:
                raise BadHeaders(HTTPStatus.BAD_REQUEST, "Bad header: a continuation line without a header")
            name, value = items[-1]
            items[-1] = (name, value + " " + line.strip(" \t\r\n"))
            continue
        name, colon, value = line.partition(":")
        if not colon or _HEADER_NAME.fullmatch(name) is None:
            raise BadHeaders(HTTPStatus.BAD_REQUEST, "Bad header line")
        items.append((name, value.lstrip(" \t").rstrip("\r\n")))


@dataclass(frozen=True)
class Mount:
    """Paths under `prefixes` (each matched on a segment boundary: "/admin" takes /admin and
    /admin/v1/..., not /administer) go to `lambda_handler`, invoked as `function_name`."""

    prefixes: tuple[str, ...]
    lambda_handler: LambdaHandler
    function_name: str

    def takes(self, path: str) -> bool:
        return any(path == p or path.startswith(p + "/") for p in self.prefixes)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like API Gateway
    server_version = "aivedio-local"
    timeout = 120  # an idle keep-alive connection frees its thread after this
    # TCP_NODELAY: a reply is two writes (headers, then body); with Nagle's algorithm the body waited
    # for the client's delayed ACK of the headers, about 40 ms on every keep-alive request.
    disable_nagle_algorithm = True
    server: "LambdaHttpServer"

    def __getattr__(self, name: str):
        # API Gateway's ANY method: every verb reaches the handler.
        if name.startswith("do_"):
            return self._dispatch
        raise AttributeError(name)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s " + format, self.address_string(), *args)

    def parse_request(self) -> bool:
        """http.server's rules, with the header block read by read_headers() instead of the email
        package: the request line (HTTP/1.0 or 1.1; HTTP/0.9 GET only), keep-alive by default on
        HTTP/1.1 and Connection to say otherwise, Expect: 100-continue. False after answering an
        error, in the API's JSON error shape (http.server answers HTML)."""
        self.command = None
        self.request_version = self.default_request_version
        self.close_connection = True
        self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        words = self.requestline.split()
        if not words:
            return False
        if len(words) >= 3:
            version = words[-1]
            number = version[5:].split(".") if version.startswith("HTTP/") else []
            if len(number) != 2 or not all(n.isdigit() and len(n) <= 10 for n in number):
                return self._refuse(HTTPStatus.BAD_REQUEST, f"Bad request version ({version!r})")
            if (int(number[0]), int(number[1])) >= (2, 0):
                return self._refuse(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, f"Invalid HTTP version ({version[5:]})")
            if (int(number[0]), int(number[1])) >= (1, 1) and self.protocol_version >= "HTTP/1.1":
                self.close_connection = False
            self.request_version = version
        if not 2 <= len(words) <= 3:
            return self._refuse(HTTPStatus.BAD_REQUEST, f"Bad request syntax ({self.requestline!r})")
        self.command, self.path = words[:2]
        if len(words) == 2:
            self.close_connection = True
            if self.command != "GET":
                return self._refuse(HTTPStatus.BAD_REQUEST, f"Bad HTTP/0.9 request type ({self.command!r})")
        if self.path.startswith("//"):  # gh-87389: never an absolute URI without its scheme
            self.path = "/" + self.path.lstrip("/")
        try:
            self.headers = read_headers(self.rfile)
        except BadHeaders as e:
            return self._refuse(e.status, str(e))
        conntype = (self.headers.get("Connection") or "").lower()
        if conntype == "close":
            self.close_connection = True
        elif conntype == "keep-alive" and self.protocol_version >= "HTTP/1.1":
            self.close_connection = False
        expect = (self.headers.get("Expect") or "").lower()
        if expect == "100-continue" and self.protocol_version >= "HTTP/1.1" and self.request_version >= "HTTP/1.1":
            return self.handle_expect_100()
        return True

    def _refuse(self, status: HTTPStatus, message: str) -> bool:
        """Answer a request that could not be read, in the API's error shape, and close: False."""
        self._reply(apigw.gateway_error(int(status), status.name, message), close=True)
        return False

    def _read_body(self) -> bytes | None:
        """The request body, or None after answering 413/400 for it."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            return self._read_chunked()
        raw = self.headers.get("Content-Length")
        if raw is None:
            return b""
        try:
            length = int(raw)
            if length < 0:
                raise ValueError
        except ValueError:
            self._reply(apigw.gateway_error(400, "BAD_REQUEST", "invalid Content-Length"), close=True)
            return None
        if length > MAX_BODY_BYTES:
            self._reply(apigw.gateway_response("REQUEST_TOO_LARGE"), close=True)
            return None
        return self.rfile.read(length)

    def _read_chunked(self) -> bytes | None:
        parts: list[bytes] = []
        total = 0
        while True:
            line = self.rfile.readline(1024)
            digits = line.split(b";")[0].strip()
            # Strictly hex digits (RFC 9112 chunk-size): int(…, 16) also takes "-1", "+5", "0x10" and
            # "1_0", and a size of -1 would read to the end of the stream past the body cap.
            if not CHUNK_SIZE.fullmatch(digits):
                self._reply(apigw.gateway_error(400, "BAD_REQUEST", "invalid chunked encoding"), close=True)
                return None
            size = int(digits, 16)
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            total += size
            if total > MAX_BODY_BYTES:
                self._reply(apigw.gateway_response("REQUEST_TOO_LARGE"), close=True)
                return None
            parts.append(self.rfile.read(size))
            self.rfile.readline(8)  # the CRLF after each chunk

    def _dispatch(self) -> None:
        body = self._read_body()
        if body is None:
            return
        url = urlsplit(self.path)
        served = prometheus.metrics_response(url.path, self.client_address[0], self.headers.get("Host")) if self.command == "GET" else None
        if served is not None:  # this process's counters as Prometheus text, not an API route
            return self._reply(apigw.HttpResponse(*served))
        event = apigw.to_event(
            self.command, url.path, url.query, self.headers.items(), body, source_ip=self.client_address[0]
        )
        handler, function_name = self.server.handler_for(url.path)
        ctx = FakeLambdaContext(function_name)
        try:
            result = handler(event, ctx)
            resp = apigw.from_response(result)
        except apigw.MalformedProxyResponse as e:
            log.error("%s returned a malformed proxy response: %s", function_name, e)
            resp = apigw.gateway_response("DEFAULT_5XX", status=502)
        except Exception:
            log.exception("%s raised", function_name)
            resp = apigw.gateway_response("DEFAULT_5XX", status=502)
        self._reply(resp)

    def _reply(self, resp: apigw.HttpResponse, close: bool = False) -> None:
        self.send_response(resp.status)
        for k, v in resp.headers:
            if k.lower() not in ("content-length", "connection", "transfer-encoding"):
                self.send_header(k, v)
        # Which process answered: `aivedio serve --api-workers N` runs N of them on one port.
        self.send_header("X-Aivedio-Worker", str(os.getpid()))
        self.send_header("Content-Length", str(len(resp.body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD" and resp.body:
            self.wfile.write(resp.body)


class LambdaHttpServer(ThreadingHTTPServer):
    daemon_threads = True  # a stuck keep-alive connection never blocks shutdown
    allow_reuse_address = True
    # socketserver's default listen backlog is 5: a burst of concurrent clients (as API Gateway
    # would pass through) overflows it and has connections reset before they reach the handler.
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], lambda_handler: LambdaHandler, function_name: str = "aivedio-api",
                 reuse_port: bool = False, mounts: Sequence[Mount] = ()):
        self.lambda_handler = lambda_handler
        self.function_name = function_name
        self.mounts = tuple(mounts)
        self.reuse_port = reuse_port
        self._thread: threading.Thread | None = None
        super().__init__(address, _Handler)

    def handler_for(self, path: str) -> tuple[LambdaHandler, str]:
        """The handler a path goes to, and the function name it is invoked as."""
        for mount in self.mounts:
            if mount.takes(path):
                return mount.lambda_handler, mount.function_name
        return self.lambda_handler, self.function_name

    def server_bind(self) -> None:
        # Several API worker processes listen on one port and the kernel spreads connections
        # over them (aivedio_tools.local.api_workers); set before bind, or the second bind fails.
        if self.reuse_port:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"http://{host}:{port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2}, name="http-api", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:  # shutdown() waits for serve_forever, so only once it runs
            self.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self.server_close()
