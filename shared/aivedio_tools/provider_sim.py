"""A provider simulator implementing the whole of docs/provider-protocol.md, misbehaving in the
ways the contract allows, as the provider's SimulatorBehaviour configures.

    sim = SimulatorServer(provider_config, time_scale=50, port=0).start()
    sim.base_url; sim.truth; sim.stop()

What it does:
- Submit with Idempotency-Key: the same key returns the same job (200, the original answer) for the
  idempotency window, and never creates a second one within it. Keys are provider-wide.
- Per-account concurrency: a job occupies its account from creation until it is terminal (queued
  and running both count); a submit that would exceed max_concurrency gets 429 with Retry-After.
  429 bursts: a submit may start a burst during which its account answers 429 to every new job.
- Accept-then-timeout: the job is created, then the answer is held past the client's timeout, or
  the connection is reset. A 5xx may come before or after creating the job.
- Jobs wait in queued, then run, then succeed or fail (failure_rate; failed_but_charged_rate of the
  failures are charged anyway, and credit_note_rate of those are credited back). Cancel: queued is
  free, running pays the cancellation fee, terminal keeps its status.
- Webhooks to the job's callback_url, signed per Standard Webhooks, from background threads: dropped,
  duplicated (same webhook-id), delayed (so reordered), retried with backoff when refused.
- Invoices per UTC day and account: a line per charge and credit note; lines may be listed twice or a
  day late.
- Each succeeded job has a real MP4 at its output_url that matches its order: the ordered duration
  and resolution (854x480, 1280x720, 1920x1080, 3840x2160), AAC silence when audio was ordered;
  cheap to make (a flat frame at 2 fps, H.264 through PyAV's FFmpeg) and cached per (duration,
  resolution, audio), so many jobs cost one encode. Output misbehaviours (the behaviour's output_*_rate,
  or forced per job by "[sim:output=<kind>]" in the prompt): truncated, empty, not_video,
  wrong_duration, wrong_resolution, no_audio (see OUTPUT_FAULTS).
- Ground truth for tests: `simulator.truth` in-process, `GET /_truth` over HTTP.

Time: durations in the behaviour (queue, latency, bursts, webhook delays, the idempotency window,
Retry-After) are platform seconds; the simulator waits them divided by time_scale, and states them
undivided (Retry-After, /v1/meta), as the platform's Clock expects. Timestamps are wall-clock UTC.

Randomness: every draw comes from a Random seeded with the behaviour's seed plus what the draw is
about (the job, or the idempotency key and how many times it was submitted), so a run reproduces
whatever order concurrent requests arrive in.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import heapq
import io
import itertools
import json
import logging
import math
import random
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from decimal import ROUND_HALF_UP, Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

from aivedio.config import RESOLUTIONS, ConfigError, PlatformConfig, ProviderConfig, SimulatorBehaviour
from aivedio.providers.webhooks import decode_secret, sign_webhook

log = logging.getLogger("aivedio_tools.provider_sim")

MAX_BODY_BYTES = 1024 * 1024
AMOUNT_QUANTUM = Decimal("0.0001")
WEBHOOK_SENDERS = 4
WEBHOOK_TIMEOUT_SECONDS = 5.0  # real seconds a receiver has to answer one delivery
WEBHOOK_BACKOFF_SECONDS = 1.0  # platform seconds before the first retry; doubles each time
ERROR_CODES = (("GENERATION_FAILED", "the model could not render this prompt"),
               ("CONTENT_FILTERED", "the output was blocked by the safety filter"),
               ("INTERNAL_ERROR", "an internal error interrupted the render"))
OUTPUT_FPS = 2
OUTPUT_AUDIO_RATE = 24_000  # mono AAC silence
OUTPUT_DIMENSIONS = {"480p": (854, 480), "720p": (1280, 720), "1080p": (1920, 1080), "4k": (3840, 2160)}
# (kind, the behaviour's rate field), in the order they are drawn for a job
OUTPUT_FAULTS = (("truncated", "output_truncated_rate"), ("empty", "output_empty_rate"),
                 ("not_video", "output_not_video_rate"), ("wrong_duration", "output_wrong_duration_rate"),
                 ("wrong_resolution", "output_wrong_resolution_rate"), ("no_audio", "output_no_audio_rate"))
OUTPUT_FAULT_MARKER = re.compile(r"\[sim:output=([a-z_]+)\]")
NOT_VIDEO_BODY = b"<!doctype html><html><body><h1>503 Service Unavailable</h1></body></html>\n"


def _iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _amount(d: Decimal) -> str:
    return str(d.quantize(AMOUNT_QUANTUM, rounding=ROUND_HALF_UP))


def _digest(*parts: object) -> str:
    return hashlib.sha256("|".join(str(p) for p in parts).encode()).hexdigest()


# --- the MP4 ---------------------------------------------------------------------------------------------

_CODEC: str | None = None


def _codec() -> str:
    global _CODEC
    if _CODEC is None:
        import av  # lazy: PyAV loads FFmpeg's libraries; only the simulator's outputs need it

        _CODEC = "mpeg4"
        for name in ("libx264", "h264", "mpeg4"):
            try:
                av.codec.Codec(name, "w")
            except Exception:  # this FFmpeg build lacks the encoder
                continue
            _CODEC = name
            break
    return _CODEC


_MP4_LOCK = threading.Lock()  # one encode at a time: concurrent fetches of one order wait for its cache entry


def make_mp4(duration_seconds: float, resolution: str, with_audio: bool) -> bytes:
    """A real MP4 matching an order: `duration_seconds` long, the resolution's dimensions, H.264 at
    OUTPUT_FPS of one flat frame, plus mono AAC silence when `with_audio`. Cached per argument triple."""
    if resolution not in OUTPUT_DIMENSIONS:
        raise ValueError(f"resolution must be one of {sorted(OUTPUT_DIMENSIONS)}, not {resolution!r}")
    if not (math.isfinite(duration_seconds) and duration_seconds > 0):
        raise ValueError(f"duration_seconds must be > 0, not {duration_seconds!r}")
    with _MP4_LOCK:
        return _make_mp4(float(duration_seconds), resolution, bool(with_audio))


@functools.lru_cache(maxsize=32)
def _make_mp4(duration_seconds: float, resolution: str, with_audio: bool) -> bytes:
    import av  # lazy: PyAV loads FFmpeg's libraries; only the simulator's outputs need it

    width, height = OUTPUT_DIMENSIONS[resolution]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream(_codec(), rate=OUTPUT_FPS)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        if stream.codec_context.name in ("libx264", "h264"):
            stream.options = {"preset": "ultrafast"}
        sound = None
        if with_audio:
            sound = container.add_stream("aac", rate=OUTPUT_AUDIO_RATE, layout="mono")
        frame = av.VideoFrame(width, height, "yuv420p")
        for plane, value in zip(frame.planes, (96, 128, 160)):  # one flat colour
            plane.update(bytes([value]) * plane.buffer_size)
        for i in range(max(1, round(duration_seconds * OUTPUT_FPS))):
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if sound is not None:
            samples, chunk = round(duration_seconds * OUTPUT_AUDIO_RATE), 1024
            for start in range(0, samples, chunk):
                n = min(chunk, samples - start)
                silence = av.AudioFrame(format="fltp", layout="mono", samples=n)
                silence.planes[0].update(bytes(silence.planes[0].buffer_size))
                silence.sample_rate, silence.pts = OUTPUT_AUDIO_RATE, start
                for packet in sound.encode(silence):
                    container.mux(packet)
            for packet in sound.encode():
                container.mux(packet)
    return buf.getvalue()


def output_fault(behaviour: SimulatorBehaviour, prompt: str, rng: random.Random) -> str | None:
    """The output misbehaviour of one job: forced by "[sim:output=<kind>]" in its prompt, else drawn
    from the behaviour's output_*_rate (every rate is drawn, so one rate never shifts another's draws)."""
    forced = OUTPUT_FAULT_MARKER.search(prompt)
    drawn = [kind for kind, rate in OUTPUT_FAULTS if rng.random() < getattr(behaviour, rate)]
    if forced and forced.group(1) in dict(OUTPUT_FAULTS):
        return forced.group(1)
    return drawn[0] if drawn else None


def output_bytes(duration_seconds: float, resolution: str, with_audio: bool, fault: str | None) -> bytes:
    """The bytes a succeeded job serves at its output_url, its fault applied."""
    if fault == "empty":
        return b""
    if fault == "not_video":
        return NOT_VIDEO_BODY
    if fault == "wrong_duration":
        duration_seconds = duration_seconds / 2 if duration_seconds >= 4 else duration_seconds + 3
    if fault == "wrong_resolution":
        i = RESOLUTIONS.index(resolution)
        resolution = RESOLUTIONS[i - 1] if i > 0 else RESOLUTIONS[1]
    data = make_mp4(duration_seconds, resolution, with_audio and fault != "no_audio")
    return data[: len(data) // 2] if fault == "truncated" else data


# --- state -----------------------------------------------------------------------------------------------

@dataclass
class _Job:
    id: str
    account_id: str
    idempotency_key: str
    client_request_id: str
    body: dict[str, Any]
    created_at: datetime
    created_mono: float
    start_due: float
    finish_due: float
    planned_outcome: str  # succeeded | failed
    charge_on_failure: bool
    credit_note: bool
    error: dict[str, str] | None
    created_by: str  # "201", "accept_then_timeout:delay", "accept_then_timeout:drop", "5xx"
    output_fault: str | None = None  # OUTPUT_FAULTS kind served at output_url, None: a good clip
    status: str = "queued"
    started_at: datetime | None = None
    finished_at: datetime | None = None
    cancel_requested_at: datetime | None = None
    usage: dict[str, Any] | None = None
    charge_id: str | None = None
    submit_requests: int = 1
    submit_answer: dict[str, Any] = field(default_factory=dict)
    lines: list[dict[str, Any]] = field(default_factory=list)
    webhook: dict[str, Any] | None = None

    @property
    def model(self) -> str:
        return self.body["model"]

    def doc(self, base_url: str) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "status": self.status, "created_at": _iso(self.created_at)}
        if self.finished_at is not None:
            d["finished_at"] = _iso(self.finished_at)
        if self.status == "succeeded":
            d["output_url"] = f"{base_url}/v1/outputs/{self.id}.mp4"
        if self.status == "failed" and self.error:
            d["error"] = dict(self.error)
        if self.usage is not None:
            d["usage"] = dict(self.usage)
        if self.charge_id is not None:
            d["charge_id"] = self.charge_id
        return d


def _answer_status(r: Any) -> str | None:
    try:
        doc = r.json()
    except ValueError:
        return None
    return doc.get("status") if isinstance(doc, dict) else None


@dataclass(order=True)
class _Delivery:
    due: float
    seq: int
    job_id: str = field(compare=False)
    webhook_id: str = field(compare=False)
    copy: int = field(compare=False)
    url: str = field(compare=False)
    body: bytes = field(compare=False)
    attempt: int = field(default=0, compare=False)


class _Reply:
    """What the HTTP layer should do: answer, hold the answer back, or reset the connection."""

    def __init__(self, status: int, doc: Any = None, headers: dict[str, str] | None = None, *,
                 hold_seconds: float = 0.0, reset: bool = False, raw: bytes | None = None, content_type: str = "application/json"):
        self.status, self.doc, self.headers = status, doc, headers or {}
        self.hold_seconds, self.reset, self.raw, self.content_type = hold_seconds, reset, raw, content_type


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> _Reply:
    return _Reply(status, {"error": {"code": code, "message": message}}, headers)


class Simulator:
    """The provider's state and rules, independent of HTTP. Thread-safe: one lock over everything;
    a scheduler thread moves jobs along their timelines, sender threads deliver webhooks."""

    def __init__(self, provider_config: ProviderConfig, behaviour: SimulatorBehaviour | None = None,
                 time_scale: float = 1.0):
        if time_scale <= 0:
            raise ConfigError("time_scale: must be > 0")
        self.config = provider_config
        self.behaviour = behaviour or provider_config.simulator
        self.time_scale = time_scale
        self.base_url = ""  # set by the server once it listens
        keys: dict[str, str] = {}
        for a in provider_config.accounts:
            if a.api_key in keys:
                raise ConfigError(f"providers.{provider_config.name}.accounts: accounts {keys[a.api_key]!r} and "
                                  f"{a.account_id!r} share an api_key, so the simulator cannot tell them apart")
            keys[a.api_key] = a.account_id
        self._account_by_key = keys
        decode_secret(provider_config.webhook_secret)  # a bad secret fails now, not at the first webhook
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._jobs: dict[str, _Job] = {}
        self._by_key: dict[str, list[str]] = {}  # idempotency key -> job ids, oldest first
        self._by_crid: dict[str, list[str]] = {}
        self._submits_per_key: dict[str, int] = {}
        self._timeline: list[tuple[float, int, str, str]] = []  # (due, seq, action, job_id)
        self._seq = itertools.count()
        self._active = {a.account_id: 0 for a in provider_config.accounts}
        self._peak = dict(self._active)
        self._burst_until = {a.account_id: 0.0 for a in provider_config.accounts}
        self._lines: list[dict[str, Any]] = []
        self._counters: dict[str, int] = dict.fromkeys(
            ("requests", "created", "replayed", "rate_limited", "burst_rate_limited", "rejected", "unauthorized",
             "accept_then_timeout", "server_errors", "server_errors_after_create"), 0)
        self._webhook_counters: dict[str, int] = dict.fromkeys(
            ("events", "dropped", "duplicated", "copies", "attempts", "delivered", "refused", "gave_up"), 0)
        self._deliveries: list[_Delivery] = []
        self._deliveries_cv = threading.Condition(threading.Lock())
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._http: httpx.Client | None = None

    # -- lifecycle --

    def start(self) -> None:
        self._stop.clear()
        self._http = httpx.Client(timeout=WEBHOOK_TIMEOUT_SECONDS, headers={"User-Agent": "aivedio-provider-sim/1"})
        self._threads = [threading.Thread(target=self._run_timeline, name=f"sim-{self.config.name}-jobs", daemon=True)]
        self._threads += [threading.Thread(target=self._run_webhooks, name=f"sim-{self.config.name}-webhooks-{i}", daemon=True)
                          for i in range(WEBHOOK_SENDERS)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        with self._deliveries_cv:
            self._deliveries_cv.notify_all()
        for t in self._threads:
            t.join(5)
        self._threads = []
        if self._http is not None:
            self._http.close()
            self._http = None

    # -- helpers --

    def _rng(self, *about: object) -> random.Random:
        return random.Random(_digest(self.behaviour.seed, self.config.name, *about))

    def _real(self, platform_seconds: float) -> float:
        return platform_seconds / self.time_scale

    def _window_real(self) -> float:
        return self._real(self.behaviour.idempotency_window_seconds)

    def account_for(self, authorization: str | None) -> str | None:
        if not authorization or not authorization.startswith("Bearer "):
            return None
        return self._account_by_key.get(authorization[len("Bearer "):].strip())

    def _live(self, ids: list[str], now: float) -> list[_Job]:
        """Jobs whose key is still inside the idempotency window (older ones are forgotten)."""
        return [self._jobs[i] for i in ids if now - self._jobs[i].created_mono < self._window_real()]

    # -- the timeline --

    def _schedule(self, due: float, action: str, job_id: str) -> None:
        heapq.heappush(self._timeline, (due, next(self._seq), action, job_id))
        self._wake.notify()

    def _advance(self, now: float) -> None:
        """Apply every transition due by `now` (under the lock)."""
        while self._timeline and self._timeline[0][0] <= now:
            _, _, action, job_id = heapq.heappop(self._timeline)
            job = self._jobs[job_id]
            if action == "start" and job.status == "queued":
                job.status, job.started_at = "running", datetime.now(timezone.utc)
            elif action == "finish" and job.status == "running":
                self._finish(job)

    def _run_timeline(self) -> None:
        with self._wake:
            while not self._stop.is_set():
                now = time.monotonic()
                self._advance(now)
                wait = min(0.5, self._timeline[0][0] - now) if self._timeline else 0.5
                self._wake.wait(max(wait, 0.001))

    def _finish(self, job: _Job) -> None:
        b = self.behaviour
        job.finished_at = datetime.now(timezone.utc)
        seconds = job.body["duration_seconds"]
        cost = Decimal(b.cost_per_second) * Decimal(str(seconds))
        if job.planned_outcome == "succeeded":
            job.status = "succeeded"
            self._charge(job, cost, seconds)
        else:
            job.status = "failed"
            if job.charge_on_failure:
                self._charge(job, cost, seconds)
                if job.credit_note:
                    self._line(job, "credit_note", cost, job.finished_at + timedelta(milliseconds=1))
            else:
                job.usage = {"seconds": 0, "cost_amount": _amount(Decimal(0)), "currency": b.currency}
        self._release(job)

    def _charge(self, job: _Job, cost: Decimal, seconds: float) -> None:
        job.charge_id = "ch_" + _digest("charge", job.id)[:24]
        job.usage = {"seconds": seconds, "cost_amount": _amount(cost), "currency": self.behaviour.currency}
        assert job.finished_at is not None
        self._line(job, "charge", cost, job.finished_at)

    def _line(self, job: _Job, kind: str, amount: Decimal, at: datetime) -> None:
        assert job.charge_id is not None
        rng = self._rng("invoice-line", job.id, kind)
        late, dup = rng.random() < self.behaviour.invoice_late_rate, rng.random() < self.behaviour.invoice_duplicate_rate
        line = {"line_id": "ln_" + _digest("line", job.id, kind)[:24], "charge_id": job.charge_id, "job_id": job.id,
                "idempotency_key": job.idempotency_key, "account_id": job.account_id, "model": job.model, "type": kind,
                "amount": _amount(amount), "currency": self.behaviour.currency, "occurred_at": _iso(at)}
        billed = at.astimezone(timezone.utc).date() + timedelta(days=1 if late else 0)
        record = {"line": line, "billed_date": billed.isoformat(), "copies": 2 if dup else 1, "late": late}
        self._lines.append(record)
        job.lines.append(record)

    def _release(self, job: _Job) -> None:
        self._active[job.account_id] -= 1
        self._webhook(job)

    # -- webhooks --

    def _webhook(self, job: _Job) -> None:
        url = job.body.get("callback_url")
        if not url:
            return
        b = self.behaviour
        event = f"job.{job.status}"
        rng = self._rng("webhook", job.id, event)
        drop, dup = rng.random() < b.webhook_drop_rate, rng.random() < b.webhook_duplicate_rate
        delays = [rng.uniform(0, b.webhook_delay_seconds_max) for _ in range(2)]
        webhook_id = "msg_" + _digest("webhook", job.id, event)[:24]
        copies = 0 if drop else 2 if dup else 1
        job.webhook = {"webhook_id": webhook_id, "type": event, "dropped": drop, "copies": copies,
                       "delivered": 0, "attempts": 0}
        self._webhook_counters["events"] += 1
        self._webhook_counters["dropped"] += int(drop)
        self._webhook_counters["duplicated"] += int(dup and not drop)
        self._webhook_counters["copies"] += copies
        if not copies:
            return
        body = json.dumps({"type": event, "data": job.doc(self.base_url)}, separators=(",", ":")).encode()
        now = time.monotonic()
        with self._deliveries_cv:
            for c in range(copies):
                heapq.heappush(self._deliveries, _Delivery(now + self._real(delays[c]), next(self._seq), job.id, webhook_id, c, url, body))
            self._deliveries_cv.notify_all()

    def _run_webhooks(self) -> None:
        while not self._stop.is_set():
            with self._deliveries_cv:
                while not self._stop.is_set():
                    now = time.monotonic()
                    if self._deliveries and self._deliveries[0].due <= now:
                        d = heapq.heappop(self._deliveries)
                        break
                    wait = self._deliveries[0].due - now if self._deliveries else 0.5
                    self._deliveries_cv.wait(min(max(wait, 0.001), 0.5))
                else:
                    return
            self._deliver(d)

    def _deliver(self, d: _Delivery) -> None:
        headers = sign_webhook(self.config.webhook_secret, d.webhook_id, int(time.time()), d.body)
        headers["Content-Type"] = "application/json"
        ok, status, answer = False, None, None
        try:
            assert self._http is not None
            r = self._http.post(d.url, content=d.body, headers=headers)
            status, ok = r.status_code, 200 <= r.status_code < 300
            answer = _answer_status(r)
        except Exception as e:  # the receiver is down or slow: retry like a refusal
            status = repr(e)
        with self._lock:
            job = self._jobs[d.job_id]
            assert job.webhook is not None
            job.webhook["attempts"] += 1
            self._webhook_counters["attempts"] += 1
            if ok:
                # What the receiver said it did with this copy ("applied", "duplicate", "parked"):
                # the ground truth that a webhook-id was applied once (aivedio_tools.chaos.checkers).
                job.webhook.setdefault("answers", []).append(answer)
                job.webhook["delivered"] += 1
                self._webhook_counters["delivered"] += 1
                return
            self._webhook_counters["refused"] += 1
            job.webhook["last_failure"] = status
        if d.attempt + 1 >= self.behaviour.webhook_max_attempts or self._stop.is_set():
            with self._lock:
                self._webhook_counters["gave_up"] += 1
            return
        d.attempt += 1
        d.due = time.monotonic() + self._real(WEBHOOK_BACKOFF_SECONDS * 2 ** (d.attempt - 1))
        with self._deliveries_cv:
            heapq.heappush(self._deliveries, d)
            self._deliveries_cv.notify()

    # -- the API --

    def submit(self, account_id: str, key: str | None, body: Any) -> _Reply:
        b = self.behaviour
        with self._lock:
            self._counters["requests"] += 1
            if not key:
                self._counters["rejected"] += 1
                return _error(400, "IDEMPOTENCY_KEY_REQUIRED", "the Idempotency-Key header is required")
            if len(key) > 255:
                self._counters["rejected"] += 1
                return _error(400, "INVALID_IDEMPOTENCY_KEY", "Idempotency-Key: at most 255 characters")
            now = time.monotonic()
            self._advance(now)
            n = self._submits_per_key.get(key, 0)
            self._submits_per_key[key] = n + 1
            live = self._live(self._by_key.get(key, []), now)
            if live:  # a replay: the original answer, whatever this body says
                job = live[-1]
                job.submit_requests += 1
                self._counters["replayed"] += 1
                return _Reply(200, dict(job.submit_answer), {"Idempotent-Replayed": "true"})
            problem = self._validate(body)
            if problem is not None:
                self._counters["rejected"] += 1
                return problem
            rng = self._rng("submit", key, n)
            timeout = rng.random() < b.accept_then_timeout_rate
            mode = b.accept_then_timeout_mode if b.accept_then_timeout_mode != "mixed" else rng.choice(("delay", "drop"))
            server_error = rng.random() < b.server_error_rate
            error_after_create = rng.random() < 0.5
            error_status = rng.choice((500, 502, 503))
            burst = rng.random() < b.burst_429_rate
            if server_error and not error_after_create:
                self._counters["server_errors"] += 1
                return _error(error_status, "INTERNAL", "the provider failed before creating the job")
            if now < self._burst_until[account_id] or burst:
                if now >= self._burst_until[account_id]:
                    self._burst_until[account_id] = now + self._real(b.burst_429_seconds)
                self._counters["rate_limited"] += 1
                self._counters["burst_rate_limited"] += 1
                remaining = (self._burst_until[account_id] - now) * self.time_scale
                # min(): scaling back to platform seconds can overshoot the burst by a float ulp.
                wait = min(int(b.burst_429_seconds), max(1, math.ceil(remaining)))
                return _error(429, "RATE_LIMITED", "too many requests", {"Retry-After": str(wait)})
            limit = self._limit(account_id)
            if self._active[account_id] >= limit:
                self._counters["rate_limited"] += 1
                return _error(429, "CONCURRENCY_LIMIT", f"account {account_id} is at its concurrency limit of {limit}",
                              {"Retry-After": str(b.retry_after_seconds)})
            created_by = (f"{error_status}" if server_error else f"accept_then_timeout:{mode}" if timeout else "201")
            job = self._create(account_id, key, body, now, len(self._by_key.get(key, [])), created_by)
        if server_error:
            with self._lock:
                self._counters["server_errors"] += 1
                self._counters["server_errors_after_create"] += 1
            return _error(error_status, "INTERNAL", "the provider failed while answering")
        if timeout:
            with self._lock:
                self._counters["accept_then_timeout"] += 1
            if mode == "drop":
                return _Reply(201, job.submit_answer, reset=True)
            hold = b.accept_then_timeout_hold_seconds or (1.5 * self.config.submit_timeout_seconds + 0.2)
            return _Reply(201, job.submit_answer, hold_seconds=hold)
        return _Reply(201, job.submit_answer)

    def _limit(self, account_id: str) -> int:
        return next(a.max_concurrency for a in self.config.accounts if a.account_id == account_id)

    def _validate(self, body: Any) -> _Reply | None:
        if not isinstance(body, dict):
            return _error(400, "INVALID_BODY", "the body must be a JSON object")
        types = {"model": str, "prompt": str, "duration_seconds": (int, float), "resolution": str,
                 "with_audio": bool, "inputs": list, "client_request_id": str}
        for name, kind in types.items():
            v = body.get(name)
            if v is None:
                return _error(400, "MISSING_FIELD", f"{name}: required")
            if not isinstance(v, kind) or (kind == (int, float) and isinstance(v, bool)):
                return _error(400, "INVALID_FIELD", f"{name}: wrong type")
        if not body["client_request_id"]:
            return _error(400, "INVALID_FIELD", "client_request_id: must not be empty")
        cb = body.get("callback_url")
        if cb is not None and (not isinstance(cb, str) or not cb.startswith(("http://", "https://"))):
            return _error(400, "INVALID_FIELD", "callback_url: expected an http(s) URL")
        if body["model"] not in self.config.models:
            return _error(422, "UNSUPPORTED_MODEL", f"model {body['model']!r} is not offered")
        if not body["prompt"].strip():
            return _error(422, "EMPTY_PROMPT", "prompt: must not be empty")
        d = body["duration_seconds"]
        if not (math.isfinite(d) and 0 < d <= self.config.max_duration_seconds):
            return _error(422, "UNSUPPORTED_DURATION", f"duration_seconds: must be in (0, {self.config.max_duration_seconds}]")
        if body["resolution"] not in RESOLUTIONS or RESOLUTIONS.index(body["resolution"]) > RESOLUTIONS.index(self.config.max_resolution):
            return _error(422, "UNSUPPORTED_RESOLUTION", f"resolution: at most {self.config.max_resolution}")
        return None

    def _create(self, account_id: str, key: str, body: dict[str, Any], now: float, nth: int, created_by: str) -> _Job:
        b = self.behaviour
        job_id = "job_" + _digest("job", key, nth)[:24]
        rng = self._rng("job", job_id)
        queue = rng.uniform(b.queue_seconds_min, b.queue_seconds_max)
        latency = rng.uniform(b.latency_seconds_min, b.latency_seconds_max)
        fails = rng.random() < b.failure_rate
        charged, credited = rng.random() < b.failed_but_charged_rate, rng.random() < b.credit_note_rate
        code, message = rng.choice(ERROR_CODES)
        created_at = datetime.now(timezone.utc)
        start_due = now + self._real(queue)
        job = _Job(id=job_id, account_id=account_id, idempotency_key=key, client_request_id=body["client_request_id"],
                   body=copy.deepcopy(body), created_at=created_at, created_mono=now, start_due=start_due,
                   finish_due=start_due + self._real(latency), planned_outcome="failed" if fails else "succeeded",
                   charge_on_failure=fails and charged, credit_note=fails and charged and credited,
                   error={"code": code, "message": message} if fails else None, created_by=created_by,
                   output_fault=output_fault(b, body["prompt"], self._rng("output", job_id)))
        job.submit_answer = {"id": job_id, "status": "queued", "created_at": _iso(created_at)}
        self._jobs[job_id] = job
        self._by_key.setdefault(key, []).append(job_id)
        self._by_crid.setdefault(job.client_request_id, []).append(job_id)
        self._active[account_id] += 1
        self._peak[account_id] = max(self._peak[account_id], self._active[account_id])
        self._counters["created"] += 1
        self._schedule(job.start_due, "start", job_id)
        self._schedule(job.finish_due, "finish", job_id)
        return job

    def get(self, job_id: str) -> _Reply:
        with self._lock:
            self._advance(time.monotonic())
            job = self._jobs.get(job_id)
            if job is None:
                return _error(404, "NOT_FOUND", f"no job {job_id}")
            return _Reply(200, job.doc(self.base_url))

    def find(self, query: dict[str, list[str]]) -> _Reply:
        key, crid = query.get("idempotency_key", [None])[0], query.get("client_request_id", [None])[0]
        if not key and not crid:
            return _error(400, "MISSING_QUERY", "give idempotency_key or client_request_id")
        with self._lock:
            now = time.monotonic()
            self._advance(now)
            found = None
            if key:
                found = self._live(self._by_key.get(key, []), now)
            if crid:
                by_crid = self._live(self._by_crid.get(crid, []), now)
                ids = {j.id for j in by_crid}
                found = by_crid if found is None else [j for j in found if j.id in ids]
            return _Reply(200, {"items": [j.doc(self.base_url) for j in found or []]})

    def cancel(self, job_id: str) -> _Reply:
        with self._lock:
            self._advance(time.monotonic())
            job = self._jobs.get(job_id)
            if job is None:
                return _error(404, "NOT_FOUND", f"no job {job_id}")
            if job.cancel_requested_at is None:
                job.cancel_requested_at = datetime.now(timezone.utc)
            if job.status in ("queued", "running"):
                stage = job.status
                job.status, job.finished_at = "cancelled", datetime.now(timezone.utc)
                if stage == "queued":
                    job.usage = {"seconds": 0, "cost_amount": _amount(Decimal(0)), "currency": self.behaviour.currency}
                else:
                    assert job.started_at is not None
                    ran = round((job.finished_at - job.started_at).total_seconds() * self.time_scale, 3)
                    fee = Decimal(self.behaviour.cancellation_fee)
                    job.charge_id = "ch_" + _digest("charge", job.id)[:24]
                    job.usage = {"seconds": ran, "cost_amount": _amount(fee), "currency": self.behaviour.currency}
                    if fee > 0:
                        self._line(job, "charge", fee, job.finished_at)
                    else:
                        job.charge_id = None
                self._release(job)
            return _Reply(200, {"id": job.id, "status": job.status})

    def meta(self) -> _Reply:
        return _Reply(200, {"idempotency_window_seconds": self.behaviour.idempotency_window_seconds})

    def invoices(self, account_id: str, query: dict[str, list[str]]) -> _Reply:
        """The day's lines of the account the request authenticates as (each account has its invoice)."""
        raw = query.get("date", [""])[0]
        try:
            day = date.fromisoformat(raw)
            if len(raw) != 10:
                raise ValueError
        except ValueError:
            return _error(400, "INVALID_DATE", "date: expected YYYY-MM-DD")
        with self._lock:
            self._advance(time.monotonic())
            lines = [dict(r["line"]) for r in sorted(self._lines, key=lambda r: r["line"]["occurred_at"])
                     if r["billed_date"] == day.isoformat() and r["line"]["account_id"] == account_id
                     for _ in range(r["copies"])]
        return _Reply(200, {"lines": lines})

    def output(self, name: str) -> _Reply:
        job_id = name[:-4] if name.endswith(".mp4") else name
        with self._lock:
            self._advance(time.monotonic())
            job = self._jobs.get(job_id)
            if job is None or job.status != "succeeded":
                return _error(404, "NOT_FOUND", f"no output for {job_id}")
            order = (job.body["duration_seconds"], job.body["resolution"], bool(job.body.get("with_audio")))
            fault = job.output_fault
        return _Reply(200, raw=output_bytes(*order, fault), content_type="video/mp4")

    # -- ground truth --

    @property
    def truth(self) -> dict[str, Any]:
        """Everything the simulator did, as plain data (a copy): every job it created with its key,
        the peak and current concurrency per account, and counters of what it answered."""
        with self._lock:
            self._advance(time.monotonic())
            jobs = [{
                "id": j.id, "account_id": j.account_id, "idempotency_key": j.idempotency_key,
                "client_request_id": j.client_request_id, "model": j.model, "duration_seconds": j.body["duration_seconds"],
                "resolution": j.body["resolution"], "callback_url": j.body.get("callback_url"), "status": j.status,
                "created_at": _iso(j.created_at), "started_at": j.started_at and _iso(j.started_at),
                "finished_at": j.finished_at and _iso(j.finished_at),
                "cancel_requested_at": j.cancel_requested_at and _iso(j.cancel_requested_at),
                "planned_outcome": j.planned_outcome, "created_by": j.created_by, "submit_requests": j.submit_requests,
                "usage": copy.deepcopy(j.usage), "charge_id": j.charge_id, "error": copy.deepcopy(j.error),
                "charges": [{**r["line"], "billed_date": r["billed_date"], "copies": r["copies"]} for r in j.lines],
                "webhook": copy.deepcopy(j.webhook), "output_fault": j.output_fault,
            } for j in self._jobs.values()]
            return {
                "provider": self.config.name, "seed": self.behaviour.seed, "time_scale": self.time_scale,
                "jobs": jobs,
                "accounts": {a.account_id: {"max_concurrency": a.max_concurrency, "current": self._active[a.account_id],
                                            "peak": self._peak[a.account_id]} for a in self.config.accounts},
                "submits": dict(self._counters),
                "webhooks": dict(self._webhook_counters),
                "invoice_lines": [{**r["line"], "billed_date": r["billed_date"], "copies": r["copies"]} for r in self._lines],
            }


