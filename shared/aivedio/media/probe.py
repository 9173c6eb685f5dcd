"""Measure input media on the server (PyAV). Declared sizes and durations are never trusted: each
input is fetched with a byte cap and a deadline, opened, and its real kind, duration and size read.

The fetch runs inside the VPC with the platform's IAM role, at a URL the tenant chose, so it trusts
nothing about that URL:

- http(s): the host is resolved once and every address it resolves to must be a global unicast
  address (`refusal`); the socket is then opened to the address that was checked, never to the name
  again, because a second lookup may answer 127.0.0.1 (DNS rebinding). The Host header, TLS SNI and
  the certificate check use the URL's host name. `Limits.probe_allowed_private_hosts` exempts hosts
  for tests and local setups.
- redirects: at most `Limits.input_max_redirects`, each hop checked like the first; http and https
  only (a redirect to file:, ftp:, s3: ... is refused).
- deadlines: one per input and one for all inputs of a request (`Limits.input_fetch_deadline_seconds`,
  `Limits.input_request_deadline_seconds`, real seconds). Every read and write gets what is left of
  it, so a server that drips a byte a second ends at the deadline. The byte cap holds while reading.
- s3://: only `s3://<Settings.media_bucket>/inputs/<the caller's tenant id>/<key>`, with no empty,
  `.` or `..` segment in the key; anything else is refused before any S3 call, and every s3:// input
  is refused when no media bucket is configured.

The tenant sees one of these stable codes and a generic message under
`details.fields["body.inputs.N.url"]`; never a socket error or an address. The real reason is
logged (field, host, reason).

  INPUT_UNREACHABLE  not fetched: a refused address, scheme or redirect, an s3:// key outside the
                     caller's inputs/<tenant id>/ prefix, a DNS, connect or TLS failure, an HTTP
                     status other than 2xx, too many redirects, the deadline
  INPUT_TOO_LARGE    over Limits.max_input_bytes, by Content-Length or by the bytes read
  INPUT_NOT_MEDIA    fetched, but not a readable image, video or audio file
  INPUT_TOO_LONG     media longer than Limits.max_input_duration_seconds

The media worker (containers/gpu-render/worker.py, operation "ingest") fetches providers' outputs
with the same rules through `fetch_url` and reads them with `measure`.
"""
from __future__ import annotations

import functools
import http.client
import io
import ipaddress
import socket
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from aivedio.config import Limits
from aivedio.errors import InvalidRequest
from aivedio.observability import logger

CHUNK = 1 << 16
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
DEFAULT_PORTS = {"http": 80, "https": 443}
USER_AGENT = "aivedio-probe/1"
UNREACHABLE = "could not fetch this input"  # the tenant's whole answer: which check failed is for our logs

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052: the low 32 bits are the IPv4 host reached
NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215: a site's own translators
# Non-global blocks of the IANA special-purpose registries that ipaddress misses in some Python
# versions (its tables were corrected in 3.12.4/3.11.10 and still lag new assignments).
NOT_GLOBAL = tuple(ipaddress.ip_network(n) for n in (
    "192.0.0.0/24",  # IETF protocol assignments (all of it: the two anycast exceptions serve no media)
    "192.88.99.0/24",  # the deprecated 6to4 relay anycast
    "100::/64",  # discard-only
    "3fff::/20",  # documentation (RFC 9637)
    "5f00::/16",  # SRv6 SIDs (RFC 9602)
))


@dataclass(frozen=True)
class ProbedMedia:
    url: str
    kind: str  # image | video | audio
    size_bytes: int
    duration_seconds: float | None
    width: int | None
    height: int | None


class _TooLarge(Exception):
    pass


class _Refused(Exception):
    """A fetch the probe will not make. `hint` is safe to show the tenant; `reason` is for the log."""

    def __init__(self, reason: str, hint: str = UNREACHABLE):
        super().__init__(reason)
        self.reason = reason
        self.hint = hint


class _Forbidden(_Refused):
    """Refused by the address rules themselves: a non-global address, a scheme other than http(s),
    credentials or no host in the URL (on any hop). Retrying cannot help, unlike an HTTP status."""


# --- addresses -------------------------------------------------------------------------------------

