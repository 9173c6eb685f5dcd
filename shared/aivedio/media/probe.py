"""Measure input media on the server (PyAV). Declared sizes and durations are never trusted: each
input is fetched with a byte cap, opened, and its real kind, duration and size are read."""
from __future__ import annotations

import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Iterable

from aivedio.errors import InvalidRequest

CHUNK = 1 << 16


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


def _copy_capped(chunks: Iterable[bytes], out, max_bytes: int) -> int:
    n = 0
    for chunk in chunks:
        n += len(chunk)
        if n > max_bytes:
            raise _TooLarge()
        out.write(chunk)
    return n


def _http_chunks(url: str, timeout: float):
    req = urllib.request.Request(url, headers={"User-Agent": "aivedio-probe/1"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - scheme checked by the request model
        while chunk := resp.read(CHUNK):
            yield chunk


def _s3_chunks(url: str, max_bytes: int):
    import boto3

    bucket, _, key = url[len("s3://"):].partition("/")
    body = boto3.client("s3").get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{max_bytes}")["Body"]
    yield from body.iter_chunks(CHUNK)


def probe(url: str, field: str, *, max_bytes: int, max_duration_seconds: float, timeout: float = 10.0) -> ProbedMedia:
    import av

    with tempfile.NamedTemporaryFile(suffix=".media") as tmp:
        try:
            chunks = _s3_chunks(url, max_bytes) if url.startswith("s3://") else _http_chunks(url, timeout)
            size = _copy_capped(chunks, tmp, max_bytes)
        except _TooLarge:
            raise InvalidRequest("input too large", {field: f"input exceeds {max_bytes} bytes"}, code="INPUT_TOO_LARGE") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise InvalidRequest("input unreachable", {field: f"could not fetch input: {e}"}, code="INPUT_UNREACHABLE") from None
        except Exception as e:  # botocore errors and the like: the input is unusable either way
            raise InvalidRequest("input unreachable", {field: f"could not fetch input: {type(e).__name__}"}, code="INPUT_UNREACHABLE") from None
        tmp.flush()
        try:
            with av.open(tmp.name) as container:
                video = next(iter(container.streams.video), None)
                audio = next(iter(container.streams.audio), None)
                duration = float(container.duration / 1_000_000) if container.duration else None
                if video is not None:
                    frames = video.frames or 0
                    is_image = (duration is None or duration == 0 or frames <= 1) and video.codec_context.name in (
                        "png", "mjpeg", "webp", "bmp", "gif", "tiff")
                    kind = "image" if is_image else "video"
                    width, height = video.codec_context.width, video.codec_context.height
                elif audio is not None:
                    kind, width, height = "audio", None, None
                else:
                    raise ValueError("no audio or video stream")
        except Exception:
            raise InvalidRequest("input is not media", {field: "not a readable image, video or audio file"}, code="INPUT_NOT_MEDIA") from None
    if kind != "image" and duration is not None and duration > max_duration_seconds:
        raise InvalidRequest("input too long", {field: f"media lasts {duration:.1f} s; at most {max_duration_seconds:.0f} s"}, code="INPUT_TOO_LONG")
    return ProbedMedia(url, kind, size, None if kind == "image" else duration, width, height)


def probe_inputs(inputs, *, max_bytes: int, max_duration_seconds: float) -> list[ProbedMedia]:
    out = []
    for i, ref in enumerate(inputs):
        field = f"body.inputs.{i}.url"
        m = probe(ref.url, field, max_bytes=max_bytes, max_duration_seconds=max_duration_seconds)
        if m.kind != ref.kind:
            raise InvalidRequest("input kind mismatch", {f"body.inputs.{i}.kind": f"declared {ref.kind}, measured {m.kind}"})
        out.append(m)
    return out
