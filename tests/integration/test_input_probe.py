"""The admission input probe fetches for real (aivedio.media.probe): servers bound to 127.0.0.1 (and
127.0.0.2 as a second host) serve media, redirect, drip a byte a second or never stop; a TLS server
presents a certificate from a test CA; moto plays S3. Where a test needs a name to resolve to a given
address, only the resolver (probe.resolve) is replaced: the sockets, HTTP and TLS are real.

Every refusal is INPUT_UNREACHABLE (or INPUT_TOO_LARGE) naming body.inputs.N.url with a generic
message, and leaves no thread or socket behind."""
from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import av
import boto3
import httpx
import pytest
from moto import mock_aws

from aivedio.admission.models import InputRef
from aivedio.config import Limits, PlatformConfig
from aivedio.errors import InvalidRequest
from aivedio.media import probe
from tests.admission_support import BODY, accepted, footprint, new_tenant, serve

_ = serve  # a fixture, imported for the test that requests it

LOCAL = ["127.0.0.1"]
TENANT = "0d5e7a52-4c1b-4f3e-9a51-6b0c2f7d8e01"  # fixed: parameter ids must match across xdist workers
OTHER = "0d5e7a52-4c1b-4f3e-9a51-6b0c2f7d8e02"
BUCKET = "av-media-test"
# What a tenant-facing message must never contain: addresses, errno text, TLS or resolver detail.
LEAKS = ("127.0.0", "127.0.0.2", "10.0.0", "169.254", "::1", "0.0.0.0", "errno", "refused", "timed out", "timeout",
         "connection", "ssl", "certificate", "getaddrinfo", "name or service", "reset", "broken pipe")


# --- local servers ---------------------------------------------------------------------------------

class _Scripted(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        self.server.seen.append({"path": self.path, "host": self.headers.get("Host")})
        route = self.server.routes.get(self.path.split("?", 1)[0], _not_found)
        try:
            route(self)
        except OSError:  # the probe gave up: broken pipe, reset
            self.close_connection = True


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, tls: ssl.SSLContext | None):
        self.routes: dict = {}
        self.seen: list[dict] = []
        self.connections = 0
        self.sent = 0
        self.stopping = threading.Event()
        self.scheme = "https" if tls else "http"
        super().__init__((host, 0), _Scripted)
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)

    def process_request(self, request, client_address) -> None:
        self.connections += 1  # every accepted connection, whether or not it sends a request
        super().process_request(request, client_address)

    def handle_error(self, request, client_address) -> None:
        pass

    @property
    def port(self) -> int:
        return self.server_address[1]

    def url(self, path: str, host: str | None = None) -> str:
        return f"{self.scheme}://{host or self.server_address[0]}:{self.port}{path}"


def _not_found(h) -> None:
    h.send_response(404)
    h.send_header("Content-Length", "0")
    h.end_headers()


def serve_bytes(data: bytes):
    def run(h) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
    return run


def redirect(location: str, status: int = 302):
    def run(h) -> None:
        h.send_response(status)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()
    return run


def drip_body(every: float, total: int = 100_000):
    """Headers at once, then one byte each `every` seconds."""
    def run(h) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(total))
        h.end_headers()
        for _ in range(total):
            if h.server.stopping.wait(every):
                return
            h.wfile.write(b"\0")
    return run


def drip_headers(every: float):
    """A status line and then a header that never ends, one byte each `every` seconds."""
    def run(h) -> None:
        h.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        while not h.server.stopping.wait(every):
            h.wfile.write(b"a")
    return run


def drip_file(data: bytes, pieces: int, every: float):
    """A real file, in `pieces` parts `every` seconds apart."""
    def run(h) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        step = -(-len(data) // pieces)
        for i in range(0, len(data), step):
            if h.server.stopping.wait(every):
                return
            h.wfile.write(data[i:i + step])
    return run


def endless(chunked: bool):
    """Bytes until the client goes away: close-delimited, or chunked."""
    def run(h) -> None:
        h.send_response(200)
        h.send_header("Transfer-Encoding" if chunked else "Connection", "chunked" if chunked else "close")
        h.end_headers()
        block = b"\0" * 65536
        while not h.server.stopping.is_set():
            h.wfile.write(b"10000\r\n" + block + b"\r\n" if chunked else block)
            h.server.sent += len(block)
    return run


def declares(length: int):
    def run(h) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(length))
        h.end_headers()
        h.server.stopping.wait(10)  # sends none of it: reading would run into the deadline
    return run


