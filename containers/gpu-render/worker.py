"""gpu-render worker: runs one media job per container start (an AWS Batch job) or per local
subprocess (the local runner under `aivedio serve`), with FFmpeg. One entry point for both.

The job spec is JSON, given as the first argument or in AIVEDIO_JOB_SPEC (Batch: the submitter
sets either through containerOverrides).

operation "ingest" (the media pipeline, aivedio.media.pipeline): a provider's output is fetched
under input probing's address rules (aivedio.media.probe: nothing fetched may reach a non-global
address unless allow_private_addresses), within limits.max_bytes, limits.timeout_seconds (the whole
job) and limits.disk_quota_bytes (the working directory), in a working directory removed whatever
happens; probed (container, codec, duration, resolution, fps, audio) and rejected when it is not
playable (zero bytes, truncated, not a video) or not what was ordered (duration and resolution within
tolerance, audio when ordered); then the proxy (H.264, short side 720 or the source's when smaller),
a JPEG thumbnail and, for final renders, the delivery encode at the ordered resolution are made,
checked again and stored under `outputs` (S3, tagged tenant_id/project/task_id/asset_type/
retention_class, or a local directory) as <task_id>-v<output_version>-<asset_type>.<ext>, so a
retry overwrites rather than duplicates. The RESULT is the last stdout line (and <outputs>result.json
for S3). SPEC and RESULT: containers/gpu-render/README.md. Exit status: 0 ok, 3 rejected (the media
is bad: retrying cannot help), 1 error (transient: fetch, timeout, FFmpeg, S3; SIGTERM included),
2 the spec is invalid.

operations "transcode" and "thumbnail" (one file in, one file out):

    {"operation": "transcode" | "thumbnail",
     "input":  "s3://bucket/key" | "https://..." | "/local/path",
     "output": "s3://bucket/key" | "/local/path",
     "height": 720,             # optional: scale to this height, width follows the aspect ratio
     "at_seconds": 1.0,         # thumbnail: the frame's time
     "retention_class": "..."}  # optional: tag of the S3 output, which the bucket's lifecycle rules read

transcode writes H.264 + AAC in MP4 (faststart); thumbnail writes one JPEG or PNG frame (by the
output's extension). On a GPU instance (an NVIDIA device and an FFmpeg with h264_nvenc) transcodes
use NVENC, and fall back to libx264 if NVENC refuses the job; otherwise libx264 (ingest likewise).
The output is opened again with PyAV before it is stored, so a job never publishes an unreadable
file. One JSON line on stdout reports the job (CloudWatch Logs keeps it). Exit status: 0 done; 2 the
spec is invalid (retrying cannot help); 1 anything else (FFmpeg, S3, network), which Batch may retry.

Environment: AIVEDIO_FFMPEG (the binary; else ffmpeg on PATH), AIVEDIO_FFMPEG_THREADS (ingest:
FFmpeg's -threads, the CPU units the job holds), AIVEDIO_MEDIA_WORKDIR (ingest: the root of the
working directories; else <tmp>/aivedio-media), AIVEDIO_RESOURCE_CLASS (reported in the logs)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

OPERATIONS = ("transcode", "thumbnail")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
MAX_HEIGHT = 4320
FETCH_TIMEOUT_SECONDS = 30
FETCH_CHUNK = 1 << 20
NVIDIA_DEVICE = Path("/dev/nvidia0")


class SpecError(ValueError):
    """The job spec is unusable: exit 2, no retry."""


@dataclass(frozen=True)
class JobSpec:
    operation: str
    input: str
    output: str
    height: int | None = None
    at_seconds: float = 0.0
    retention_class: str | None = None

    @classmethod
    def parse(cls, raw: str | dict) -> "JobSpec":
        try:
            doc = json.loads(raw) if isinstance(raw, str) else dict(raw)
        except (TypeError, ValueError) as e:
            raise SpecError(f"the job spec is not JSON: {e}") from None
        unknown = set(doc) - {"operation", "input", "output", "height", "at_seconds", "retention_class"}
        if unknown:
            raise SpecError(f"unknown fields in the job spec: {sorted(unknown)}")
        spec = cls(operation=doc.get("operation", ""), input=doc.get("input", ""), output=doc.get("output", ""),
                   height=doc.get("height"), at_seconds=float(doc.get("at_seconds", 0.0)),
                   retention_class=doc.get("retention_class"))
        spec.validate()
        return spec

    def validate(self) -> None:
        if self.operation not in OPERATIONS:
            raise SpecError(f"operation must be one of {OPERATIONS}, not {self.operation!r}")
        for name in ("input", "output"):
            value = getattr(self, name)
            if not value or not isinstance(value, str):
                raise SpecError(f"{name} is missing")
            scheme = urllib.parse.urlsplit(value).scheme
            allowed = ("s3", "https", "") if name == "input" else ("s3", "")
            if scheme not in allowed:
                raise SpecError(f"{name}: scheme {scheme!r} is not one of {[s or 'a path' for s in allowed]}")
        if self.height is not None and (not isinstance(self.height, int) or not 2 <= self.height <= MAX_HEIGHT
                                        or self.height % 2):
            raise SpecError(f"height must be an even integer in 2..{MAX_HEIGHT}, not {self.height!r}")
        if self.at_seconds < 0:
            raise SpecError("at_seconds must be >= 0")
        suffix = Path(urllib.parse.urlsplit(self.output).path).suffix.lower()
        if self.operation == "thumbnail" and suffix not in IMAGE_SUFFIXES:
            raise SpecError(f"a thumbnail's output ends with one of {IMAGE_SUFFIXES}, not {suffix!r}")
        if self.operation == "transcode" and suffix != ".mp4":
            raise SpecError(f"a transcode's output ends with .mp4, not {suffix!r}")


# --- FFmpeg ------------------------------------------------------------------------------------

def ffmpeg_binary() -> str:
    """AIVEDIO_FFMPEG, else ffmpeg on PATH (the image installs Debian's)."""
    found = os.environ.get("AIVEDIO_FFMPEG") or shutil.which("ffmpeg")
    if not found:
        raise RuntimeError("no ffmpeg: install it or set AIVEDIO_FFMPEG")
    return found


def pick_encoder(ffmpeg: str) -> str:
    """h264_nvenc when an NVIDIA device is present and this FFmpeg has the encoder, else libx264."""
    if not NVIDIA_DEVICE.exists():
        return "libx264"
    listed = subprocess.run([ffmpeg, "-hide_banner", "-encoders"], capture_output=True, text=True, check=False)
    return "h264_nvenc" if " h264_nvenc " in listed.stdout else "libx264"


def ffmpeg_command(spec: JobSpec, src: Path, dst: Path, *, ffmpeg: str = "ffmpeg", encoder: str = "libx264") -> list[str]:
    """The FFmpeg invocation for one job, from local input to local output."""
    cmd = [ffmpeg, "-hide_banner", "-nostdin", "-loglevel", "error", "-y"]
    scale = ["-vf", f"scale=-2:{spec.height}"] if spec.height else []
    if spec.operation == "thumbnail":
        # -ss before -i seeks on the input (fast); one frame out.
        return cmd + ["-ss", f"{spec.at_seconds:.3f}", "-i", str(src), "-frames:v", "1", *scale,
                      "-q:v", "3", "-update", "1", str(dst)]
    quality = (["-preset", "p4", "-rc", "vbr", "-cq", "23"] if encoder == "h264_nvenc"
               else ["-preset", "veryfast", "-crf", "23"])
    return cmd + ["-i", str(src), "-map", "0:v:0", "-map", "0:a:0?", *scale,
                  "-c:v", encoder, *quality, "-pix_fmt", "yuv420p",
                  "-c:a", "aac", "-b:a", "128k", "-movflags", "+faststart", str(dst)]


def run_ffmpeg(spec: JobSpec, src: Path, dst: Path, ffmpeg: str) -> str:
    """Run the job; returns the video encoder used."""
    if spec.operation == "thumbnail":
        encoder = "png" if dst.suffix == ".png" else "mjpeg"
    else:
        encoder = pick_encoder(ffmpeg)
    done = subprocess.run(ffmpeg_command(spec, src, dst, ffmpeg=ffmpeg, encoder=encoder),
                          capture_output=True, text=True, check=False)
    if done.returncode != 0 and encoder == "h264_nvenc":
        print(f"h264_nvenc failed ({done.stderr.strip()[-300:]}); falling back to libx264", file=sys.stderr)
        encoder = "libx264"
        done = subprocess.run(ffmpeg_command(spec, src, dst, ffmpeg=ffmpeg, encoder=encoder),
                              capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ffmpeg exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return encoder


def inspect(path: Path) -> dict:
    """Open the output (PyAV, from the project's dependencies): what a reader will find."""
    import av

    with av.open(str(path)) as container:
        video = next(iter(container.streams.video), None)
        if video is None:
            raise RuntimeError(f"{path.name}: no video stream in the output")
        return {"width": video.codec_context.width, "height": video.codec_context.height,
                "codec": video.codec_context.name,
                "duration_seconds": round(container.duration / 1_000_000, 3) if container.duration else None,
                "audio": any(True for _ in container.streams.audio)}


# --- storage -----------------------------------------------------------------------------------

def _s3(url: str) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(url)
    return parts.netloc, parts.path.lstrip("/")


def fetch(url: str, workdir: Path) -> Path:
    """The input as a local file."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "":
        return Path(url)
    local = workdir / ("input" + Path(parts.path).suffix)
    if parts.scheme == "s3":
        import boto3

        bucket, key = _s3(url)
        boto3.client("s3").download_file(bucket, key, str(local))
        return local
    request = urllib.request.Request(url, headers={"User-Agent": "aivedio-gpu-render/1"})
    with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_SECONDS) as resp, local.open("wb") as out:  # noqa: S310
        while chunk := resp.read(FETCH_CHUNK):
            out.write(chunk)
    return local


def store(local: Path, url: str, retention_class: str | None) -> None:
    if urllib.parse.urlsplit(url).scheme == "":
        if Path(url) != local:
            Path(url).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(local), url)
        return
    import boto3

    bucket, key = _s3(url)
    content_type = {".mp4": "video/mp4", ".png": "image/png"}.get(local.suffix.lower(), "image/jpeg")
    extra = {"ContentType": content_type}
    if retention_class:
        extra["Tagging"] = urllib.parse.urlencode({"retention_class": retention_class})
    boto3.client("s3").upload_file(str(local), bucket, key, ExtraArgs=extra)


# --- the job -----------------------------------------------------------------------------------

def run(spec: JobSpec) -> dict:
    started = time.monotonic()
    ffmpeg = ffmpeg_binary()
    with tempfile.TemporaryDirectory(prefix="gpu-render-") as tmp:
        workdir = Path(tmp)
        src = fetch(spec.input, workdir)
        dst = workdir / ("output" + Path(urllib.parse.urlsplit(spec.output).path).suffix.lower())
        encoder = run_ffmpeg(spec, src, dst, ffmpeg)
        media = inspect(dst)
        size = dst.stat().st_size
        store(dst, spec.output, spec.retention_class)
    return {"operation": spec.operation, "output": spec.output, "bytes": size, "encoder": encoder,
            "resource_class": os.environ.get("AIVEDIO_RESOURCE_CLASS"), **media,
            "seconds": round(time.monotonic() - started, 3)}


# --- ingest: a provider's output fetched, checked, transcoded and stored ------------------------------
#
# The SPEC (the media dispatcher's, aivedio.media.pipeline.build_spec) and the RESULT are described in
# containers/gpu-render/README.md. Every outcome prints the RESULT as the last stdout line; for
# s3:// outputs it is also written to <outputs>result.json (the completion Lambda reads it there).

INGEST = "ingest"
RESOLUTION_HEIGHTS = {"480p": 480, "720p": 720, "1080p": 1080, "4k": 2160}  # the short side
PROXY_HEIGHT = 720
THUMBNAIL_HEIGHT = 360
# asset type -> (file suffix, content type)
ASSETS = {"proxy": (".mp4", "video/mp4"), "thumbnail": (".jpg", "image/jpeg"), "delivery": (".mp4", "video/mp4")}
# "rejected": the media itself is bad, a retry cannot help. Everything else is "error" (transient).
REJECTIONS = frozenset({"MEDIA_EMPTY", "MEDIA_TRUNCATED", "MEDIA_NOT_VIDEO", "MEDIA_DURATION_MISMATCH",
                        "MEDIA_RESOLUTION_MISMATCH", "MEDIA_AUDIO_MISSING", "MEDIA_TOO_LARGE",
                        "MEDIA_PRIVATE_ADDRESS", "MEDIA_DISK_QUOTA"})
ERRORS = frozenset({"MEDIA_FETCH_FAILED", "MEDIA_TIMEOUT", "MEDIA_TRANSCODE_FAILED"})
EXIT_OK, EXIT_ERROR, EXIT_INVALID, EXIT_REJECTED = 0, 1, 2, 3
TAG_UNSAFE = re.compile(r"[^\w\s.:/=+\-@]")
SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")  # task ids become file names
LIMIT_DEFAULTS = {"max_bytes": 2 << 30, "timeout_seconds": 1800.0, "disk_quota_bytes": 8 << 30,
                  "duration_tolerance_seconds": 1.0, "resolution_tolerance_ratio": 0.1}
ISO_BMFF_FIRST = frozenset({b"ftyp", b"styp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pdin"})
POLL_SECONDS = 0.05
SPEC_FIELDS = {"operation", "task_id", "tenant_id", "project", "attempt_id", "output_version", "fencing_token",
               "source_url", "order", "outputs", "limits", "allow_private_addresses", "retention_class", "tags"}


class MediaFailure(Exception):
    """An ingest that cannot finish: `code` is one of REJECTIONS (status "rejected") or ERRORS ("error")."""

    def __init__(self, code: str, message: str):
        assert code in REJECTIONS or code in ERRORS, code
        super().__init__(message)
        self.code, self.message = code, message

    @property
    def status(self) -> str:
        return "rejected" if self.code in REJECTIONS else "error"


class Stopped(BaseException):
    """SIGTERM (Batch's timeout or TerminateJob): unwind, kill FFmpeg, clean the working directory."""


def _need(doc: dict, name: str, types, where: str = "", *, optional: bool = False, default=None):
    if name not in doc or doc[name] is None:
        if optional:
            return default
        raise SpecError(f"{where}{name} is missing")
    value = doc[name]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,))):
        raise SpecError(f"{where}{name}: wrong type {type(value).__name__}")
    return value


