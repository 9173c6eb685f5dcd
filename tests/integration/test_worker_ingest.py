"""containers/gpu-render/worker.py, operation "ingest", run as AWS Batch and the local runner run it:
a subprocess (`python worker.py <SPEC>`) with real FFmpeg (imageio-ffmpeg's binary) on real clips
(the provider simulator's MP4s and FFmpeg test patterns) fetched over HTTP from a loopback server.

Good clips: each output probed again (codec, resolution, duration, audio), the proxy at 720p (or the
source's height when smaller), the thumbnail's dimensions, the delivery encode for final renders.
Bad clips (zero bytes, a truncated MP4, not a video, duration / resolution / audio not as ordered,
over the size limit or the disk quota, a private address): status "rejected" with the code, exit 3,
no outputs and a clean working directory. Transient faults (FFmpeg failing, the deadline, SIGTERM):
"error", exit 1. SIGKILL mid-transcode, then a retry: one set of outputs, no partial files."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import av
import pytest

from aivedio_tools.provider_sim import make_mp4, output_bytes
from tests.waiting import wait_for

imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg")

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "containers" / "gpu-render" / "worker.py"
FFMPEG = imageio_ffmpeg.get_ffmpeg_exe()


def _load_worker():
    spec = importlib.util.spec_from_file_location("gpu_render_worker_ingest", WORKER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --- clips and the server that hands them out -----------------------------------------------------

def lavfi_clip(path: Path, *, size: str, seconds: float, rate: int = 10, audio: bool = True, faststart: bool = False) -> bytes:
    """A test pattern (and a tone) as H.264 + AAC MP4, made with FFmpeg."""
    cmd = [FFMPEG, "-hide_banner", "-loglevel", "error", "-nostdin", "-y",
           "-f", "lavfi", "-i", f"testsrc=size={size}:rate={rate}:duration={seconds}"]
    if audio:
        cmd += ["-f", "lavfi", "-i", f"sine=frequency=440:duration={seconds}", "-c:a", "aac", "-shortest"]
    cmd += ["-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p"]
    cmd += ["-movflags", "+faststart"] if faststart else []
    subprocess.run(cmd + [str(path)], check=True, timeout=120)
    return path.read_bytes()


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("clips")
    sim_720 = make_mp4(4, "720p", True)
    jpeg = d / "still.jpg"
    subprocess.run([FFMPEG, "-hide_banner", "-loglevel", "error", "-nostdin", "-y", "-f", "lavfi", "-i",
                    "testsrc=size=320x240:rate=1:duration=1", "-frames:v", "1", str(jpeg)], check=True, timeout=60)
    faststart = lavfi_clip(d / "fs.mp4", size="854x480", seconds=3, faststart=True)
    mkv = lavfi_clip(d / "clip.mkv", size="854x480", seconds=3)
    return {
        "sim_720p": sim_720,  # the simulator's own output for a 4 s 720p order with audio
        "sim_1080p": make_mp4(4, "1080p", True),
        "sim_480p_silent": make_mp4(4, "480p", False),
        "pattern_480p": lavfi_clip(d / "p480.mp4", size="854x480", seconds=3),
        "portrait_1080p": lavfi_clip(d / "portrait.mp4", size="1080x1920", seconds=2, rate=5),
        "empty": output_bytes(4, "720p", True, "empty"),
        "truncated": output_bytes(4, "720p", True, "truncated"),  # moov at the end: lost
        "truncated_faststart": faststart[: len(faststart) * 2 // 3],  # moov first, mdat cut
        "truncated_mkv": mkv[: len(mkv) // 2],  # no boxes to check: its frames end before its declared duration
        "pattern_mkv": mkv,
        "not_video": output_bytes(4, "720p", True, "not_video"),
        "still_jpeg": jpeg.read_bytes(),
        "wrong_duration": output_bytes(4, "720p", True, "wrong_duration"),
        "wrong_resolution": output_bytes(4, "720p", True, "wrong_resolution"),
        "no_audio": output_bytes(4, "720p", True, "no_audio"),
    }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # close-delimited bodies for /stream/: no Content-Length to trust

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        kind, _, name = self.path.strip("/").partition("/")
        data = self.server.files.get(name)
        if kind == "hang":
            self.server.stopping.wait(30)
            return
        if data is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "video/mp4")
        if kind != "stream":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def server(clips):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.files, srv.stopping = dict(clips), threading.Event()
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    yield lambda name, kind="file": f"{base}/{kind}/{name}"
    srv.stopping.set()
    srv.shutdown()
    srv.server_close()


# --- running the worker ---------------------------------------------------------------------------

@pytest.fixture
def room(tmp_path):
    """The outputs directory and the workers' working-directory root of one test."""
    out, work = tmp_path / "outputs", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    return out, work