@pytest.fixture
def servers():
    made: list[Server] = []

    def make(host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> Server:
        try:
            s = Server(host, tls)
        except OSError as e:
            pytest.skip(f"cannot bind {host}: {e}")
        threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.stopping.set()
        s.shutdown()
        s.server_close()


@pytest.fixture
def server(servers) -> Server:
    return servers()


@pytest.fixture(scope="module")
def png(tmp_path_factory) -> bytes:
    """A real 32x32 PNG, encoded with PyAV."""
    path = tmp_path_factory.mktemp("probe") / "still.png"
    with av.open(str(path), "w", format="image2") as c:
        s = c.add_stream("png", rate=1)
        s.width = s.height = 32
        s.pix_fmt = "rgb24"
        f = av.VideoFrame(32, 32, "rgb24")
        f.planes[0].update(bytes([200, 40, 90]) * (f.planes[0].buffer_size // 3))
        for packet in [*s.encode(f), *s.encode()]:
            c.mux(packet)
    return path.read_bytes()


@pytest.fixture
def dns(monkeypatch):
    """dns.table[name] = [addresses]: what probe.resolve answers for those names; others resolve for real."""
    table: dict[str, list[str]] = {}
    calls: list[str] = []
    real = probe.resolve

    def fake(host: str, port: int, timeout: float):
        calls.append(host)
        if host in table:
            answer = table[host]
            if isinstance(answer, Exception):
                raise answer
            return [ipaddress.ip_address(a) for a in answer]
        return real(host, port, timeout)

    monkeypatch.setattr(probe, "resolve", fake)
    return SimpleNamespace(table=table, calls=calls)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def no_leaks(request):
    """No resolver thread and no socket outlives a probe (servers and runtimes are closed first)."""
    if "serve" in request.fixturenames or not os.path.isdir("/proc/self/fd"):
        yield
        return
    before = _open_fds()
    yield
    deadline = time.monotonic() + 3  # server handler threads close their side when they notice
    while time.monotonic() < deadline and _open_fds() > before:
        time.sleep(0.05)
    assert _open_fds() <= before, "a probe left a file descriptor open"
    assert not [t for t in threading.enumerate() if t.name == "probe-resolve"]


def limits(**kw) -> Limits:
    return Limits(**{"probe_allowed_private_hosts": LOCAL, "input_fetch_deadline_seconds": 3.0,
                     "input_request_deadline_seconds": 6.0, **kw})


def probe_urls(*urls: str, kind: str = "image", lim: Limits | None = None, bucket: str | None = None, tenant: str = TENANT):
    inputs = [InputRef(url=u, kind=kind) for u in urls]
    return probe.probe_inputs(inputs, tenant_id=tenant, limits=lim or limits(), media_bucket=bucket)


def refused(*urls: str, code: str = "INPUT_UNREACHABLE", field: str = "body.inputs.0.url", **kw) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        probe_urls(*urls, **kw)
    err = e.value
    assert err.code == code, (err.code, err.fields)
    assert list(err.fields) == [field], err.fields
    assert_generic(err)
    return err


def assert_generic(err: InvalidRequest | str) -> None:
    text = (err if isinstance(err, str) else err.message + " " + " ".join(err.fields.values())).lower()
    assert not [leak for leak in LEAKS if leak in text], text


# --- what is fetched -------------------------------------------------------------------------------

def test_a_real_png_from_an_allowed_local_server_is_measured(server, png):
    server.routes["/still.png"] = serve_bytes(png)
    [m] = probe_urls(server.url("/still.png"))
    assert (m.kind, m.size_bytes, m.width, m.height, m.duration_seconds) == ("image", len(png), 32, 32, None)
    assert server.seen == [{"path": "/still.png", "host": f"127.0.0.1:{server.port}"}]


def test_a_name_is_resolved_once_and_the_socket_goes_to_the_checked_address(server, png, dns, monkeypatch):
    server.routes["/still.png"] = serve_bytes(png)
    dns.table["media.test"] = ["127.0.0.1"]

    def no_second_lookup(*args, **kwargs):
        raise AssertionError("a second name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", no_second_lookup)
    [m] = probe_urls(server.url("/still.png?sig=abc", host="media.test"))
    assert m.kind == "image"
    assert dns.calls == ["media.test"]
    assert server.seen == [{"path": "/still.png?sig=abc", "host": f"media.test:{server.port}"}]  # Host: the name


# --- refused addresses -----------------------------------------------------------------------------

ADDRESS_CLASSES = ["127.0.0.1", "10.0.0.1", "172.16.0.1", "192.168.0.1", "169.254.169.254", "::1", "fc00::1", "fe80::1",
                   "0.0.0.0", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "100.64.0.1", "224.0.0.1", "240.0.0.1", "::127.0.0.1",
                   "64:ff9b::7f00:1"]


@pytest.mark.parametrize("address", ADDRESS_CLASSES)
def test_a_name_that_resolves_to_a_non_global_address_is_refused_before_connecting(server, png, dns, address):
    server.routes["/still.png"] = serve_bytes(png)
    dns.table["evil.test"] = [address]
    refused(server.url("/still.png", host="evil.test"), lim=limits(probe_allowed_private_hosts=[]))
    assert server.connections == 0  # for the loopback forms, a connect would have reached this server


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]", "[::ffff:127.0.0.1]", "0.0.0.0", "169.254.169.254", "10.0.0.1",
                                  "2130706433", "0x7f.1", "[fc00::1]"])
