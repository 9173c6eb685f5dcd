"""The media pipeline end to end through `aivedio serve` (issue 17, "Done means"): a real `aivedio
serve` process on this module's PostgreSQL and the test Redis, with its built-in provider simulator
making real MP4s that match each order, its media-dispatch loop running the gpu-render worker as
subprocesses with real FFmpeg, its outbox relay and settlement.

- Each good task ends SUCCEEDED; its outputs are fetched from the platform's own URLs (signed, served
  by the same server; never the provider's) and probe, with PyAV, as the order asked: the duration,
  the delivery encode at the ordered resolution, the proxy at 720p at most, audio when ordered, and a
  thumbnail image. It is charged its quote.
- A task whose provider returns a truncated file ("[sim:output=truncated]" in its prompt: the
  simulator's misbehaviour) ends MEDIA_INGEST_FAILED with the tenant's mapped error, no outputs and
  nothing charged: the reservation is released whole."""
from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from aivedio.admin.tenants import create_tenant
from tests.conftest import drop_redis_prefix, stop_if_running
from tests.scheduler_support import OPEN, UNCAPPED

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("media")]

SCRIPT = Path(sys.executable).with_name("aivedio")
AIVEDIO = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "aivedio_tools.cli"]
TIME_SCALE = 20.0
CONFIG = f"""
time_scale = {TIME_SCALE}

[[providers]]
name = "provider-a"
submit_timeout_seconds = 5.0

[providers.simulator]
queue_seconds_min = 0.0
queue_seconds_max = 0.0
latency_seconds_min = 10.0
latency_seconds_max = 20.0
failure_rate = 0.0
webhook_drop_rate = 0.0

[timers]
scheduler_tick_seconds = 1.0
poll_first_seconds = 5.0
poll_min_seconds = 5.0
poll_max_seconds = 10.0

[media]
dispatch_seconds = 2.0
max_tries = 2
retry_base_seconds = 20.0
"""
# (prompt suffix, order): the orders the platform must deliver, and the one whose provider output is bad.
GOOD = [
    {"duration_seconds": 4, "resolution": "720p", "with_audio": True, "interactive": False},  # cpu-proxy, with delivery
    {"duration_seconds": 3, "resolution": "480p", "with_audio": False, "interactive": True},  # a preview: no delivery
    {"duration_seconds": 3, "resolution": "1080p", "with_audio": False, "interactive": False},  # gpu-render class
]
BAD = {"duration_seconds": 4, "resolution": "720p", "with_audio": False, "interactive": False}
DIMS = {"480p": (854, 480), "720p": (1280, 720), "1080p": (1920, 1080)}
RUN_TIMEOUT_SECONDS = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe(data: bytes) -> dict:
    import av

    with av.open(io.BytesIO(data)) as c:
        v = next((s for s in c.streams if s.type == "video"), None)
        a = next((s for s in c.streams if s.type == "audio"), None)
        duration = float(c.duration / 1_000_000) if c.duration else None
        return {"format": c.format.name, "width": v.codec_context.width if v else None,
                "height": v.codec_context.height if v else None, "codec": v.codec_context.name if v else None,
                "has_audio": a is not None, "duration": duration}


@pytest.fixture
def serve_process(db_url, redis_url, tmp_path):
    """`aivedio serve` on this module's database: yields (base URL, log path)."""
    port = free_port()
    (tmp_path / "aivedio.toml").write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIVEDIO_")}
    prefix = f"t{uuid.uuid4().hex[:10]}"
    env.update(AIVEDIO_HOME=str(tmp_path / "home"), AIVEDIO_CONFIG=str(tmp_path / "aivedio.toml"),
               AIVEDIO_DATABASE_URL=db_url, AIVEDIO_REDIS_URL=redis_url, AIVEDIO_REDIS_PREFIX=prefix)
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*AIVEDIO, "serve", "--port", str(port)], env=env, cwd=tmp_path, stdout=log,
                                stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"serve exited early ({proc.returncode}):\n{log_path.read_text()[-5000:]}"
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"/healthz never answered:\n{log_path.read_text()[-5000:]}"
            time.sleep(0.3)
        yield base, log_path
    finally:
        stop_if_running(proc)
        drop_redis_prefix(redis_url, prefix)