# --- HTTP ------------------------------------------------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "aivedio-provider-sim"
    timeout = 30  # an idle keep-alive connection frees its thread after this (clients keep them ~5 s)
    disable_nagle_algorithm = True  # headers and body go in separate writes: no 40 ms delayed-ACK stalls
    server: "_Server"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def do_PATCH(self) -> None:
        self._route("PATCH")

    def _body(self) -> bytes | None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY_BYTES:
            return None
        return self.rfile.read(length) if length else b""

    def _route(self, method: str) -> None:
        sim = self.server.simulator
        url = urlsplit(self.path)
        path, query = url.path.rstrip("/") or "/", parse_qs(url.query)
        parts = path.strip("/").split("/")
        body = self._body() if method in ("POST", "PUT", "PATCH") else b""
        if body is None:
            return self._send(_error(400, "INVALID_BODY", "missing, invalid or too large Content-Length"), close=True)
        if path == "/_truth" and method == "GET":
            return self._send(_Reply(200, sim.truth))
        if len(parts) == 3 and parts[:2] == ["v1", "outputs"] and method in ("GET", "HEAD"):
            return self._send(sim.output(parts[2]))
        if parts[0] != "v1":
            return self._send(_error(404, "NOT_FOUND", f"no route {path}"))
        account = sim.account_for(self.headers.get("Authorization"))
        if account is None:
            with sim._lock:
                sim._counters["unauthorized"] += 1
            return self._send(_error(401, "UNAUTHENTICATED", "a valid Bearer api key is required",
                                     {"WWW-Authenticate": "Bearer"}))
        rest = parts[1:]
        if rest == ["jobs"] and method == "POST":
            try:
                doc = json.loads(body or b"null")
            except ValueError:
                return self._send(_error(400, "INVALID_JSON", "the body is not JSON"))
            return self._send(sim.submit(account, self.headers.get("Idempotency-Key"), doc))
        if rest == ["jobs"] and method == "GET":
            return self._send(sim.find(query))
        if len(rest) == 2 and rest[0] == "jobs" and method == "GET":
            return self._send(sim.get(rest[1]))
        if len(rest) == 3 and rest[0] == "jobs" and rest[2] == "cancel" and method == "POST":
            return self._send(sim.cancel(rest[1]))
        if rest == ["meta"] and method == "GET":
            return self._send(sim.meta())
        if rest == ["invoices"] and method == "GET":
            return self._send(sim.invoices(account, query))
        return self._send(_error(404, "NOT_FOUND", f"no route {method} {path}"))

    def _send(self, reply: _Reply, close: bool = False) -> None:
        if reply.reset:  # the job exists; the client gets a reset connection instead of an answer
            self.close_connection = True
            try:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
            return
        if reply.hold_seconds and self.server.stopping.wait(reply.hold_seconds):
            self.close_connection = True
            return
        data = reply.raw if reply.raw is not None else json.dumps(reply.doc, separators=(",", ":")).encode()
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            for k, v in reply.headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except OSError:  # the client gave up (its timeout passed): nothing to answer
            self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024  # bursts of concurrent submits must not be reset by the listen backlog

    def __init__(self, address: tuple[str, int], simulator: Simulator):
        self.simulator = simulator
        self.stopping = threading.Event()
        super().__init__(address, _Handler)