def test_a_url_naming_a_non_global_address_is_refused_before_connecting(server, host):
    # 2130706433 and 0x7f.1 are spellings of 127.0.0.1 that inet_aton would accept.
    refused(f"http://{host}:{server.port}/still.png", lim=limits(probe_allowed_private_hosts=[]))
    assert server.connections == 0


def test_localhost_is_refused_by_its_real_resolution(server, png):
    server.routes["/still.png"] = serve_bytes(png)
    refused(server.url("/still.png", host="localhost"), lim=Limits())
    assert server.connections == 0


def test_a_name_with_a_private_address_among_public_ones_is_refused(server, dns):
    dns.table["rebind.test"] = ["93.184.216.34", "127.0.0.1"]
    refused(server.url("/still.png", host="rebind.test"), lim=limits(probe_allowed_private_hosts=[]))
    assert server.connections == 0


def test_an_unreachable_input_tells_the_tenant_nothing_of_the_network(server, dns):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now: connection refused
    refused(f"http://127.0.0.1:{port}/x.png")
    dns.table["gone.test"] = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    refused("http://gone.test/x.png")
    refused(server.url("/missing.png"))  # a 404


# --- redirects -------------------------------------------------------------------------------------

@pytest.fixture
def second(servers, png) -> Server:
    """Another host, 127.0.0.2, serving the PNG; not in the allow-list unless a test puts it there."""
    s = servers("127.0.0.2")
    s.routes["/still.png"] = serve_bytes(png)
    return s


def test_a_redirect_into_a_private_address_is_refused(server, second):
    server.routes["/r"] = redirect(second.url("/still.png"))
    refused(server.url("/r"))
    assert [s["path"] for s in server.seen] == ["/r"] and second.connections == 0


@pytest.mark.parametrize("location", ["http://169.254.169.254/latest/meta-data/iam/security-credentials/",
                                      "http://10.0.0.1/x.png", "http://[::1]/x.png", "http://[::ffff:169.254.169.254]/"])
def test_a_redirect_to_a_metadata_or_private_url_is_refused(server, location):
    server.routes["/r"] = redirect(location, 307)
    refused(server.url("/r"))