def make_spec(url: str, out: Path, *, task_id: str = "task-1", version: int = 1, duration=4, resolution="720p",
              with_audio=True, final=False, allow_private=True, **limits) -> dict:
    return {"operation": "ingest", "task_id": task_id, "tenant_id": "tenant-1", "project": "proj-a",
            "attempt_id": "att-1", "output_version": version, "fencing_token": 7, "source_url": url,
            "order": {"duration_seconds": duration, "resolution": resolution, "with_audio": with_audio, "final": final},
            "outputs": f"{out}/",
            "limits": {"max_bytes": 50_000_000, "timeout_seconds": 120.0, "disk_quota_bytes": 200_000_000,
                       "duration_tolerance_seconds": 1.0, "resolution_tolerance_ratio": 0.1, **limits},
            "allow_private_addresses": allow_private, "retention_class": "standard",
            "tags": {"tenant_id": "tenant-1", "project": "proj-a", "task_id": task_id, "retention_class": "standard"}}


def env_for(work: Path, **extra) -> dict:
    return {**os.environ, "AIVEDIO_FFMPEG": FFMPEG, "AIVEDIO_MEDIA_WORKDIR": str(work), **extra}


def run_worker(spec: dict, work: Path, timeout: float = 180, **env) -> tuple[int, dict, str]:
    done = subprocess.run([sys.executable, str(WORKER), json.dumps(spec)], env=env_for(work, **env),
                          capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr
    return done.returncode, json.loads(lines[-1]), done.stderr


def probe_file(path: Path) -> dict:
    with av.open(str(path)) as c:
        v = c.streams.video[0]
        return {"size": (v.codec_context.width, v.codec_context.height), "codec": v.codec_context.name,
                "duration": c.duration / 1_000_000 if c.duration else None,
                "audio": [a.codec_context.name for a in c.streams.audio],
                "frames": sum(1 for _ in c.decode(v))}


def assert_clean(work: Path) -> None:
    assert list(work.iterdir()) == [], "the working directory was not cleaned"


# --- good clips -----------------------------------------------------------------------------------

def test_the_simulators_clip_is_checked_and_gets_a_proxy_and_a_thumbnail(server, room):
    out, work = room
    rc, result, stderr = run_worker(make_spec(server("sim_720p"), out), work)
    assert (rc, result["status"], result["code"]) == (0, "ok", None), (result, stderr)
    assert {k: result[k] for k in ("task_id", "output_version", "fencing_token")} == {
        "task_id": "task-1", "output_version": 1, "fencing_token": 7}
    assert result["probe"] == {"container": "mp4", "video_codec": "h264", "duration_seconds": 4.0, "width": 1280,
                               "height": 720, "fps": 2.0, "has_audio": True, "bytes": len(make_mp4(4, "720p", True))}
    by_type = {o["asset_type"]: o for o in result["outputs"]}
    assert list(by_type) == ["proxy", "thumbnail"]  # not final: no delivery encode
    proxy, thumb = by_type["proxy"], by_type["thumbnail"]
    assert proxy["key"] == str(out / "task-1-v1-proxy.mp4") and thumb["key"] == str(out / "task-1-v1-thumbnail.jpg")
    assert (proxy["width"], proxy["height"], proxy["codec"], proxy["content_type"]) == (1280, 720, "h264", "video/mp4")
    got = probe_file(Path(proxy["key"]))
    assert got["size"] == (1280, 720) and got["codec"] == "h264" and got["audio"] == ["aac"]
    assert got["duration"] == pytest.approx(4.0, abs=0.3) and proxy["duration_seconds"] == pytest.approx(4.0, abs=0.3)
    assert proxy["bytes"] == Path(proxy["key"]).stat().st_size
    with av.open(thumb["key"]) as c:
        assert (c.streams.video[0].width, c.streams.video[0].height) == (640, 360)
        assert c.streams.video[0].codec_context.name == "mjpeg"
    assert Path(thumb["key"]).read_bytes()[:2] == b"\xff\xd8"
    assert (thumb["width"], thumb["height"], thumb["content_type"], thumb["duration_seconds"]) == (640, 360, "image/jpeg", None)
    assert result["bytes_stored"] == proxy["bytes"] + thumb["bytes"] and result["transcode_seconds"] > 0
    assert sorted(p.name for p in out.iterdir()) == ["task-1-v1-proxy.mp4", "task-1-v1-thumbnail.jpg"]
    assert_clean(work)


def test_a_final_1080p_render_gets_a_720p_proxy_and_a_1080p_delivery(server, room):
    out, work = room
    rc, result, stderr = run_worker(make_spec(server("sim_1080p"), out, resolution="1080p", final=True), work)
    assert rc == 0 and result["status"] == "ok", (result, stderr)
    by_type = {o["asset_type"]: o for o in result["outputs"]}
    assert list(by_type) == ["proxy", "thumbnail", "delivery"]
    assert probe_file(Path(by_type["proxy"]["key"]))["size"] == (1280, 720)
    delivery = probe_file(Path(by_type["delivery"]["key"]))
    assert delivery["size"] == (1920, 1080) and delivery["codec"] == "h264" and delivery["audio"] == ["aac"]
    assert delivery["duration"] == pytest.approx(4.0, abs=0.3) and delivery["frames"] >= 8
    assert by_type["delivery"]["key"].endswith("task-1-v1-delivery.mp4")
    with av.open(by_type["thumbnail"]["key"]) as c:
        assert (c.streams.video[0].width, c.streams.video[0].height) == (640, 360)
    assert_clean(work)


def test_a_smaller_source_keeps_its_height_and_a_silent_order_needs_no_audio(server, room):
    out, work = room
    rc, result, _ = run_worker(make_spec(server("pattern_480p"), out, duration=3, resolution="480p", with_audio=False), work)
    assert rc == 0, result
    assert result["probe"]["fps"] == 10.0 and result["probe"]["has_audio"] is True  # audio not ordered, kept anyway
    proxy = probe_file(Path(result["outputs"][0]["key"]))
    assert proxy["size"] == (854, 480) and proxy["audio"] == ["aac"] and proxy["frames"] == 30
    rc, result, _ = run_worker(make_spec(server("pattern_mkv"), out, task_id="task-3", duration=3, resolution="480p"), work)
    assert rc == 0 and result["probe"]["container"] == "matroska", result
    assert probe_file(Path(result["outputs"][0]["key"]))["size"] == (854, 480)
    rc, result, _ = run_worker(make_spec(server("sim_480p_silent"), out, task_id="task-2", resolution="480p",
                                         with_audio=False), work)
    assert rc == 0, result
    assert result["probe"]["has_audio"] is False and probe_file(Path(result["outputs"][0]["key"]))["audio"] == []
    thumb = next(o for o in result["outputs"] if o["asset_type"] == "thumbnail")
    assert (thumb["width"], thumb["height"]) == (640, 360)
    assert_clean(work)


def test_a_portrait_clip_is_measured_on_its_short_side(server, room):
    out, work = room
    rc, result, _ = run_worker(make_spec(server("portrait_1080p"), out, duration=2, resolution="1080p"), work)
    assert rc == 0, result
    assert (result["probe"]["width"], result["probe"]["height"]) == (1080, 1920)
    by_type = {o["asset_type"]: o for o in result["outputs"]}
    assert probe_file(Path(by_type["proxy"]["key"]))["size"] == (720, 1280)
    assert (by_type["thumbnail"]["width"], by_type["thumbnail"]["height"]) == (360, 640)


# --- bad clips ------------------------------------------------------------------------------------

BAD = [
    ("empty", {}, "MEDIA_EMPTY"),
    ("truncated", {}, "MEDIA_TRUNCATED"),
    ("truncated_faststart", {"duration": 3, "resolution": "480p"}, "MEDIA_TRUNCATED"),
    ("truncated_mkv", {"duration": 3, "resolution": "480p"}, "MEDIA_TRUNCATED"),
    ("not_video", {}, "MEDIA_NOT_VIDEO"),
    ("still_jpeg", {}, "MEDIA_NOT_VIDEO"),
    ("wrong_duration", {}, "MEDIA_DURATION_MISMATCH"),
    ("wrong_resolution", {}, "MEDIA_RESOLUTION_MISMATCH"),
    ("no_audio", {}, "MEDIA_AUDIO_MISSING"),
    ("sim_720p", {"max_bytes": 1000}, "MEDIA_TOO_LARGE"),  # refused by its Content-Length
    ("sim_720p", {"max_bytes": 1000, "kind": "stream"}, "MEDIA_TOO_LARGE"),  # no Content-Length: the bytes read
    ("sim_720p", {"disk_quota_bytes": 1000}, "MEDIA_DISK_QUOTA"),  # the source alone is over the quota
    ("sim_720p", {"allow_private": False}, "MEDIA_PRIVATE_ADDRESS"),  # the loopback, not exempted
]


@pytest.mark.parametrize("clip, how, code", BAD, ids=[f"{c}-{code}" for c, _, code in BAD])
def test_a_bad_clip_is_rejected_with_its_code_and_leaves_nothing(server, room, clip, how, code):
    out, work = room
    how = dict(how)
    kind = how.pop("kind", "file")
    limits = {k: how.pop(k) for k in ("max_bytes", "disk_quota_bytes") if k in how}
    # an earlier, killed run of this (task, version) left a published proxy: a rejection removes it too
    (out / "task-1-v1-proxy.mp4").write_bytes(b"left over")
    rc, result, stderr = run_worker(make_spec(server(clip, kind), out, **how, **limits), work)
    assert (rc, result["status"], result["code"]) == (3, "rejected", code), (result, stderr)
    assert result["message"] and result["outputs"] == [] and result["bytes_stored"] == 0
    assert list(out.iterdir()) == []
    assert_clean(work)
    if code in ("MEDIA_DURATION_MISMATCH", "MEDIA_RESOLUTION_MISMATCH", "MEDIA_AUDIO_MISSING"):
        assert result["probe"]["video_codec"] == "h264"  # what was measured comes with the rejection
    if code == "MEDIA_DURATION_MISMATCH":
        assert result["probe"]["duration_seconds"] == pytest.approx(2.0, abs=0.1)
    if code == "MEDIA_RESOLUTION_MISMATCH":
        assert (result["probe"]["width"], result["probe"]["height"]) == (854, 480)


@pytest.mark.parametrize("url", ["http://10.1.2.3/out.mp4", "http://[::1]:9/out.mp4", "http://169.254.169.254/latest/meta-data",
                                 "http://[::ffff:127.0.0.1]/x.mp4", "file:///etc/passwd", "http://user:pw@example.com/x.mp4"])
def test_urls_the_address_rules_forbid_are_rejected_before_any_connection(room, url):
    out, work = room
    rc, result, _ = run_worker(make_spec(url, out, allow_private=False), work, timeout=60)
    assert (rc, result["status"], result["code"]) == (3, "rejected", "MEDIA_PRIVATE_ADDRESS"), result
    assert list(out.iterdir()) == []
    assert_clean(work)


# --- transient faults -----------------------------------------------------------------------------

def test_a_missing_source_is_a_retryable_fetch_failure(server, room):
    out, work = room
    rc, result, _ = run_worker(make_spec(server("nope.mp4"), out), work)
    assert (rc, result["status"], result["code"]) == (1, "error", "MEDIA_FETCH_FAILED") and "404" in result["message"]
    assert_clean(work)


def test_a_source_that_never_answers_ends_at_the_deadline(server, room):
    out, work = room
    started = time.monotonic()
    rc, result, _ = run_worker(make_spec(server("sim_720p", "hang"), out, timeout_seconds=1.0), work)
    assert (rc, result["status"], result["code"]) == (1, "error", "MEDIA_TIMEOUT")
    assert time.monotonic() - started < 15
    assert list(out.iterdir()) == [] and list(work.iterdir()) == []


def test_ffmpeg_failing_is_a_retryable_transcode_failure(server, room, tmp_path):
    out, work = room
    broken = tmp_path / "ffmpeg"
    broken.write_text("#!/bin/sh\necho 'simulated crash' >&2\nexit 139\n")
    broken.chmod(0o755)
    rc, result, _ = run_worker(make_spec(server("sim_720p"), out), work, AIVEDIO_FFMPEG=str(broken))
    assert (rc, result["status"], result["code"]) == (1, "error", "MEDIA_TRANSCODE_FAILED")
    assert "simulated crash" in result["message"] and result["probe"]["width"] == 1280
    assert list(out.iterdir()) == [] and list(work.iterdir()) == []


def test_outputs_over_the_disk_quota_are_refused(server, room):
    out, work = room
    source = len(make_mp4(4, "720p", True))
    rc, result, _ = run_worker(make_spec(server("sim_720p"), out, disk_quota_bytes=source + 500), work)
    assert (rc, result["status"], result["code"]) == (3, "rejected", "MEDIA_DISK_QUOTA"), result
    assert result["transcode_seconds"] > 0  # what the failed encode spent is reported too
    assert list(out.iterdir()) == [] and list(work.iterdir()) == []


def test_an_invalid_spec_exits_2(room):
    out, work = room
    spec = make_spec("http://127.0.0.1/x.mp4", out)
    for bad in ({**spec, "task_id": "../escape"}, {**spec, "order": {**spec["order"], "resolution": "8k"}},
                {**spec, "outputs": "relative/dir/"}, {**spec, "surprise": 1}):
        done = subprocess.run([sys.executable, str(WORKER), json.dumps(bad)], env=env_for(work), capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and json.loads(done.stdout.splitlines()[-1])["status"] == "invalid"


# --- killed workers -------------------------------------------------------------------------------

def _slow_ffmpeg(tmp_path: Path) -> Path:
    """FFmpeg reading its input at the native frame rate: a 4 s clip takes 4 s to transcode, at no CPU."""
    slow = tmp_path / "slow-ffmpeg"
    slow.write_text(f'#!/bin/sh\nexec "{FFMPEG}" -re "$@"\n')
    slow.chmod(0o755)
    return slow


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] in "ZX"
    except OSError:
        return True


def _start(spec: dict, work: Path, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], env=env_for(work, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigkill_mid_transcode_then_a_retry_ends_with_one_set_of_outputs(server, room, tmp_path):
    out, work = room
    spec = make_spec(server("sim_1080p"), out, resolution="1080p", final=True)
    proc = _start(spec, work, AIVEDIO_FFMPEG=str(_slow_ffmpeg(tmp_path)))
    try:
        workdir = wait_for(lambda: next(iter(work.glob("task-1-v1-*")), None), timeout=30)
        wait_for(lambda: (workdir / "proxy.mp4").exists(), timeout=30)
        ffmpeg = wait_for(lambda: _children(proc.pid), timeout=10)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    wait_for(lambda: all(_gone(p) for p in ffmpeg), timeout=10)  # FFmpeg died with its worker (PDEATHSIG)
    assert list(out.iterdir()) == []  # nothing was published mid-transcode
    assert workdir.exists()  # SIGKILL cleans nothing ...
    (out / ".task-1-v1-proxy.mp4.partial-99999").write_bytes(b"half a copy")  # ... as a kill while publishing would leave

    for _ in range(2):  # the retry, then a duplicate run of the same (task, output version)
        rc, result, stderr = run_worker(spec, work)
        assert rc == 0 and result["status"] == "ok", (result, stderr)
        assert sorted(p.name for p in out.iterdir()) == ["task-1-v1-delivery.mp4", "task-1-v1-proxy.mp4",
                                                         "task-1-v1-thumbnail.jpg"]
        assert_clean(work)  # ... the retry removed what the killed run left
    for o in result["outputs"]:
        assert Path(o["key"]).stat().st_size == o["bytes"]
    assert probe_file(out / "task-1-v1-delivery.mp4")["size"] == (1920, 1080)


def test_sigterm_stops_ffmpeg_cleans_up_and_reports_a_retryable_error(server, room, tmp_path):
    out, work = room
    proc = _start(make_spec(server("sim_720p"), out), work, AIVEDIO_FFMPEG=str(_slow_ffmpeg(tmp_path)))
    try:
        wait_for(lambda: any(work.glob("task-1-v1-*/proxy.mp4")), timeout=30)
        ffmpeg = wait_for(lambda: _children(proc.pid), timeout=10)
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    result = json.loads(stdout.strip().splitlines()[-1])
    assert (proc.returncode, result["status"], result["code"]) == (1, "error", "MEDIA_TIMEOUT")
    assert "SIGTERM" in result["message"]
    assert all(_gone(p) for p in ffmpeg)
    assert list(out.iterdir()) == [] and list(work.iterdir()) == []


# --- S3 outputs (moto, in process) ----------------------------------------------------------------

def test_s3_outputs_are_tagged_and_the_result_is_stored_beside_them(server, monkeypatch, tmp_path, capsys):
    boto3 = pytest.importorskip("boto3")
    moto = pytest.importorskip("moto")
    worker = _load_worker()
    monkeypatch.setenv("AIVEDIO_FFMPEG", FFMPEG)
    monkeypatch.setenv("AIVEDIO_MEDIA_WORKDIR", str(tmp_path / "work"))
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(k, "testing")
    with moto.mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="media")
        spec = make_spec(server("sim_720p"), tmp_path, final=True)
        spec["outputs"] = "s3://media/outputs/tenant-1/task-1/v1/"
        assert worker.main([json.dumps(spec)]) == 0
        printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        stored = json.loads(s3.get_object(Bucket="media", Key="outputs/tenant-1/task-1/v1/result.json")["Body"].read())
        assert printed == stored and printed["status"] == "ok"
        keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="media")["Contents"])
        assert keys == [f"outputs/tenant-1/task-1/v1/{n}" for n in
                        ("result.json", "task-1-v1-delivery.mp4", "task-1-v1-proxy.mp4", "task-1-v1-thumbnail.jpg")]
        for o in printed["outputs"]:
            head = s3.head_object(Bucket="media", Key=o["key"])
            assert head["ContentType"] == o["content_type"] and head["ContentLength"] == o["bytes"]
            tags = {t["Key"]: t["Value"] for t in s3.get_object_tagging(Bucket="media", Key=o["key"])["TagSet"]}
            assert tags == {"tenant_id": "tenant-1", "project": "proj-a", "task_id": "task-1",
                            "asset_type": o["asset_type"], "retention_class": "standard"}
        # a bad clip: rejected, its result stored, and nothing of this (task, version) left but result.json
        spec["source_url"] = server("truncated")
        assert worker.main([json.dumps(spec)]) == 3
        stored = json.loads(s3.get_object(Bucket="media", Key="outputs/tenant-1/task-1/v1/result.json")["Body"].read())
        assert (stored["status"], stored["code"]) == ("rejected", "MEDIA_TRUNCATED")
        assert [o["Key"] for o in s3.list_objects_v2(Bucket="media")["Contents"]] == ["outputs/tenant-1/task-1/v1/result.json"]
    assert list((tmp_path / "work").iterdir()) == []


