"""containers/gpu-render/worker.py: the job spec, the FFmpeg command it builds, the encoder choice,
and (where an FFmpeg binary exists: on PATH, or imageio-ffmpeg's from the dev extra) real jobs on a
generated one-second clip, from and to local files and S3 (moto)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER_PATH = ROOT / "containers" / "gpu-render" / "worker.py"


def _load_worker():
    spec = importlib.util.spec_from_file_location("gpu_render_worker", WORKER_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


worker = _load_worker()


def _ffmpeg() -> str | None:
    found = shutil.which("ffmpeg")
    if found:
        return found
    try:
        import imageio_ffmpeg
    except ImportError:
        return None
    return imageio_ffmpeg.get_ffmpeg_exe()


FFMPEG = _ffmpeg()
needs_ffmpeg = pytest.mark.skipif(FFMPEG is None, reason="no ffmpeg binary (PATH or imageio-ffmpeg)")


# --- the job spec --------------------------------------------------------------------------------

def test_a_valid_spec_parses():
    spec = worker.JobSpec.parse(json.dumps({"operation": "transcode", "input": "s3://b/inputs/a.mov",
                                            "output": "s3://b/outputs/a.mp4", "height": 720,
                                            "retention_class": "standard"}))
    assert (spec.operation, spec.height, spec.retention_class) == ("transcode", 720, "standard")
    thumb = worker.JobSpec.parse({"operation": "thumbnail", "input": "https://example.com/v.mp4",
                                  "output": "/tmp/t.jpg", "at_seconds": 2})
    assert thumb.at_seconds == 2.0


@pytest.mark.parametrize("doc, message", [
    ({"operation": "render", "input": "/a.mp4", "output": "/b.mp4"}, "operation"),
    ({"operation": "transcode", "input": "http://plain.example/a.mp4", "output": "/b.mp4"}, "scheme"),
    ({"operation": "transcode", "input": "/a.mp4", "output": "https://x/b.mp4"}, "scheme"),
    ({"operation": "transcode", "input": "/a.mp4"}, "output is missing"),
    ({"operation": "transcode", "input": "/a.mp4", "output": "/b.mp4", "height": 721}, "height"),
    ({"operation": "transcode", "input": "/a.mp4", "output": "/b.mov"}, ".mp4"),
    ({"operation": "thumbnail", "input": "/a.mp4", "output": "/b.mp4"}, "thumbnail"),
    ({"operation": "thumbnail", "input": "/a.mp4", "output": "/b.jpg", "at_seconds": -1}, "at_seconds"),
    ({"operation": "transcode", "input": "/a.mp4", "output": "/b.mp4", "gpu": True}, "unknown fields"),
])
def test_an_invalid_spec_is_refused(doc, message):
    with pytest.raises(worker.SpecError, match=message):
        worker.JobSpec.parse(doc)


def test_an_invalid_spec_exits_2_without_running_anything(capsys, monkeypatch):
    monkeypatch.delenv("AIVEDIO_JOB_SPEC", raising=False)
    assert worker.main([]) == 2
    assert worker.main(["{not json"]) == 2
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["status"] for line in lines] == ["invalid", "invalid"]


# --- the FFmpeg command ----------------------------------------------------------------------------

def test_transcode_command_with_libx264():
    spec = worker.JobSpec.parse({"operation": "transcode", "input": "/in/a.mov", "output": "/out/a.mp4", "height": 720})
    cmd = worker.ffmpeg_command(spec, Path("/w/input.mov"), Path("/w/output.mp4"), ffmpeg="/usr/bin/ffmpeg")
    assert cmd[0] == "/usr/bin/ffmpeg" and cmd[-1] == "/w/output.mp4"
    assert cmd[cmd.index("-i") + 1] == "/w/input.mov"
    assert cmd[cmd.index("-c:v") + 1] == "libx264" and cmd[cmd.index("-crf") + 1] == "23"
    assert cmd[cmd.index("-vf") + 1] == "scale=-2:720"
    assert cmd[cmd.index("-c:a") + 1] == "aac"
    assert "0:a:0?" in cmd  # audio when the input has some
    assert cmd[cmd.index("-movflags") + 1] == "+faststart"
    assert cmd[cmd.index("-pix_fmt") + 1] == "yuv420p"
    assert "-nostdin" in cmd and "-y" in cmd


def test_transcode_command_with_nvenc_and_no_scaling():
    spec = worker.JobSpec.parse({"operation": "transcode", "input": "/in/a.mov", "output": "/out/a.mp4"})
    cmd = worker.ffmpeg_command(spec, Path("i.mov"), Path("o.mp4"), encoder="h264_nvenc")
    assert cmd[cmd.index("-c:v") + 1] == "h264_nvenc" and "-cq" in cmd and "-crf" not in cmd
    assert "-vf" not in cmd


def test_thumbnail_command_seeks_before_the_input_and_takes_one_frame():
    spec = worker.JobSpec.parse({"operation": "thumbnail", "input": "/in/a.mp4", "output": "/out/t.jpg",
                                 "at_seconds": 1.5, "height": 240})
    cmd = worker.ffmpeg_command(spec, Path("i.mp4"), Path("t.jpg"))
    assert cmd.index("-ss") < cmd.index("-i") and cmd[cmd.index("-ss") + 1] == "1.500"
    assert cmd[cmd.index("-frames:v") + 1] == "1"
    assert cmd[cmd.index("-vf") + 1] == "scale=-2:240"
    assert "-c:v" not in cmd and cmd[-1] == "t.jpg"


def test_the_encoder_is_nvenc_only_with_an_nvidia_device_and_an_ffmpeg_that_has_it(tmp_path, monkeypatch):
    fake = tmp_path / "ffmpeg"
    fake.write_text("#!/bin/sh\necho ' V....D h264_nvenc           NVIDIA NVENC H.264 encoder (codec h264)'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(worker, "NVIDIA_DEVICE", tmp_path / "nvidia0")
    assert worker.pick_encoder(str(fake)) == "libx264"  # no device
    (tmp_path / "nvidia0").touch()
    assert worker.pick_encoder(str(fake)) == "h264_nvenc"
    fake.write_text("#!/bin/sh\necho ' V....D libx264  libx264 H.264'\n")
    assert worker.pick_encoder(str(fake)) == "libx264"  # a device, but no NVENC in this build


# --- real jobs -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    """One second of test pattern, 160x120 at 10 fps, with a sine tone."""
    if FFMPEG is None:
        pytest.skip("no ffmpeg binary")
    path = tmp_path_factory.mktemp("clip") / "clip.mkv"
    subprocess.run([FFMPEG, "-hide_banner", "-loglevel", "error", "-nostdin", "-y",
                    "-f", "lavfi", "-i", "testsrc=size=160x120:rate=10:duration=1",
                    "-f", "lavfi", "-i", "sine=frequency=440:duration=1",
                    "-c:v", "mpeg4", "-c:a", "pcm_s16le", "-shortest", str(path)], check=True, timeout=60)
    return path


def _report(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@needs_ffmpeg
def test_a_real_transcode_writes_a_readable_h264_mp4(clip, tmp_path, monkeypatch, capsys):
    import av

    monkeypatch.setenv("AIVEDIO_FFMPEG", FFMPEG)
    out = tmp_path / "out" / "a.mp4"
    spec = {"operation": "transcode", "input": str(clip), "output": str(out), "height": 96}
    assert worker.main([json.dumps(spec)]) == 0
    report = _report(capsys)
    assert report["status"] == "done" and report["encoder"] == "libx264"  # no NVIDIA device here
    assert (report["width"], report["height"], report["codec"], report["audio"]) == (128, 96, "h264", True)
    assert report["bytes"] == out.stat().st_size > 0
    with av.open(str(out)) as container:
        assert container.streams.video[0].codec_context.name == "h264"
        assert container.streams.audio[0].codec_context.name == "aac"
        assert 0.8 <= container.duration / 1_000_000 <= 1.3


@needs_ffmpeg
def test_a_failing_ffmpeg_exits_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AIVEDIO_FFMPEG", FFMPEG)
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"not a video at all")
    spec = {"operation": "transcode", "input": str(garbage), "output": str(tmp_path / "o.mp4")}
    assert worker.main([json.dumps(spec)]) == 1
    report = _report(capsys)
    assert report["status"] == "failed" and "ffmpeg exited" in report["error"]


@needs_ffmpeg
def test_the_entry_point_makes_a_thumbnail_from_the_job_spec_env(clip, tmp_path):
    """As the container runs it: `python worker.py`, the spec in AIVEDIO_JOB_SPEC."""
    out = tmp_path / "t.png"
    env = {**os.environ, "AIVEDIO_FFMPEG": FFMPEG, "AIVEDIO_RESOURCE_CLASS": "video-standard",
           "AIVEDIO_JOB_SPEC": json.dumps({"operation": "thumbnail", "input": str(clip), "output": str(out),
                                           "at_seconds": 0.5})}
    done = subprocess.run([sys.executable, str(WORKER_PATH)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["width"], report["height"], report["encoder"]) == (160, 120, "png")
    assert report["resource_class"] == "video-standard"
    assert out.read_bytes().startswith(b"\x89PNG")


@needs_ffmpeg
def test_a_job_reads_and_writes_s3_and_tags_its_retention_class(clip, monkeypatch, capsys):
    boto3 = pytest.importorskip("boto3")
    moto = pytest.importorskip("moto")
    monkeypatch.setenv("AIVEDIO_FFMPEG", FFMPEG)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with moto.mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="media")
        s3.upload_file(str(clip), "media", "inputs/t1/clip.mkv")
        spec = {"operation": "thumbnail", "input": "s3://media/inputs/t1/clip.mkv",
                "output": "s3://media/outputs/t1/thumb.jpg", "retention_class": "short"}
        assert worker.main([json.dumps(spec)]) == 0
        assert _report(capsys)["encoder"] == "mjpeg"
        obj = s3.get_object(Bucket="media", Key="outputs/t1/thumb.jpg")
        assert obj["ContentType"] == "image/jpeg" and obj["Body"].read().startswith(b"\xff\xd8")
        tags = s3.get_object_tagging(Bucket="media", Key="outputs/t1/thumb.jpg")["TagSet"]
        assert tags == [{"Key": "retention_class", "Value": "short"}]


def test_the_dockerfile_runs_this_worker_from_a_context_that_holds_it():
    dockerfile = (ROOT / "containers" / "gpu-render" / "Dockerfile").read_text()
    assert "COPY containers/gpu-render/worker.py /opt/gpu-render/worker.py" in dockerfile
    assert 'ENTRYPOINT ["python", "/opt/gpu-render/worker.py"]' in dockerfile
    assert "apt-get install -y --no-install-recommends ffmpeg" in dockerfile
    assert "RUN pip install ." in dockerfile
    ignore = (ROOT / "containers" / "gpu-render" / "Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("*") + 1:][:3] == ["!pyproject.toml", "!shared/aivedio", "!containers/gpu-render"]