def test_each_hop_is_checked_and_followed_when_allowed(server, second):
    server.routes["/r"] = redirect(second.url("/still.png"), 301)
    [m] = probe_urls(server.url("/r"), lim=limits(probe_allowed_private_hosts=["127.0.0.1", "127.0.0.2"]))
    assert m.kind == "image" and second.seen == [{"path": "/still.png", "host": f"127.0.0.2:{second.port}"}]


@pytest.mark.parametrize("location", ["file:///etc/passwd", "ftp://127.0.0.1/x.png", f"s3://{BUCKET}/inputs/{TENANT}/x.png",
                                      "gopher://127.0.0.1:70/", "data:image/png;base64,AAAA", "//"])
def test_a_redirect_to_another_scheme_is_refused(server, location, monkeypatch):
    monkeypatch.setattr(probe, "_s3_client", lambda *a: pytest.fail("an S3 call"))
    server.routes["/r"] = redirect(location)
    refused(server.url("/r"), bucket=BUCKET)


def test_three_redirects_are_followed_and_a_fourth_is_refused(server, png):
    server.routes["/still.png"] = serve_bytes(png)
    for i in range(1, 5):
        server.routes[f"/r{i}"] = redirect(f"/r{i - 1}" if i > 1 else "/still.png")  # relative Locations
    [m] = probe_urls(server.url("/r3"))
    assert m.kind == "image"
    server.seen.clear()
    refused(server.url("/r4"))
    assert [s["path"] for s in server.seen] == ["/r4", "/r3", "/r2", "/r1"]  # the target is never asked for


# --- deadlines and the byte cap --------------------------------------------------------------------

@pytest.mark.parametrize("drip", [drip_body, drip_headers], ids=["body", "headers"])
def test_a_server_dripping_a_byte_a_second_ends_at_the_deadline(server, drip):
    server.routes["/slow"] = drip(every=1.0)
    started = time.monotonic()
    refused(server.url("/slow"), lim=limits(input_fetch_deadline_seconds=2.0))
    elapsed = time.monotonic() - started
    assert 1.9 <= elapsed < 2.6, elapsed


def test_all_inputs_of_a_request_share_one_deadline(server, png):
    server.routes["/slow-but-fine.png"] = drip_file(png, pieces=4, every=0.3)  # about 1.2 s, within its own 3 s
    server.routes["/slow"] = drip_body(every=0.5)
    started = time.monotonic()
    refused(server.url("/slow-but-fine.png"), server.url("/slow"), field="body.inputs.1.url",
            lim=limits(input_fetch_deadline_seconds=3.0, input_request_deadline_seconds=2.0))
    elapsed = time.monotonic() - started
    assert 1.9 <= elapsed < 2.6, elapsed  # the request's 2 s, not 1.2 s + the second input's 3 s


@pytest.mark.parametrize("chunked", [False, True], ids=["close-delimited", "chunked"])
def test_an_endless_body_ends_at_the_byte_cap(server, chunked):
    server.routes["/endless"] = endless(chunked)
    cap = 300_000
    started = time.monotonic()
    err = refused(server.url("/endless"), code="INPUT_TOO_LARGE", lim=limits(max_input_bytes=cap))
    assert time.monotonic() - started < 1.5  # at the cap, long before the 3 s deadline
    assert str(cap) in err.fields["body.inputs.0.url"]


def test_a_declared_length_over_the_cap_is_refused_without_reading(server):
    server.routes["/huge"] = declares(10**12)
    started = time.monotonic()
    refused(server.url("/huge"), code="INPUT_TOO_LARGE")
    assert time.monotonic() - started < 1.0