@dataclass(frozen=True)
class Order:
    duration_seconds: float
    resolution: str
    with_audio: bool
    final: bool


@dataclass(frozen=True)
class IngestLimits:
    max_bytes: int
    timeout_seconds: float
    disk_quota_bytes: int
    duration_tolerance_seconds: float
    resolution_tolerance_ratio: float


@dataclass(frozen=True)
class IngestSpec:
    task_id: str
    tenant_id: str
    project: str | None
    attempt_id: object
    output_version: int
    fencing_token: int
    source_url: str
    order: Order
    outputs: str  # s3://bucket/prefix/ or /a/local/dir/ (always ending with /)
    limits: IngestLimits
    allow_private_addresses: bool
    retention_class: str | None
    tags: dict

    @classmethod
    def parse(cls, raw: str | dict) -> "IngestSpec":
        try:
            doc = json.loads(raw) if isinstance(raw, str) else dict(raw)
        except (TypeError, ValueError) as e:
            raise SpecError(f"the job spec is not JSON: {e}") from None
        if not isinstance(doc, dict):
            raise SpecError("the job spec is not a JSON object")
        unknown = set(doc) - SPEC_FIELDS
        if unknown:
            raise SpecError(f"unknown fields in the job spec: {sorted(unknown)}")
        if doc.get("operation") != INGEST:
            raise SpecError(f"operation must be {INGEST!r}")
        task_id = _need(doc, "task_id", str)
        if not SAFE_ID.match(task_id):
            raise SpecError(f"task_id must match {SAFE_ID.pattern}")
        version, token = _need(doc, "output_version", int), _need(doc, "fencing_token", int)
        if version < 0 or token < 0:
            raise SpecError("output_version and fencing_token must be >= 0")
        o = _need(doc, "order", dict)
        order = Order(duration_seconds=float(_need(o, "duration_seconds", (int, float), "order.")),
                      resolution=_need(o, "resolution", str, "order."),
                      with_audio=_need(o, "with_audio", bool, "order."), final=_need(o, "final", bool, "order."))
        if order.resolution not in RESOLUTION_HEIGHTS:
            raise SpecError(f"order.resolution must be one of {sorted(RESOLUTION_HEIGHTS)}")
        if not 0 < order.duration_seconds < 24 * 3600:
            raise SpecError("order.duration_seconds must be > 0")
        lim = _need(doc, "limits", dict, optional=True, default={})
        unknown = set(lim) - set(LIMIT_DEFAULTS)
        if unknown:
            raise SpecError(f"unknown fields in limits: {sorted(unknown)}")
        ints = ("max_bytes", "disk_quota_bytes")
        values = {k: _need(lim, k, int if k in ints else (int, float), "limits.", optional=True, default=v)
                  for k, v in LIMIT_DEFAULTS.items()}
        limits = IngestLimits(**{k: (v if k in ints else float(v)) for k, v in values.items()})
        if limits.max_bytes <= 0 or limits.disk_quota_bytes <= 0 or limits.timeout_seconds <= 0:
            raise SpecError("limits.max_bytes, disk_quota_bytes and timeout_seconds must be > 0")
        if limits.duration_tolerance_seconds < 0 or not 0 <= limits.resolution_tolerance_ratio < 1:
            raise SpecError("limits: duration_tolerance_seconds >= 0, resolution_tolerance_ratio in [0, 1)")
        outputs = _need(doc, "outputs", str)
        scheme = urllib.parse.urlsplit(outputs).scheme
        if scheme == "s3":
            bucket, _ = _s3(outputs)
            if not bucket:
                raise SpecError("outputs: s3://bucket/prefix/")
        elif scheme or not os.path.isabs(outputs):
            raise SpecError("outputs must be s3://bucket/prefix/ or an absolute directory")
        if not outputs.endswith("/"):
            outputs += "/"
        tags = _need(doc, "tags", dict, optional=True, default={})
        if not all(isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in tags.items()):
            raise SpecError("tags: string keys and string (or null) values")
        source_url = _need(doc, "source_url", str)
        if not source_url:
            raise SpecError("source_url is missing")
        return cls(task_id=task_id, tenant_id=str(_need(doc, "tenant_id", (str, int))),
                   project=_need(doc, "project", str, optional=True), attempt_id=doc.get("attempt_id"),
                   output_version=version, fencing_token=token, source_url=source_url, order=order,
                   outputs=outputs, limits=limits,
                   allow_private_addresses=_need(doc, "allow_private_addresses", bool, optional=True, default=False),
                   retention_class=_need(doc, "retention_class", str, optional=True), tags=dict(tags))

    @property
    def stem(self) -> str:
        """What every file of this (task, output version) starts with."""
        return f"{self.task_id}-v{self.output_version}-"

    def asset_name(self, asset_type: str) -> str:
        """Deterministic per (task_id, output_version, asset_type): a retry overwrites, never duplicates."""
        return f"{self.stem}{asset_type}{ASSETS[asset_type][0]}"

    def object_tags(self, asset_type: str) -> dict[str, str]:
        tags = {**self.tags, "tenant_id": self.tenant_id, "project": self.project, "task_id": self.task_id,
                "asset_type": asset_type, "retention_class": self.retention_class or self.tags.get("retention_class")}
        # S3 tag values: letters, digits, spaces and _ . : / = + - @, at most 256 characters
        return {k[:128]: TAG_UNSAFE.sub("_", v)[:256] for k, v in tags.items() if v not in (None, "")}