def refusal(ip: IPAddress) -> str | None:
    """Why a probe may not connect to `ip`, or None for a global unicast address. IPv6 forms that
    carry an IPv4 address (mapped, NAT64, 6to4) are judged by that IPv4 address."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded, form = _embedded_ipv4(ip)
        if embedded is not None:
            why = refusal(embedded)
            return None if why is None else f"{why} ({form})"
        if ip in NAT64_LOCAL:
            return "local-use NAT64"
        if int(ip) >> 32 == 0 and int(ip) > 1:
            return "IPv4-compatible IPv6"  # ::a.b.c.d, deprecated (RFC 4291) and never a public server
        if ip.is_site_local:
            return "site-local"
    for name in ("is_unspecified", "is_loopback", "is_link_local", "is_multicast", "is_private", "is_reserved"):
        if getattr(ip, name):
            return name[3:].replace("_", "-")
    if not ip.is_global or any(ip in n for n in NOT_GLOBAL):
        return "not global"  # 100.64.0.0/10 (carrier-grade NAT) and the like
    return None


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address | None, str]:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped, "IPv4-mapped"
    if ip in NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF), "NAT64"
    if ip.sixtofour is not None:
        return ip.sixtofour, "6to4"
    return None, ""


@dataclass(frozen=True)
class Allowance:
    """Limits.probe_allowed_private_hosts, parsed: names match the URL's host, networks the address."""

    names: frozenset[str]
    networks: tuple[IPNetwork, ...]

    @classmethod
    def of(cls, entries: list[str]) -> "Allowance":
        names, networks = set(), []
        for e in entries:
            try:
                networks.append(ipaddress.ip_network(e, strict=False))
            except ValueError:
                names.add(e.lower().rstrip("."))
        return cls(frozenset(names), tuple(networks))

    def allows(self, host: str, ip: IPAddress) -> bool:
        if host.lower().rstrip(".") in self.names:
            return True
        addr = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip
        return any(addr in n for n in self.networks)


def resolve(host: str, port: int, timeout: float) -> list[IPAddress]:
    """Every address `host` resolves to (tests replace this to map a name to an address). The system
    resolver runs on a thread of its own because getaddrinfo takes no timeout, and a tenant's slow
    DNS server must not outlast the deadline. If it does, that thread ends when the resolver gives
    up (resolv.conf timeout x attempts); it holds nothing of ours."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        except OSError as e:
            box["error"] = e

    t = threading.Thread(target=run, name="probe-resolve", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError("name resolution outlasted the deadline")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    out: list[IPAddress] = []
    for family, _, _, _, sockaddr in box["infos"]:  # type: ignore[union-attr]
        if family in (socket.AF_INET, socket.AF_INET6):
            ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            if ip not in out:
                out.append(ip)
    return out


# --- one fetch -------------------------------------------------------------------------------------

@dataclass
class _Fetch:
    field: str
    tenant_id: str
    limits: Limits
    media_bucket: str | None
    allowance: Allowance
    deadline: float  # time.monotonic(): real seconds
    host: str = ""  # the host of the hop in progress, for the log

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("fetch deadline passed")
        return left


class _DeadlineReader(io.RawIOBase):
    """The socket's bytes, each read bounded by what is left of the deadline (not a fresh timeout)."""

    def __init__(self, sock: socket.socket, fetch: _Fetch):
        super().__init__()
        self._sock, self._fetch = sock, fetch

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        self._sock.settimeout(self._fetch.left())
        return self._sock.recv_into(b)


class _DeadlineSocket:
    """What http.client uses of a socket (sendall, makefile, close), bounded by the fetch deadline."""

    def __init__(self, sock: socket.socket, fetch: _Fetch):
        self._sock, self._fetch = sock, fetch

    def sendall(self, data: bytes) -> None:
        self._sock.settimeout(self._fetch.left())
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args, **kwargs) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._fetch), CHUNK)

    def close(self) -> None:
        pass  # http.client closes early when a response will close; the fetch owns the socket and closes it


@functools.cache
def _default_tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()  # verifies the chain and the host name


