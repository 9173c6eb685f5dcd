"""gpu-render worker: runs one media job per container start (an AWS Batch job), with FFmpeg.

The job spec is JSON, given as the first argument or in AIVEDIO_JOB_SPEC (Batch: the submitter
sets either through containerOverrides):

    {"operation": "transcode" | "thumbnail",
     "input":  "s3://bucket/key" | "https://..." | "/local/path",
     "output": "s3://bucket/key" | "/local/path",
     "height": 720,             # optional: scale to this height, width follows the aspect ratio
     "at_seconds": 1.0,         # thumbnail: the frame's time
     "retention_class": "..."}  # optional: tag of the S3 output, which the bucket's lifecycle rules read

transcode writes H.264 + AAC in MP4 (faststart); thumbnail writes one JPEG or PNG frame (by the
output's extension). On a GPU instance (an NVIDIA device and an FFmpeg with h264_nvenc) transcodes
use NVENC, and fall back to libx264 if NVENC refuses the job; otherwise libx264. The output is
opened again with PyAV before it is stored, so a job never publishes an unreadable file. One JSON
line on stdout reports the job (CloudWatch Logs keeps it).

Exit status: 0 done; 2 the spec is invalid (retrying cannot help); 1 anything else (FFmpeg,
S3, network), which Batch may retry."""
from __future__ import annotations

import json
import os
import shutil
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    raw = argv[0] if argv else os.environ.get("AIVEDIO_JOB_SPEC")
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