# --- outputs: a local directory or an S3 prefix ----------------------------------------------------

class LocalOutputs:
    """Files in a directory, each published by a rename (a reader never sees half a file)."""

    def __init__(self, directory: str):
        self.dir = Path(directory)

    def key(self, name: str) -> str:
        return str(self.dir / name)

    def sweep(self, stem: str) -> None:
        """Partial copies a killed run left behind."""
        if self.dir.is_dir():
            for stale in self.dir.glob(f".{stem}*.partial-*"):
                stale.unlink(missing_ok=True)

    def put(self, local: Path, name: str, content_type: str, tags: dict[str, str]) -> str:
        self.dir.mkdir(parents=True, exist_ok=True)
        partial = self.dir / f".{name}.partial-{os.getpid()}"
        try:
            with local.open("rb") as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst, FETCH_CHUNK)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(partial, self.dir / name)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return self.key(name)

    def remove(self, name: str) -> None:
        (self.dir / name).unlink(missing_ok=True)

    def put_result(self, doc: dict) -> None:
        pass  # locally the RESULT travels on stdout only


class S3Outputs:
    """Objects under an S3 prefix, tagged for cost and lifecycle; a PutObject is atomic."""

    def __init__(self, url: str):
        self.bucket, self.prefix = _s3(url)
        self._client = None

    @property
    def client(self):
        if self._client is None:
            import boto3

            self._client = boto3.client("s3")
        return self._client

    def key(self, name: str) -> str:
        return self.prefix + name

    def sweep(self, stem: str) -> None:
        pass  # nothing partial is visible in S3 (the bucket's lifecycle aborts stale multipart uploads)

    def put(self, local: Path, name: str, content_type: str, tags: dict[str, str]) -> str:
        self.client.upload_file(str(local), self.bucket, self.key(name),
                                ExtraArgs={"ContentType": content_type, "Tagging": urllib.parse.urlencode(tags)})
        return self.key(name)

    def remove(self, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.key(name))

    def put_result(self, doc: dict) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.key("result.json"), ContentType="application/json",
                               Body=json.dumps(doc, separators=(",", ":")).encode())