def tls_context() -> ssl.SSLContext:
    """The TLS context for https inputs (tests replace it to trust their own CA)."""
    return _default_tls_context()


def _checked_addresses(host: str, port: int, fetch: _Fetch) -> list[IPAddress]:
    ips = resolve(host, port, fetch.left())
    if not ips:
        raise _Refused("no address")
    for ip in ips:
        # One bad address refuses the host: a name that answers both public and private addresses
        # is a rebinding attempt, and the next connect could pick either.
        why = None if fetch.allowance.allows(host, ip) else refusal(ip)
        if why is not None:
            raise _Forbidden(f"address {ip} is {why}")
    return ips


def _connect(ips: list[IPAddress], port: int, fetch: _Fetch) -> socket.socket:
    last: OSError | None = None
    for ip in ips:
        target = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip
        sock = socket.socket(socket.AF_INET if target.version == 4 else socket.AF_INET6, socket.SOCK_STREAM)
        try:
            sock.settimeout(fetch.left())
            sock.connect((str(target), port))
            return sock
        except TimeoutError:
            sock.close()
            raise
        except OSError as e:
            sock.close()
            last = e
    raise last or OSError("no address to connect to")


def _tls(sock: socket.socket, host: str, fetch: _Fetch) -> ssl.SSLSocket:
    try:
        tls = tls_context().wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    except BaseException:
        sock.close()
        raise
    try:
        tls.settimeout(fetch.left())  # the handshake as a whole, not per read
        tls.do_handshake()
    except BaseException:
        tls.close()
        raise
    return tls


def _host_header(host: str, port: int, scheme: str) -> str:
    name = f"[{host}]" if ":" in host else host
    return name if port == DEFAULT_PORTS[scheme] else f"{name}:{port}"


def _copy_capped(read, out, fetch: _Fetch) -> int:
    cap = fetch.limits.max_input_bytes
    n = 0
    while True:
        fetch.left()
        chunk = read(min(CHUNK, cap + 1 - n))  # never more than one byte past the cap
        if not chunk:
            return n
        n += len(chunk)
        if n > cap:
            raise _TooLarge()
        out.write(chunk)


def _fetch_http(url: str, out, fetch: _Fetch) -> int:
    for _hop in range(fetch.limits.input_max_redirects + 1):
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        fetch.host = parts.hostname or ""
        if scheme not in DEFAULT_PORTS:
            raise _Forbidden(f"scheme {scheme!r}")
        if not parts.hostname:
            raise _Forbidden("no host")
        if parts.username is not None or parts.password is not None:
            raise _Forbidden("credentials in the URL")
        host, port = parts.hostname, parts.port or DEFAULT_PORTS[scheme]  # .port raises ValueError when bad
        sock = _connect(_checked_addresses(host, port, fetch), port, fetch)
        conn = None
        try:
            if scheme == "https":
                sock = _tls(sock, host, fetch)
            conn = http.client.HTTPConnection(host, port)
            conn.sock = _DeadlineSocket(sock, fetch)  # type: ignore[assignment] - what it uses of a socket
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("GET", target, headers={"Host": _host_header(host, port, scheme), "User-Agent": USER_AGENT,
                                                 "Accept": "*/*", "Accept-Encoding": "identity", "Connection": "close"})
            resp = conn.getresponse()
            if resp.status in REDIRECT_STATUSES:
                location = resp.getheader("Location")
                if not location:
                    raise _Refused(f"HTTP {resp.status} without a Location")
                url = urljoin(url, location.strip())
                continue
            if not 200 <= resp.status < 300:
                raise _Refused(f"HTTP {resp.status}")
            declared = (resp.getheader("Content-Length") or "").strip()
            if declared.isdigit() and int(declared) > fetch.limits.max_input_bytes:
                raise _TooLarge()
            return _copy_capped(resp.read, out, fetch)
        finally:
            if conn is not None:
                conn.close()
            sock.close()
    raise _Refused(f"more than {fetch.limits.input_max_redirects} redirects")