def test_object_tags_are_what_s3_accepts():
    worker = _load_worker()
    spec = make_spec("http://127.0.0.1/x.mp4", Path("/tmp/o"))
    spec["project"], spec["tags"]["note"] = "Spring #1 (draft)?", None
    tags = worker.IngestSpec.parse(spec).object_tags("proxy")
    assert tags == {"tenant_id": "tenant-1", "project": "Spring _1 _draft__", "task_id": "task-1",
                    "retention_class": "standard", "asset_type": "proxy"}


# --- the simulator's outputs, end to end ----------------------------------------------------------

def test_the_workers_verdict_on_the_simulators_outputs_and_misbehaviours(room):
    from aivedio.config import ProviderAccount, ProviderConfig, SimulatorBehaviour
    from aivedio.providers.adapter import HttpProviderAdapter, SubmitRequest
    from aivedio_tools.provider_sim import SimulatorServer

    out, work = room
    cfg = ProviderConfig(name="sim-media", webhook_secret="whsec_c2ltLXRlc3Qtc2VjcmV0",
                         accounts=[ProviderAccount(account_id="acct-1", api_key="key-1", max_concurrency=10)],
                         simulator=SimulatorBehaviour(queue_seconds_max=0.0, latency_seconds_min=1.0,
                                                      latency_seconds_max=1.0, failure_rate=0.0))
    expected = {None: (0, "ok"), "truncated": (3, "MEDIA_TRUNCATED"), "empty": (3, "MEDIA_EMPTY"),
                "not_video": (3, "MEDIA_NOT_VIDEO"), "wrong_duration": (3, "MEDIA_DURATION_MISMATCH"),
                "wrong_resolution": (3, "MEDIA_RESOLUTION_MISMATCH"), "no_audio": (3, "MEDIA_AUDIO_MISSING")}
    with SimulatorServer(cfg, cfg.simulator, time_scale=100.0) as sim:
        adapter = HttpProviderAdapter(cfg, sim.base_url)
        try:
            jobs = {}
            for fault in expected:
                prompt = "a lighthouse" + (f" [sim:output={fault}]" if fault else "")
                jobs[fault] = adapter.submit("acct-1", f"k-{fault}", SubmitRequest(
                    model="video-model-x", prompt=prompt, duration_seconds=4, resolution="1080p", with_audio=True,
                    client_request_id=f"c-{fault}")).job_id
            for fault, (exit_code, verdict) in expected.items():
                job = wait_for(lambda j=jobs[fault]: (d := adapter.get("acct-1", j)).terminal and d, timeout=30)
                rc, result, stderr = run_worker(make_spec(job.output_url, out, task_id=f"t-{fault or 'good'}",
                                                          resolution="1080p"), work)
                assert (rc, result["code"] or result["status"]) == (exit_code, verdict), (fault, result, stderr)
        finally:
            adapter.close()
    assert sorted(p.name for p in out.iterdir()) == ["t-good-v1-proxy.mp4", "t-good-v1-thumbnail.jpg"]
    assert_clean(work)