def outputs_for(spec: IngestSpec) -> LocalOutputs | S3Outputs:
    return S3Outputs(spec.outputs) if spec.outputs.startswith("s3://") else LocalOutputs(spec.outputs)


# --- the working directory -------------------------------------------------------------------------

def workdir_root() -> Path:
    """AIVEDIO_MEDIA_WORKDIR, else <tmp>/aivedio-media: one directory per running ingest under it."""
    return Path(os.environ.get("AIVEDIO_MEDIA_WORKDIR") or Path(tempfile.gettempdir()) / "aivedio-media")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_workdir(spec: IngestSpec) -> Path:
    """<root>/<task>-v<version>-<pid>, after removing what a killed run of the same (task, version) left."""
    root = workdir_root()
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{spec.stem}*"):
        pid = stale.name[len(spec.stem):]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    workdir = root / f"{spec.stem}{os.getpid()}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(mode=0o700)
    return workdir


def dir_bytes(path: Path) -> int:
    total = 0
    for entry in os.scandir(path):
        try:
            total += dir_bytes(Path(entry.path)) if entry.is_dir(follow_symlinks=False) else entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
    return total


# --- fetch and check -------------------------------------------------------------------------------

def fetch_source(spec: IngestSpec, dst: Path, deadline: float) -> int:
    """The provider's output into `dst` under input probing's address rules (aivedio.media.probe):
    every hop's addresses global unless allow_private_addresses, at most max_bytes (and never more
    than the disk quota), by the deadline."""
    from aivedio.media import probe

    cap = min(spec.limits.max_bytes, spec.limits.disk_quota_bytes)
    allowance = probe.ALLOW_ANY_ADDRESS if spec.allow_private_addresses else None
    try:
        with dst.open("wb") as out:
            return probe.fetch_url(spec.source_url, out, max_bytes=cap, deadline=deadline, allowance=allowance,
                                   purpose=f"media:{spec.task_id}")
    except probe.FetchTooLarge:
        if cap < spec.limits.max_bytes:
            raise MediaFailure("MEDIA_DISK_QUOTA", f"the source exceeds the disk quota of {cap} bytes") from None
        raise MediaFailure("MEDIA_TOO_LARGE", f"the source exceeds {cap} bytes") from None
    except probe.FetchForbidden as e:
        raise MediaFailure("MEDIA_PRIVATE_ADDRESS", f"not fetched: {e.reason}") from None
    except probe.FetchRefused as e:
        raise MediaFailure("MEDIA_FETCH_FAILED", f"not fetched: {e.reason}") from None
    except TimeoutError as e:
        raise MediaFailure("MEDIA_TIMEOUT", f"the fetch outlasted the deadline: {e}") from None
    except OSError as e:
        raise MediaFailure("MEDIA_FETCH_FAILED", f"{type(e).__name__}: {e}") from None
    except Exception as e:  # http.client's protocol errors and the like
        raise MediaFailure("MEDIA_FETCH_FAILED", f"{type(e).__name__}: {e}") from None