def s3_key(url: str, *, tenant_id: str, media_bucket: str | None) -> str:
    """The object key of an s3:// input the caller may read, or _Refused."""
    if media_bucket is None:
        raise _Refused("s3 input without a media bucket configured", "s3:// inputs are not accepted here")
    prefix = f"inputs/{tenant_id}/"
    hint = f"s3:// inputs must lie under s3://{media_bucket}/{prefix}"
    bucket, _, key = url[len("s3://"):].partition("/")
    if bucket != media_bucket:
        raise _Refused(f"s3 bucket {bucket!r} is not the media bucket", hint)
    segments = key.split("/")
    if not key.startswith(prefix) or any(s in ("", ".", "..") for s in segments):
        raise _Refused(f"s3 key {key!r} is outside {prefix}", hint)  # also catches inputs/<tenant>/../<other>/
    return key


def _s3_client(timeout: float):
    import boto3  # lazy: boto3 takes most of a second to import, and only the AWS path needs it
    from botocore.config import Config  # lazy: with boto3, above

    # No retries: a retry would start the timeouts afresh past the deadline. (The bucket is the
    # platform's own, so a dripping S3 is not a tenant's doing; the deadline is checked per chunk.)
    return boto3.client("s3", config=Config(connect_timeout=timeout, read_timeout=timeout,
                                            retries={"total_max_attempts": 1}))


def _fetch_s3(url: str, out, fetch: _Fetch) -> int:
    fetch.host = f"s3://{url[len('s3://'):].partition('/')[0]}"
    key = s3_key(url, tenant_id=fetch.tenant_id, media_bucket=fetch.media_bucket)
    cap = fetch.limits.max_input_bytes
    body = _s3_client(fetch.left()).get_object(Bucket=fetch.media_bucket, Key=key, Range=f"bytes=0-{cap}")["Body"]
    try:
        return _copy_capped(body.read, out, fetch)
    finally:
        body.close()


# --- probing ---------------------------------------------------------------------------------------

def _unreachable(fetch: _Fetch, reason: str, hint: str, *, refused: bool) -> InvalidRequest:
    log = logger.warning if refused else logger.info
    log("input refused" if refused else "input unreachable",
        extra={"field": fetch.field, "host": fetch.host, "reason": reason, "tenant_id": fetch.tenant_id})
    return InvalidRequest("input unreachable", {fetch.field: hint}, code="INPUT_UNREACHABLE")


@dataclass(frozen=True)
class MediaFacts:
    """What a media file really is, read from its streams (not from what anyone declared)."""

    kind: str  # image | video | audio
    container: str  # the demuxer's first name: mov (MP4 and QuickTime), matroska, ...
    video_codec: str | None
    duration_seconds: float | None  # the container's; None when it states none
    width: int | None
    height: int | None
    fps: float | None  # the video stream's average (else guessed) frame rate
    has_audio: bool


IMAGE_CODECS = ("png", "mjpeg", "webp", "bmp", "gif", "tiff")


def measure(path: str) -> MediaFacts:
    """Open a local file with PyAV and read its kind, container, codec, duration, size, frame rate
    and audio. Raises (ValueError, av.error.*) when it is not a readable image, video or audio file.
    Shared by input probing and the media worker (containers/gpu-render/worker.py)."""
    import av  # lazy: PyAV loads FFmpeg's libraries; only a request with inputs probes

    with av.open(path) as container:
        video = next(iter(container.streams.video), None)
        audio = next(iter(container.streams.audio), None)
        duration = float(container.duration / 1_000_000) if container.duration else None
        fps = None
        if video is not None:
            frames = video.frames or 0
            codec = video.codec_context.name
            is_image = (duration is None or duration == 0 or frames <= 1) and codec in IMAGE_CODECS
            kind = "image" if is_image else "video"
            width, height = video.codec_context.width, video.codec_context.height
            rate = video.average_rate or video.guessed_rate
            fps = round(float(rate), 3) if rate else None
        elif audio is not None:
            kind, codec, width, height = "audio", None, None, None
        else:
            raise ValueError("no audio or video stream")
        return MediaFacts(kind=kind, container=container.format.name.split(",")[0], video_codec=codec,
                          duration_seconds=duration, width=width, height=height, fps=fps, has_audio=audio is not None)