def test_outputs_by_the_platforms_urls_probe_as_ordered_and_a_truncated_output_is_not_charged(make_platform, serve_process):
    base, log_path = serve_process
    admin = make_platform()  # the same database, for the tenant
    t = create_tenant(admin, name=f"media-{uuid.uuid4().hex[:6]}", service_class="PAID_SHARED", weight=1,
                      credits=1_000_000, policy_overrides={**OPEN, **UNCAPPED})
    auth = {"Authorization": f"Bearer {t.api_key}"}
    http = httpx.Client(base_url=base, timeout=30)
    orders: dict[str, dict] = {}
    for i, order in enumerate(GOOD + [BAD]):
        bad = order is BAD
        body = {"model": "video-model-x", "mode": "text_to_video",
                "prompt": f"a red fox in snow, take {i}" + (" [sim:output=truncated]" if bad else ""), **order}
        r = http.post("/v1/generations", json=body, headers={**auth, "Idempotency-Key": f"media-{i}-{uuid.uuid4().hex[:6]}"})
        assert r.status_code == 202, r.text
        orders[r.json()["task_id"]] = {**order, "bad": bad}

    deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
    views: dict[str, dict] = {}
    while time.monotonic() < deadline:
        views = {tid: http.get(f"/v1/generations/{tid}", headers=auth).json() for tid in orders}
        settled = all(v["state"] in ("SUCCEEDED", "FAILED", "CANCELLED", "MEDIA_INGEST_FAILED")
                      and v["charge"]["final_charge_amount"] is not None for v in views.values())
        if settled:
            break
        time.sleep(1.0)
    states = {tid: (v["state"], v.get("error")) for tid, v in views.items()}
    log = log_path.read_text()
    assert all(v["charge"]["final_charge_amount"] is not None for v in views.values()), f"{states}\n{log[-8000:]}"

    for tid, order in orders.items():
        v = views[tid]
        if order["bad"]:
            assert v["state"] == "MEDIA_INGEST_FAILED", states
            assert v["error"] == {"code": "MEDIA_PROCESSING_FAILED", "message": "the generated video could not be processed"}
            assert v["outputs"] == []
            assert v["charge"]["final_charge_amount"] == 0  # SUCCESS_ONLY: nothing for an undelivered video
            continue
        assert v["state"] == "SUCCEEDED", (states, log[-8000:])
        assert v["charge"]["final_charge_amount"] == v["charge"]["quoted_amount"] > 0
        assets = {o["asset_type"]: o["url"] for o in v["outputs"]}
        expected = {"proxy", "thumbnail"} | (set() if order["interactive"] else {"delivery"})
        assert set(assets) == expected, v["outputs"]
        for asset, url in assets.items():
            assert url.startswith(f"{base}/v1/media/"), url  # the platform's own URL, never the provider's
            got = httpx.get(url, timeout=30)
            assert got.status_code == 200, got.text
            if asset == "thumbnail":
                assert got.headers["content-type"].startswith("image/") and len(got.content) > 100
                continue
            p = probe(got.content)
            assert p["codec"] == "h264" and abs(p["duration"] - order["duration_seconds"]) <= 1.0, (asset, p)
            assert p["has_audio"] == order["with_audio"], (asset, p)
            want_w, want_h = DIMS[order["resolution"]]
            if asset == "delivery":
                assert (p["width"], p["height"]) == (want_w, want_h), p
            else:  # the proxy: 720p at most, the source's own size when smaller
                assert p["height"] == min(720, want_h), p
        # A tampered URL reads nothing.
        url = assets["proxy"]
        assert httpx.get(url[:-2] + ("AA" if not url.endswith("AA") else "BB"), timeout=30).status_code == 403
    wallet = http.get("/v1/wallet", headers=auth).json()
    assert wallet["reserved_amount"] == 0
    assert wallet["consumed_amount"] == sum(views[tid]["charge"]["quoted_amount"] for tid, o in orders.items() if not o["bad"])