def iso_bmff_truncated(path: Path, size: int) -> bool | None:
    """None: not an ISO BMFF (MP4/MOV) file; True: a top-level box runs past the end of the file, or
    there is no moov box; False: the box structure is complete."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8 or head[4:8] not in ISO_BMFF_FIRST:
            return None
        pos, moov = 0, False
        while pos < size:
            f.seek(pos)
            header = f.read(8)
            if len(header) < 8:
                return True
            n, kind = struct.unpack(">I4s", header)
            if n == 1:
                large = f.read(8)
                if len(large) < 8:
                    return True
                n = struct.unpack(">Q", large)[0]
            elif n == 0:
                n = size - pos  # the last box runs to the end of the file
            if n < 8 or pos + n > size:
                return True
            moov = moov or kind == b"moov"
            pos += n
        return not moov


def demux_check(path: Path, deadline: float) -> tuple[float | None, float | None]:
    """Read every video packet (no decoding past the first frame): where the video's packets end and
    what the video stream declares as its duration, in seconds. A demuxer or decoder error, or no
    decodable frame, is MEDIA_TRUNCATED."""
    import av

    end, declared, packets, decoded = None, None, 0, False
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            tb = stream.time_base
            if stream.duration and tb is not None:
                declared = float(stream.duration * tb)
            for packet in container.demux(stream):
                if packet.size == 0:
                    continue  # the demuxer's flush packet
                packets += 1
                if packets % 256 == 0 and time.monotonic() > deadline:
                    raise MediaFailure("MEDIA_TIMEOUT", "checking the source outlasted the deadline")
                t = packet.pts if packet.pts is not None else packet.dts
                if t is not None and tb is not None:
                    stop = float((t + (packet.duration or 0)) * tb)
                    end = stop if end is None else max(end, stop)
                if not decoded:
                    decoded = any(True for _ in packet.decode())
            if not decoded:
                for _ in stream.codec_context.decode(None):  # frames the decoder held back
                    decoded = True
                    break
    except MediaFailure:
        raise
    except Exception as e:
        raise MediaFailure("MEDIA_TRUNCATED", f"the video stream cannot be read to its end: {type(e).__name__}: {e}") from None
    if not decoded:
        raise MediaFailure("MEDIA_TRUNCATED" if packets else "MEDIA_NOT_VIDEO", "no decodable video frame")
    return end, declared


def check_source(spec: IngestSpec, src: Path, size: int, deadline: float) -> dict:
    """The RESULT's probe figures; MediaFailure when the file is not playable or not what was ordered."""
    from aivedio.media import probe

    if size == 0:
        raise MediaFailure("MEDIA_EMPTY", "the source is zero bytes")
    iso_truncated = iso_bmff_truncated(src, size)
    if iso_truncated:
        raise MediaFailure("MEDIA_TRUNCATED", "the MP4's boxes run past the end of the file (or it has no moov)")
    try:
        facts = probe.measure(str(src))
    except Exception as e:
        raise MediaFailure("MEDIA_NOT_VIDEO", f"not a readable media file: {type(e).__name__}") from None
    if facts.kind != "video":
        raise MediaFailure("MEDIA_NOT_VIDEO", f"the source is {'an image' if facts.kind == 'image' else 'audio only'}, not a video")
    end, declared = demux_check(src, deadline)
    tolerance = spec.limits.duration_tolerance_seconds
    duration = facts.duration_seconds or end
    if not duration:
        raise MediaFailure("MEDIA_NOT_VIDEO", "the video has no duration")
    slack = max(tolerance, 0.5, 2.0 / facts.fps if facts.fps else 0.0)
    declared = declared or facts.duration_seconds  # the video stream's own, else the container's
    if declared and end is not None and declared - end > slack:
        raise MediaFailure("MEDIA_TRUNCATED", f"the video declares {declared:.3f} s, its frames end at {end:.3f} s")
    figures = {"container": _container_name(src, facts.container), "video_codec": facts.video_codec,
               "duration_seconds": round(duration, 3), "width": facts.width, "height": facts.height,
               "fps": facts.fps, "has_audio": facts.has_audio, "bytes": size}
    order = spec.order
    if abs(duration - order.duration_seconds) > tolerance:
        raise _Mismatch("MEDIA_DURATION_MISMATCH", f"the video lasts {duration:.3f} s; {order.duration_seconds:g} s "
                        f"were ordered (tolerance {tolerance:g} s)", figures)
    ordered, short = RESOLUTION_HEIGHTS[order.resolution], min(facts.width or 0, facts.height or 0)
    if abs(short - ordered) > spec.limits.resolution_tolerance_ratio * ordered:
        raise _Mismatch("MEDIA_RESOLUTION_MISMATCH", f"the video is {facts.width}x{facts.height}; {order.resolution} "
                        f"was ordered (tolerance {spec.limits.resolution_tolerance_ratio:g})", figures)
    if order.with_audio and not facts.has_audio:
        raise _Mismatch("MEDIA_AUDIO_MISSING", "audio was ordered; the video has no audio stream", figures)
    return figures