def probe(url: str, field: str, *, tenant_id, limits: Limits, media_bucket: str | None,
          request_deadline: float | None = None, allowance: Allowance | None = None) -> ProbedMedia:
    deadline = time.monotonic() + limits.input_fetch_deadline_seconds
    fetch = _Fetch(field, str(tenant_id), limits, media_bucket, allowance or Allowance.of(limits.probe_allowed_private_hosts),
                   deadline if request_deadline is None else min(deadline, request_deadline))
    max_bytes = limits.max_input_bytes
    with tempfile.NamedTemporaryFile(suffix=".media") as tmp:
        try:
            size = _fetch_s3(url, tmp, fetch) if url.startswith("s3://") else _fetch_http(url, tmp, fetch)
        except _TooLarge:
            logger.info("input too large", extra={"field": field, "host": fetch.host, "tenant_id": fetch.tenant_id})
            raise InvalidRequest("input too large", {field: f"input exceeds {max_bytes} bytes"}, code="INPUT_TOO_LARGE") from None
        except _Refused as e:
            raise _unreachable(fetch, e.reason, e.hint, refused=True) from None
        except Exception as e:  # socket, TLS, HTTP and botocore errors, the deadline: unusable either way
            raise _unreachable(fetch, f"{type(e).__name__}: {e}", UNREACHABLE, refused=False) from None
        tmp.flush()
        try:
            facts = measure(tmp.name)
        except Exception:
            raise InvalidRequest("input is not media", {field: "not a readable image, video or audio file"}, code="INPUT_NOT_MEDIA") from None
        kind, duration, width, height = facts.kind, facts.duration_seconds, facts.width, facts.height
    if kind != "image" and duration is not None and duration > limits.max_input_duration_seconds:
        raise InvalidRequest("input too long", {field: f"media lasts {duration:.1f} s; at most {limits.max_input_duration_seconds:.0f} s"},
                             code="INPUT_TOO_LONG")
    return ProbedMedia(url, kind, size, None if kind == "image" else duration, width, height)


def probe_inputs(inputs, *, tenant_id, limits: Limits, media_bucket: str | None) -> list[ProbedMedia]:
    """Probe each input in order, all of them within Limits.input_request_deadline_seconds; the first
    bad input raises InvalidRequest naming its field."""
    request_deadline = time.monotonic() + limits.input_request_deadline_seconds
    allowance = Allowance.of(limits.probe_allowed_private_hosts)
    out = []
    for i, ref in enumerate(inputs):
        field = f"body.inputs.{i}.url"
        m = probe(ref.url, field, tenant_id=tenant_id, limits=limits, media_bucket=media_bucket,
                  request_deadline=request_deadline, allowance=allowance)
        if m.kind != ref.kind:
            raise InvalidRequest("input kind mismatch", {f"body.inputs.{i}.kind": f"declared {ref.kind}, measured {m.kind}"})
        out.append(m)
    return out


# --- fetching for other callers (the media worker) ------------------------------------------------

FetchTooLarge = _TooLarge  # over the byte cap, by Content-Length or by the bytes read
FetchRefused = _Refused  # not fetched: an HTTP status, a redirect without Location, too many redirects, no address
FetchForbidden = _Forbidden  # (a FetchRefused) the address rules forbid the URL or an address it leads to
ALLOW_ANY_ADDRESS = Allowance.of(["0.0.0.0/0", "::/0"])  # only for a local simulator on the loopback


def fetch_url(url: str, out, *, max_bytes: int, deadline: float, allowance: Allowance | None = None,
              max_redirects: int = 3, purpose: str = "media") -> int:
    """Fetch an http(s) URL into the binary file `out` under the probe's rules: every hop's addresses
    global (unless `allowance` exempts them) and the socket opened to the checked address, at most
    `max_redirects` hops, `max_bytes` held while reading, `deadline` (time.monotonic()) bounding every
    resolve, connect, read and write. Returns the bytes written. Raises FetchTooLarge, FetchForbidden,
    FetchRefused, TimeoutError, or the socket, TLS or HTTP error."""
    limits = Limits(max_input_bytes=max_bytes, input_max_redirects=max_redirects)
    fetch = _Fetch(purpose, "-", limits, None, allowance or Allowance.of([]), deadline)
    return _fetch_http(url, out, fetch)
