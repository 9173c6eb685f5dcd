"""The local media dispatcher (aivedio_tools.local.media_dispatch) with the real gpu-render worker as a subprocess,
real FFmpeg and a real clip served on the loopback as a built-in simulator would serve it:

- a claim runs the worker within its slots, and its stdout's last line is applied as the RESULT;
- the worker killed mid-run is retried (same output version) and the task ends with one output
  version: one file per asset type, no partial files, no duplicate task_output rows;
- bad media (a truncated file) ends the task MEDIA_INGEST_FAILED with its outputs removed."""
from __future__ import annotations

import http.server
import threading
import time
from pathlib import Path

import pytest

from aivedio.attempts import lifecycle
from aivedio_tools.local import media_dispatch as dispatch
from aivedio.media import pipeline
from aivedio.providers.adapter import parse_job
from aivedio_tools.provider_sim import make_mp4
from tests.integration.test_media_pipeline import (_own_media_jobs, claimed, media_job, media_platform, rows,  # noqa: F401
                                                   task, used)

pytestmark = pytest.mark.xdist_group("media")

BODY = {"model": "video-model-x", "mode": "text_to_video", "prompt": "a fox", "duration_seconds": 6, "resolution": "1080p",
        "with_audio": True}


@pytest.fixture
def clips():
    """A loopback HTTP server: clips[name] = bytes serves them at base + /name."""
    files: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = files.get(self.path.lstrip("/"))
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "video/mp4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            slow = files.pop("_slow_once", None) == self.path.lstrip("/").encode()
            for i in range(0, len(body), 4096 if slow else len(body) or 1):
                self.wfile.write(body[i:i + (4096 if slow else len(body))])
                if slow:
                    self.wfile.flush()
                    time.sleep(0.5)  # a slow first fetch: the worker is surely mid-run when it is killed

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    files["_base"] = f"http://127.0.0.1:{server.server_address[1]}".encode()
    yield files
    server.shutdown()


def succeed_with(p, ref, url: str) -> None:
    doc = {"id": f"job-{ref.task_id}", "status": "succeeded", "created_at": "2026-06-24T08:00:00Z",
           "finished_at": "2026-06-24T08:01:00Z", "usage": {"seconds": 6, "cost_amount": "0.30", "currency": "USD"},
           "charge_id": f"ch-{ref.task_id}", "output_url": url}
    now = p.clock.now()

    def tx(conn):
        conn.execute("""update task_attempt set state = 'RUNNING', submit_started_at = %s, provider_job_id = %s
                         where attempt_id = %s""", (now, doc["id"], ref.attempt_id))
        lifecycle.move(conn, lifecycle.load(conn, ref, lock=True), "RUNNING", now, started_at=now)
        return lifecycle.apply_job(conn, ref, parse_job(doc), source="test", now=now, media=p.config.media)

    assert p.db.transaction(tx).task_state == "PROVIDER_SUCCEEDED"


def wait(cond, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_worker_killed_mid_run_is_retried_and_the_task_ends_with_one_output_version(media_platform, clips):
    p = media_platform(retry_base_seconds=0.2, max_tries=3)
    clips["clip.mp4"] = make_mp4(6, "1080p", True)
    clips["_slow_once"] = b"clip.mp4"
    [ref] = claimed(p, body=BODY)
    succeed_with(p, ref, clips["_base"].decode() + "/clip.mp4")
    runner = dispatch.runner(p)
    try:
        assert runner.dispatch()["claimed"] == 1
        job = media_job(p, ref)
        assert (job["resource_class"], job["spec"]["allow_private_addresses"]) == ("gpu-render", True)
        wait(lambda: (media_job(p, ref)["worker_ref"] or "").startswith("pid:"), what="the worker to start")
        pid = int(media_job(p, ref)["worker_ref"].split(":")[1])
        import os
        import signal

        os.kill(pid, signal.SIGKILL)  # killed wherever it was: fetching, probing, transcoding
        wait(lambda: media_job(p, ref)["state"] == "PENDING", what="the retry")
        assert media_job(p, ref)["error_code"] == pipeline.WORKER_LOST and media_job(p, ref)["tries"] == 1
        assert used(p, "worker:gpu-render") == 0
        p.clock.advance(1)  # past the retry's backoff
        assert runner.dispatch()["claimed"] == 1
        wait(lambda: task(p, ref)["state"] == "SUCCEEDED", what="the retried worker to deliver")
        assert runner.wait_idle(30)
    finally:
        dispatch.stop_local(p)
    job = media_job(p, ref)
    assert (job["state"], job["tries"], job["output_version"]) == ("SUCCEEDED", 2, 1)
    outs = rows(p, "select output_version, asset_type, object_key, size_bytes from task_output where task_id = %s "
                   "order by asset_type", ref.task_id)
    assert [(o["output_version"], o["asset_type"]) for o in outs] == [(1, "delivery"), (1, "proxy"), (1, "thumbnail")]
    outdir = Path(job["spec"]["outputs"])
    assert sorted(f.name for f in outdir.iterdir()) == sorted(Path(o["object_key"]).name for o in outs)  # no partial files
    for o in outs:
        f = pipeline.media_root(p) / o["object_key"]
        assert f.stat().st_size == o["size_bytes"] > 0
    assert used(p, "worker:gpu-render") == 0


def test_a_truncated_source_ends_media_ingest_failed_and_leaves_no_outputs(media_platform, clips):
    p = media_platform()
    good = make_mp4(6, "1080p", True)
    clips["cut.mp4"] = good[: len(good) // 2]
    [ref] = claimed(p, body=BODY)
    succeed_with(p, ref, clips["_base"].decode() + "/cut.mp4")
    runner = dispatch.runner(p)
    try:
        assert runner.dispatch()["claimed"] == 1
        wait(lambda: task(p, ref)["state"] == "MEDIA_INGEST_FAILED", what="the ingest failure")
        assert runner.wait_idle(30)
    finally:
        dispatch.stop_local(p)
    t, job = task(p, ref), media_job(p, ref)
    assert t["error_code"] == "MEDIA_TRUNCATED" and (job["state"], job["tries"]) == ("FAILED", 1), (t["error_code"], job["result"])
    assert rows(p, "select * from task_output where task_id = %s", ref.task_id) == []
    assert not Path(job["spec"]["outputs"]).exists()
    assert used(p, "worker:gpu-render") == 0