# --- https -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def test_ca():
    """A CA and a certificate for media.test, made with cryptography."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject: str, key, issuer: str, issuer_key, *, ca: bool, san: str | None = None):
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)])).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(hours=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("probe test CA", ca_key, "probe test CA", ca_key, ca=True)
    leaf = cert("media.test", leaf_key, "probe test CA", ca_key, ca=False, san="media.test")
    pem = lambda c: c.public_bytes(serialization.Encoding.PEM)  # noqa: E731
    key_pem = leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return SimpleNamespace(ca_pem=pem(ca).decode(), chain=pem(leaf) + key_pem)


@pytest.fixture
def tls_server(servers, png, test_ca, tmp_path):
    bundle = tmp_path / "leaf.pem"
    bundle.write_bytes(test_ca.chain)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(bundle)
    sni: list[str | None] = []
    ctx.sni_callback = lambda sock, name, _ctx: sni.append(name)
    s = servers(tls=ctx)
    s.routes["/still.png"] = serve_bytes(png)
    s.sni = sni
    return s


def test_https_connects_to_the_checked_address_and_verifies_the_name(tls_server, test_ca, dns, monkeypatch):
    dns.table["media.test"] = ["127.0.0.1"]
    dns.table["other.test"] = ["127.0.0.1"]
    # The default context does not know the test CA: the chain is refused.
    refused(tls_server.url("/still.png", host="media.test"))
    monkeypatch.setattr(probe, "tls_context", lambda: ssl.create_default_context(cadata=test_ca.ca_pem))
    [m] = probe_urls(tls_server.url("/still.png", host="media.test"))
    assert m.kind == "image"
    assert tls_server.seen[-1] == {"path": "/still.png", "host": f"media.test:{tls_server.port}"}
    assert "media.test" in tls_server.sni
    # The same server under a name its certificate does not carry is refused.
    refused(tls_server.url("/still.png", host="other.test"))


# --- s3:// -----------------------------------------------------------------------------------------

@pytest.fixture
def s3(monkeypatch, png):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        for bucket in (BUCKET, "someone-elses"):
            client.create_bucket(Bucket=bucket)
        for key in (f"inputs/{TENANT}/still.png", f"inputs/{OTHER}/still.png"):
            client.put_object(Bucket=BUCKET, Key=key, Body=png)
        client.put_object(Bucket="someone-elses", Key=f"inputs/{TENANT}/still.png", Body=png)
        calls: list[float] = []
        real = probe._s3_client
        monkeypatch.setattr(probe, "_s3_client", lambda timeout: calls.append(timeout) or real(timeout))
        yield SimpleNamespace(client=client, calls=calls)


def test_an_s3_upload_under_the_callers_prefix_is_measured(s3, png):
    [m] = probe_urls(f"s3://{BUCKET}/inputs/{TENANT}/still.png", bucket=BUCKET)
    assert (m.kind, m.size_bytes) == ("image", len(png))
    assert len(s3.calls) == 1


@pytest.mark.parametrize("url", [
    f"s3://{BUCKET}/inputs/{OTHER}/still.png",  # another tenant's upload (it exists)
    f"s3://someone-elses/inputs/{TENANT}/still.png",  # another bucket (it exists too)
    f"s3://{BUCKET}/inputs/{TENANT}/../{OTHER}/still.png",
    f"s3://{BUCKET}/inputs/{TENANT}/./still.png",
    f"s3://{BUCKET}/still.png",
], ids=["other-tenant", "other-bucket", "dot-dot", "dot", "outside-inputs"])
def test_any_other_s3_key_is_refused_without_an_s3_call(s3, url):
    err = refused(url, bucket=BUCKET)
    assert err.fields["body.inputs.0.url"] == f"s3:// inputs must lie under s3://{BUCKET}/inputs/{TENANT}/"
    assert s3.calls == []


def test_without_a_media_bucket_s3_inputs_are_refused(s3):
    refused(f"s3://{BUCKET}/inputs/{TENANT}/still.png", bucket=None)
    assert s3.calls == []


def test_a_missing_or_oversized_s3_upload_is_refused(s3, png):
    refused(f"s3://{BUCKET}/inputs/{TENANT}/nope.png", bucket=BUCKET)
    refused(f"s3://{BUCKET}/inputs/{TENANT}/still.png", code="INPUT_TOO_LARGE", bucket=BUCKET, lim=limits(max_input_bytes=len(png) - 1))


# --- through the API, on the local server ----------------------------------------------------------

def test_a_slow_input_does_not_hold_up_other_requests(make_platform, conn, serve, server):
    server.routes["/slow.png"] = drip_body(every=1.0)
    p = make_platform(PlatformConfig(limits=limits(input_fetch_deadline_seconds=3.0)))
    api = serve(p)
    slow, other = new_tenant(p), new_tenant(p)
    before = footprint(conn, slow.tenant_id)
    answer: dict = {}
    body = {**BODY, "mode": "image_to_video", "inputs": [{"url": server.url("/slow.png"), "kind": "image"}]}

    def submit_slow() -> None:
        with httpx.Client(base_url=api.rt.base_url, timeout=30) as c:
            answer["r"] = c.post("/v1/generations", json=body,
                                 headers={"Authorization": f"Bearer {slow.api_key}", "Idempotency-Key": uuid.uuid4().hex})

    started = time.monotonic()
    t = threading.Thread(target=submit_slow)
    t.start()
    while not server.seen and time.monotonic() - started < 5:
        time.sleep(0.02)
    assert server.seen, "the slow request never reached the probe"

    t0 = time.monotonic()
    assert api.http.get("/healthz").status_code == 200
    assert time.monotonic() - t0 < 1.0
    task = accepted(api.submit(other))  # another tenant's admission goes through meanwhile
    listed = api.http.get("/v1/generations", headers={"Authorization": f"Bearer {other.api_key}"})
    assert listed.status_code == 200 and [x["task_id"] for x in listed.json()["items"]] == [task["task_id"]]
    assert t.is_alive() and time.monotonic() - t0 < 2.0

    t.join(10)
    r = answer["r"]
    assert 2.9 <= time.monotonic() - started < 4.0
    assert r.status_code == 422 and r.json()["error"] == "INPUT_UNREACHABLE", r.text
    assert list(r.json()["details"]["fields"]) == ["body.inputs.0.url"]
    assert_generic(r.text)
    assert footprint(conn, slow.tenant_id) == before


def test_through_the_api_a_metadata_url_is_refused_and_writes_nothing(make_platform, conn, serve):
    p = make_platform()  # the default limits: no private host allowed
    api = serve(p)
    t = new_tenant(p)
    before = footprint(conn, t.tenant_id)
    body = {**BODY, "mode": "image_to_video",
            "inputs": [{"url": "http://169.254.169.254/latest/meta-data/iam/security-credentials/", "kind": "image"}]}
    r = api.submit(t, body)
    assert r.status_code == 422 and r.json()["error"] == "INPUT_UNREACHABLE", r.text
    assert list(r.json()["details"]["fields"]) == ["body.inputs.0.url"]
    assert_generic(r.text)
    assert footprint(conn, t.tenant_id) == before


def test_through_the_api_s3_inputs_come_from_the_callers_own_prefix(make_platform, conn, serve, s3, png):
    p = make_platform(media_bucket=BUCKET)
    api = serve(p)
    t, other = new_tenant(p), new_tenant(p)
    for tenant in (t, other):
        s3.client.put_object(Bucket=BUCKET, Key=f"inputs/{tenant.tenant_id}/still.png", Body=png)
    mine = {**BODY, "mode": "image_to_video", "inputs": [{"url": f"s3://{BUCKET}/inputs/{t.tenant_id}/still.png", "kind": "image"}]}
    accepted(api.submit(t, mine))
    before = footprint(conn, t.tenant_id)
    calls = len(s3.calls)
    theirs = {**mine, "inputs": [{"url": f"s3://{BUCKET}/inputs/{other.tenant_id}/still.png", "kind": "image"}]}
    r = api.submit(t, theirs)
    assert r.status_code == 422 and r.json()["error"] == "INPUT_UNREACHABLE", r.text
    assert r.json()["details"]["fields"] == {"body.inputs.0.url": f"s3:// inputs must lie under s3://{BUCKET}/inputs/{t.tenant_id}/"}
    assert footprint(conn, t.tenant_id) == before and len(s3.calls) == calls
