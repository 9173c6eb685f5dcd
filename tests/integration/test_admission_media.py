"""Input media is measured by the server (issue 3 §3): real files encoded here with PyAV, served over
HTTP from 127.0.0.1, fetched and probed by admission through the real `api` handler. Declared
sizes and durations are never trusted; a rejected input writes nothing."""
from __future__ import annotations

import functools
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import av
import pytest

from aivedio.config import Limits, PlatformConfig
from tests.admission_support import BODY, accepted, footprint, new_tenant, serve

_ = serve  # a fixture, imported for the tests that request it

SIZE = 64  # pixels; tiny files keep the tests fast
LOCAL = ["127.0.0.1"]  # the media server below; the probe refuses non-global addresses unless allowed


@pytest.fixture
def platform(make_platform):
    """The default platform, allowed to probe the local media server."""
    from aivedio.context import set_platform

    p = make_platform(PlatformConfig(limits=Limits(probe_allowed_private_hosts=LOCAL)))
    set_platform(p)
    yield p
    set_platform(None)


def _frame(shade: int) -> av.VideoFrame:
    f = av.VideoFrame(SIZE, SIZE, "rgb24")
    plane = f.planes[0]
    plane.update((bytes([shade, 255 - shade, 90]) * (plane.buffer_size // 3 + 1))[: plane.buffer_size])
    return f


def encode_mp4(path: Path, seconds: float, fps: int = 10) -> Path:
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width = s.height = SIZE
        s.pix_fmt = "yuv420p"
        for i in range(int(seconds * fps)):
            for packet in s.encode(_frame((i * 7) % 255)):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return path


def encode_png(path: Path) -> Path:
    with av.open(str(path), "w", format="image2") as c:
        s = c.add_stream("png", rate=1)
        s.width = s.height = SIZE
        s.pix_fmt = "rgb24"
        for packet in s.encode(_frame(200)):
            c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return path


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """Real media under http://127.0.0.1:<port>/: name -> URL, plus the files' sizes."""
    root = tmp_path_factory.mktemp("media")
    files = {
        "still.png": encode_png(root / "still.png"),
        "clip2s.mp4": encode_mp4(root / "clip2s.mp4", 2),
        "clip8s.mp4": encode_mp4(root / "clip8s.mp4", 8),
    }
    files["notes.png"] = root / "notes.png"  # named like an image; it is text
    files["notes.png"].write_text("these are notes, not a picture\n" * 20)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    yield {name: f"{base}/{name}" for name in files} | {"missing": f"{base}/nope.mp4"} \
        | {f"size:{name}": p.stat().st_size for name, p in files.items()}
    server.shutdown()
    server.server_close()


def task_row(conn, task_id):
    return conn.execute("select * from generation_task where task_id = %s", (task_id,)).fetchone()


def assert_invalid(r, code: str, field: str, conn, tenant_id, before) -> dict:
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"] == code, body
    assert field in body["details"]["fields"], body
    assert footprint(conn, tenant_id) == before
    return body


def test_image_to_video_with_a_real_png_is_accepted(platform, conn, serve, media):
    api = serve(platform)
    t = new_tenant(platform)
    body = {**BODY, "mode": "image_to_video", "inputs": [{"url": media["still.png"], "kind": "image"}]}
    task = accepted(api.submit(t, body))
    row = task_row(conn, task["task_id"])
    assert row["mode"] == "image_to_video" and row["inputs"] == [{"url": media["still.png"], "kind": "image"}]
    assert row["normalized_params"]["input_seconds"] == 0  # a still has no duration to add


def test_a_file_that_is_not_media_is_refused(platform, conn, serve, media):
    api = serve(platform)
    t = new_tenant(platform)
    before = footprint(conn, t.tenant_id)
    body = {**BODY, "mode": "image_to_video", "inputs": [{"url": media["notes.png"], "kind": "image"}]}
    assert_invalid(api.submit(t, body), "INPUT_NOT_MEDIA", "body.inputs.0.url", conn, t.tenant_id, before)


def test_the_field_path_names_the_bad_input(platform, conn, serve, media):
    api = serve(platform)
    t = new_tenant(platform)
    before = footprint(conn, t.tenant_id)
    body = {**BODY, "mode": "image_to_video", "inputs": [{"url": media["still.png"], "kind": "image"},
                                                         {"url": media["notes.png"], "kind": "image"}]}
    got = assert_invalid(api.submit(t, body), "INPUT_NOT_MEDIA", "body.inputs.1.url", conn, t.tenant_id, before)
    assert "body.inputs.0.url" not in got["details"]["fields"]


def test_an_unreachable_input_is_refused(platform, conn, serve, media):
    api = serve(platform)
    t = new_tenant(platform)
    before = footprint(conn, t.tenant_id)
    body = {**BODY, "mode": "video_to_video", "inputs": [{"url": media["missing"], "kind": "video"}]}
    assert_invalid(api.submit(t, body), "INPUT_UNREACHABLE", "body.inputs.0.url", conn, t.tenant_id, before)


@pytest.mark.parametrize("mode,declared,actual", [("image_to_video", "image", "clip2s.mp4"),
                                                  ("video_to_video", "video", "still.png")])
def test_a_declared_kind_that_is_not_the_measured_kind_is_refused(platform, conn, serve, media, mode, declared, actual):
    api = serve(platform)
    t = new_tenant(platform)
    before = footprint(conn, t.tenant_id)
    body = {**BODY, "mode": mode, "inputs": [{"url": media[actual], "kind": declared}]}
    got = assert_invalid(api.submit(t, body), "VALIDATION_ERROR", "body.inputs.0.kind", conn, t.tenant_id, before)
    assert declared in got["details"]["fields"]["body.inputs.0.kind"]


def test_an_input_over_max_input_bytes_is_refused(make_platform, conn, serve, media):
    limit = media["size:clip2s.mp4"] - 1
    p = make_platform(PlatformConfig(limits=Limits(max_input_bytes=limit, probe_allowed_private_hosts=LOCAL)))
    api = serve(p)
    t = new_tenant(p)
    before = footprint(conn, t.tenant_id)
    # A declared size is not a field the server reads: it measures the bytes it fetched.
    inputs = [{"url": media["clip2s.mp4"], "kind": "video", "size_bytes": 10, "duration_seconds": 1}]
    got = assert_invalid(api.submit(t, {**BODY, "mode": "video_to_video", "inputs": inputs}),
                         "INPUT_TOO_LARGE", "body.inputs.0.url", conn, t.tenant_id, before)
    assert str(limit) in got["details"]["fields"]["body.inputs.0.url"]
    # The still is under the limit and goes through.
    accepted(api.submit(t, {**BODY, "mode": "image_to_video", "inputs": [{"url": media["still.png"], "kind": "image"}]}))


def test_a_video_longer_than_max_input_duration_is_refused(make_platform, conn, serve, media):
    p = make_platform(PlatformConfig(limits=Limits(max_input_duration_seconds=5, probe_allowed_private_hosts=LOCAL)))
    api = serve(p)
    t = new_tenant(p)
    before = footprint(conn, t.tenant_id)
    inputs = [{"url": media["clip8s.mp4"], "kind": "video", "duration_seconds": 1}]  # declared 1 s; it lasts 8 s
    assert_invalid(api.submit(t, {**BODY, "mode": "video_to_video", "inputs": inputs}),
                   "INPUT_TOO_LONG", "body.inputs.0.url", conn, t.tenant_id, before)
    accepted(api.submit(t, {**BODY, "mode": "video_to_video", "inputs": [{"url": media["clip2s.mp4"], "kind": "video"}]}))


def test_a_reference_video_costs_more_fairness_units_than_text_alone(platform, conn, serve, media):
    api = serve(platform)
    t = new_tenant(platform)
    t2v = task_row(conn, accepted(api.submit(t))["task_id"])
    v2v_short = task_row(conn, accepted(api.submit(t, {**BODY, "mode": "video_to_video", "inputs": [
        {"url": media["clip2s.mp4"], "kind": "video", "duration_seconds": 600}]}))["task_id"])
    v2v_long = task_row(conn, accepted(api.submit(t, {**BODY, "mode": "video_to_video", "inputs": [
        {"url": media["clip8s.mp4"], "kind": "video", "duration_seconds": 1}]}))["task_id"])
    assert t2v["duration_seconds"] == v2v_short["duration_seconds"] == v2v_long["duration_seconds"] == 5
    assert v2v_short["fairness_units"] > t2v["fairness_units"]
    # The server measured the reference (2 s and 8 s), whatever the client declared (600 s and 1 s).
    assert v2v_short["normalized_params"]["input_seconds"] == pytest.approx(2.0, abs=0.2)
    assert v2v_long["normalized_params"]["input_seconds"] == pytest.approx(8.0, abs=0.2)
    assert v2v_long["fairness_units"] > v2v_short["fairness_units"]
    assert v2v_short["queue_class"] == "EXPENSIVE" and v2v_short["resource_class"] == "video-v2v"