class _Mismatch(MediaFailure):
    """A playable video that is not what was ordered: the rejection carries its probe figures."""

    def __init__(self, code: str, message: str, figures: dict):
        super().__init__(code, message)
        self.figures = figures


def _container_name(path: Path, demuxer: str) -> str:
    if demuxer != "mov":
        return demuxer
    with path.open("rb") as f:
        head = f.read(12)
    return "mov" if head[4:8] == b"ftyp" and head[8:12] == b"qt  " else "mp4"


# --- transcode -------------------------------------------------------------------------------------

def _even(n: int) -> int:
    return max(2, n - n % 2)


def scale_filter(width: int, height: int, short_side: int) -> str:
    """Scale so the short side is `short_side`, the other follows the aspect ratio (even)."""
    return f"scale=-2:{short_side}" if width >= height else f"scale={short_side}:-2"


def _threads(threads: int | None = None) -> list[str]:
    """-threads N: `threads`, else AIVEDIO_FFMPEG_THREADS (the CPU units the job holds), else FFmpeg's own choice."""
    n = str(threads) if threads else os.environ.get("AIVEDIO_FFMPEG_THREADS")
    return ["-threads", n] if n and n.isdigit() and int(n) > 0 else []


def video_command(src: Path, dst: Path, *, ffmpeg: str, encoder: str, scale: str, delivery: bool = False,
                  threads: int | None = None) -> list[str]:
    """H.264 (+ AAC when the source has audio) in MP4 with faststart: the proxy, or the delivery encode."""
    if encoder == "h264_nvenc":
        quality = ["-preset", "p4", "-rc", "vbr", "-cq", "19" if delivery else "23"]
    else:
        quality = ["-preset", "fast" if delivery else "veryfast", "-crf", "18" if delivery else "23"]
    return [ffmpeg, "-hide_banner", "-nostdin", "-loglevel", "error", "-y", *_threads(threads), "-i", str(src),
            "-map", "0:v:0", "-map", "0:a:0?", "-vf", scale, "-c:v", encoder, *quality, *_threads(threads),
            "-pix_fmt", "yuv420p", "-c:a", "aac", "-b:a", "192k" if delivery else "128k",
            "-movflags", "+faststart", "-f", "mp4", str(dst)]


def proxy_command(src: Path, dst: Path, *, ffmpeg: str, encoder: str, width: int, height: int,
                  threads: int | None = None) -> list[str]:
    """The proxy of a width x height source: H.264, short side 720 (or the source's when smaller)."""
    return video_command(src, dst, ffmpeg=ffmpeg, encoder=encoder, threads=threads,
                         scale=scale_filter(width, height, _even(min(PROXY_HEIGHT, width, height))))


def thumbnail_command(src: Path, dst: Path, *, ffmpeg: str, at_seconds: float, scale: str) -> list[str]:
    return [ffmpeg, "-hide_banner", "-nostdin", "-loglevel", "error", "-y", "-ss", f"{at_seconds:.3f}", "-i", str(src),
            "-frames:v", "1", "-vf", scale, "-q:v", "3", "-update", "1", "-f", "image2", "-c:v", "mjpeg", str(dst)]


_LIBC = None


def _child_setup(quota: int):
    """In the FFmpeg child: die with the worker (PR_SET_PDEATHSIG), and no file past the disk quota."""
    global _LIBC
    parent = os.getpid()
    if sys.platform.startswith("linux") and _LIBC is None:
        import ctypes

        _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
    libc = _LIBC

    def setup() -> None:
        import resource

        if libc is not None:
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:
                os._exit(1)  # the worker died before the prctl
        resource.setrlimit(resource.RLIMIT_FSIZE, (quota, quota))

    return setup


class _FFmpegFailed(Exception):
    pass