class SimulatorServer:
    """A Simulator behind its HTTP server: SimulatorServer(provider_config, behaviour, time_scale,
    port=0).start(); .base_url; .truth; .stop(). Also a context manager."""

    def __init__(self, provider_config: ProviderConfig, behaviour: SimulatorBehaviour | None = None,
                 time_scale: float = 1.0, port: int = 0, host: str = "127.0.0.1"):
        self.simulator = Simulator(provider_config, behaviour, time_scale)
        self.host, self.port = host, port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("SimulatorServer is not started")
        host, port = self._server.server_address[:2]
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return f"http://{host}:{port}"

    @property
    def truth(self) -> dict[str, Any]:
        return self.simulator.truth

    @property
    def name(self) -> str:
        return self.simulator.config.name

    def start(self) -> "SimulatorServer":
        self._server = _Server((self.host, self.port), self.simulator)
        self.simulator.base_url = self.base_url
        self.simulator.start()
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"sim-{self.name}-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stopping.set()
            self._server.shutdown()
            if self._thread is not None:
                self._thread.join(5)
            self._server.server_close()
            self._server = None
            self._thread = None
        self.simulator.stop()

    def __enter__(self) -> "SimulatorServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_simulators(config: PlatformConfig, host: str = "127.0.0.1") -> dict[str, SimulatorServer]:
    """One started simulator per provider whose config entry has no base_url (for `serve`); the
    adapters take their addresses: build_adapters(config.providers, {n: s.base_url for n, s in sims.items()})."""
    started: dict[str, SimulatorServer] = {}
    try:
        for p in config.providers:
            if p.base_url is None:
                started[p.name] = SimulatorServer(p, p.simulator, config.time_scale, port=0, host=host).start()
    except BaseException:
        for s in started.values():
            s.stop()
        raise
    return started