def run_bounded(cmd: list[str], *, workdir: Path, deadline: float, quota: int, label: str) -> float:
    """Run FFmpeg, killed at the deadline (MEDIA_TIMEOUT) or when the working directory passes the
    disk quota (MEDIA_DISK_QUOTA); the worker's death kills it too. Returns its wall seconds."""
    started = time.monotonic()
    err_path = workdir / f"{label}.stderr"
    with err_path.open("wb") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=_child_setup(quota))
        try:
            while True:
                try:
                    rc = proc.wait(timeout=POLL_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if time.monotonic() > deadline:
                    raise MediaFailure("MEDIA_TIMEOUT", f"{label}: FFmpeg outlasted the deadline")
                if dir_bytes(workdir) > quota:
                    raise MediaFailure("MEDIA_DISK_QUOTA", f"{label}: the working files passed the disk quota of {quota} bytes")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr = err_path.read_text(errors="replace").strip()[-2000:]
    err_path.unlink(missing_ok=True)
    if rc == -signal.SIGXFSZ or dir_bytes(workdir) > quota:
        raise MediaFailure("MEDIA_DISK_QUOTA", f"{label}: a file passed the disk quota of {quota} bytes")
    if rc != 0:
        raise _FFmpegFailed(f"{label}: ffmpeg exited {rc}: {stderr}")
    return time.monotonic() - started


def _encode(cmd_for, *, ffmpeg: str, workdir: Path, deadline: float, quota: int, label: str) -> tuple[float, str]:
    """A video encode with NVENC when present, again with libx264 if NVENC refuses it."""
    encoder = pick_encoder(ffmpeg)
    try:
        return run_bounded(cmd_for(encoder), workdir=workdir, deadline=deadline, quota=quota, label=label), encoder
    except _FFmpegFailed as e:
        if encoder != "h264_nvenc":
            raise MediaFailure("MEDIA_TRANSCODE_FAILED", str(e)) from None
        print(json.dumps({"event": "nvenc_fallback", "label": label, "error": str(e)[-300:]}), file=sys.stderr)
    try:
        return run_bounded(cmd_for("libx264"), workdir=workdir, deadline=deadline, quota=quota, label=label), "libx264"
    except _FFmpegFailed as e:
        raise MediaFailure("MEDIA_TRANSCODE_FAILED", str(e)) from None


def _verify(path: Path, *, label: str, kind: str, codec: str, width: int | None, height: int | None,
            duration: float | None = None, slack: float = 0.0, audio: bool | None = None) -> dict:
    """An output as a reader will find it; MEDIA_TRANSCODE_FAILED unless it is what was made."""
    from aivedio.media import probe

    if not path.exists() or path.stat().st_size == 0:
        raise MediaFailure("MEDIA_TRANSCODE_FAILED", f"{label}: FFmpeg wrote nothing")
    try:
        facts = probe.measure(str(path))
    except Exception as e:
        raise MediaFailure("MEDIA_TRANSCODE_FAILED", f"{label}: the output is unreadable: {e}") from None
    problems = []
    if facts.kind != kind or facts.video_codec != codec:
        problems.append(f"{facts.kind}/{facts.video_codec}, not {kind}/{codec}")
    if (width is not None and facts.width != width) or (height is not None and facts.height != height):
        problems.append(f"{facts.width}x{facts.height}, not {width or '?'}x{height or '?'}")
    if duration is not None and (facts.duration_seconds is None or abs(facts.duration_seconds - duration) > slack):
        problems.append(f"lasts {facts.duration_seconds} s, not {duration:.3f} s")
    if audio is not None and facts.has_audio != audio:
        problems.append("audio " + ("missing" if audio else "unexpected"))
    if problems:
        raise MediaFailure("MEDIA_TRANSCODE_FAILED", f"{label}: " + "; ".join(problems))
    return {"width": facts.width, "height": facts.height, "codec": facts.video_codec,
            "duration_seconds": None if kind == "image" else round(facts.duration_seconds, 3),
            "bytes": path.stat().st_size}


def _dims(width: int, height: int, short_side: int) -> tuple[int | None, int | None]:
    """What scale_filter gives on the short side (the long one follows the aspect ratio)."""
    return (None, short_side) if width >= height else (short_side, None)


def transcode(spec: IngestSpec, src: Path, figures: dict, workdir: Path, deadline: float, clock: dict) -> dict:
    """Proxy, thumbnail and (order.final) delivery in the working directory, each checked:
    {asset_type: (path, figures)}. FFmpeg's wall seconds accumulate in clock["transcode_seconds"]
    as each run ends (a failed job reports what it spent too)."""
    ffmpeg = ffmpeg_binary()
    w, h, duration = figures["width"], figures["height"], figures["duration_seconds"]
    quota = spec.limits.disk_quota_bytes
    slack = max(spec.limits.duration_tolerance_seconds, 0.5, 2.0 / figures["fps"] if figures["fps"] else 0.0)
    made = {}
    bounded = dict(workdir=workdir, deadline=deadline, quota=quota)

    def timed(cmd: list[str], label: str) -> None:
        started = time.monotonic()
        try:
            run_bounded(cmd, label=label, **bounded)
        except _FFmpegFailed as e:
            raise MediaFailure("MEDIA_TRANSCODE_FAILED", str(e)) from None
        finally:
            clock["transcode_seconds"] = round(clock["transcode_seconds"] + time.monotonic() - started, 3)

    def encode(cmd_for, label: str) -> str:
        started = time.monotonic()
        try:
            return _encode(cmd_for, ffmpeg=ffmpeg, label=label, **bounded)[1]
        finally:
            clock["transcode_seconds"] = round(clock["transcode_seconds"] + time.monotonic() - started, 3)

    proxy = workdir / "proxy.mp4"
    short = _even(min(PROXY_HEIGHT, w, h))
    encoder = encode(lambda enc: proxy_command(src, proxy, ffmpeg=ffmpeg, encoder=enc, width=w, height=h), "proxy")
    pw, ph = _dims(w, h, short)
    made["proxy"] = (proxy, _verify(proxy, label="proxy", kind="video", codec="h264", width=pw, height=ph,
                                    duration=duration, slack=slack, audio=figures["has_audio"]))

    thumb = workdir / "thumbnail.jpg"
    p = made["proxy"][1]
    t_short = _even(min(THUMBNAIL_HEIGHT, p["width"], p["height"]))
    for at in dict.fromkeys((min(1.0, duration / 2), 0.0)):  # a seek past the last frame writes nothing: then the first
        timed(thumbnail_command(proxy, thumb, ffmpeg=ffmpeg, at_seconds=at,
                                scale=scale_filter(p["width"], p["height"], t_short)), "thumbnail")
        if thumb.exists():
            break
    tw, th = _dims(p["width"], p["height"], t_short)
    made["thumbnail"] = (thumb, _verify(thumb, label="thumbnail", kind="image", codec="mjpeg", width=tw, height=th))

    if spec.order.final:
        delivery = workdir / "delivery.mp4"
        target = RESOLUTION_HEIGHTS[spec.order.resolution]
        encoder = encode(lambda enc: video_command(src, delivery, ffmpeg=ffmpeg, encoder=enc,
                                                   scale=scale_filter(w, h, target), delivery=True), "delivery")
        dw, dh = _dims(w, h, target)
        made["delivery"] = (delivery, _verify(delivery, label="delivery", kind="video", codec="h264", width=dw,
                                              height=dh, duration=duration, slack=slack, audio=figures["has_audio"]))
    print(json.dumps({"event": "transcoded", "task_id": spec.task_id, "encoder": encoder,
                      "resource_class": os.environ.get("AIVEDIO_RESOURCE_CLASS"), "seconds": clock["transcode_seconds"]}),
          file=sys.stderr)
    return made


# --- the ingest ------------------------------------------------------------------------------------

def ingest(spec: IngestSpec) -> dict:
    """Fetch, check, transcode and store one provider output; the RESULT (never raises for the
    media's or the environment's faults; Stopped on SIGTERM is answered as an error too)."""
    started = time.monotonic()
    deadline = started + spec.limits.timeout_seconds
    store = outputs_for(spec)
    result = {"task_id": spec.task_id, "output_version": spec.output_version, "fencing_token": spec.fencing_token,
              "status": "ok", "code": None, "message": None, "probe": None, "outputs": [],
              "transcode_seconds": 0.0, "bytes_stored": 0}
    workdir = None
    try:
        workdir = open_workdir(spec)
        store.sweep(spec.stem)
        src = workdir / "source"
        size = fetch_source(spec, src, deadline)
        result["probe"] = check_source(spec, src, size, deadline)
        made = transcode(spec, src, result["probe"], workdir, deadline, result)
        src.unlink(missing_ok=True)
        try:
            for asset_type, (path, figures) in made.items():
                _, content_type = ASSETS[asset_type]
                key = store.put(path, spec.asset_name(asset_type), content_type, spec.object_tags(asset_type))
                result["outputs"].append({"asset_type": asset_type, "key": key, "bytes": figures["bytes"],
                                          "content_type": content_type, "width": figures["width"],
                                          "height": figures["height"], "codec": figures["codec"],
                                          "duration_seconds": figures["duration_seconds"]})
        except Exception as e:  # S3 or the local disk; a retry overwrites what was stored
            raise MediaFailure("MEDIA_TRANSCODE_FAILED", f"storing the outputs failed: {type(e).__name__}: {e}") from None
        result["bytes_stored"] = sum(o["bytes"] for o in result["outputs"])
    except MediaFailure as f:
        _fail(result, f, store, spec)
    except Stopped:
        _fail(result, MediaFailure("MEDIA_TIMEOUT", "the worker was stopped (SIGTERM)"), store, spec)
    except Exception as e:  # a bug or the environment (disk, FFmpeg missing): transient as far as we know
        _fail(result, MediaFailure("MEDIA_TRANSCODE_FAILED", f"{type(e).__name__}: {e}"), store, spec)
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    try:
        store.put_result(result)
    except Exception as e:
        if result["status"] == "ok":
            _fail(result, MediaFailure("MEDIA_TRANSCODE_FAILED", f"storing result.json failed: {type(e).__name__}: {e}"),
                  store, spec)
    return result


def _fail(result: dict, failure: MediaFailure, store, spec: IngestSpec) -> None:
    result.update(status=failure.status, code=failure.code, message=failure.message, outputs=[], bytes_stored=0)
    if isinstance(failure, _Mismatch):
        result["probe"] = failure.figures
    if failure.status == "rejected":  # nothing of a bad media stays stored, not even from an earlier, killed run
        for asset_type in ASSETS:
            try:
                store.remove(spec.asset_name(asset_type))
            except Exception as e:
                print(json.dumps({"event": "remove_failed", "asset_type": asset_type, "error": str(e)}), file=sys.stderr)


def _on_sigterm(signum, frame) -> None:
    raise Stopped()


def main_ingest(raw: str | dict) -> int:
    try:
        spec = IngestSpec.parse(raw)
    except SpecError as e:
        print(json.dumps({"status": "invalid", "operation": INGEST, "error": str(e)}), flush=True)
        return EXIT_INVALID
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        try:
            result = ingest(spec)
        except Stopped:  # SIGTERM outside ingest's own handling (e.g. while storing result.json)
            result = {"task_id": spec.task_id, "output_version": spec.output_version, "fencing_token": spec.fencing_token,
                      "status": "error", "code": "MEDIA_TIMEOUT", "message": "the worker was stopped (SIGTERM)",
                      "probe": None, "outputs": [], "transcode_seconds": 0.0, "bytes_stored": 0}
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(json.dumps(result, separators=(",", ":")), flush=True)
    return {"ok": EXIT_OK, "rejected": EXIT_REJECTED}.get(result["status"], EXIT_ERROR)


def _operation(raw: str) -> str | None:
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc.get("operation") if isinstance(doc, dict) else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    raw = argv[0] if argv else os.environ.get("AIVEDIO_JOB_SPEC")
    if raw and _operation(raw) == INGEST:
        return main_ingest(raw)
    try:
        if not raw:
            raise SpecError("no job spec: pass it as the first argument or in AIVEDIO_JOB_SPEC")
        spec = JobSpec.parse(raw)
    except SpecError as e:
        print(json.dumps({"status": "invalid", "error": str(e)}), flush=True)
        return 2
    try:
        report = run(spec)
    except Exception as e:  # FFmpeg, S3, network: Batch may retry the job
        print(json.dumps({"status": "failed", "operation": spec.operation, "error": f"{type(e).__name__}: {e}"}),
              flush=True)
        return 1
    print(json.dumps({"status": "done", **report}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
