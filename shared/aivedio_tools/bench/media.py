"""Media throughput: proxies per minute per CPU unit through the gpu-render worker (operation
"ingest", run as the local runner and AWS Batch run it: `python worker.py <SPEC>`, fetching the clip
over HTTP from the loopback, checking it, making the proxy and the thumbnail, storing them), against
plain `ffmpeg` running the worker's own proxy command line on the same clip, in the same run, as
alternating rounds (aivedio_tools.bench.rounds). The ratio says what the worker's fetch, checks, thumbnail
and publishing cost on top of the encode itself.

A proxy job holds `cpu_units` CPU units (1 for a 720p proxy, as the media dispatcher reserves it);
each FFmpeg gets that many threads (AIVEDIO_FFMPEG_THREADS for the worker, -threads for the
baseline), and `workers` jobs run at once, so throughput is divided by workers x cpu_units.

    bench_media(seconds=10)            # each phase runs for 10 s (jobs started while time is left)
    bench_media(clips=5, rounds=1)     # each phase runs exactly 5 jobs
"""
from __future__ import annotations

import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from aivedio.media.probe import measure
from aivedio_tools.bench.rounds import DEFAULT_ROUNDS, alternate, spread
from aivedio_tools.provider_sim import make_mp4

CLIP_HEIGHTS = {"480p": (854, 480), "720p": (1280, 720), "1080p": (1920, 1080), "4k": (3840, 2160)}


def worker_path() -> Path:
    """containers/gpu-render/worker.py of this checkout, or AIVEDIO_GPU_RENDER_WORKER."""
    if os.environ.get("AIVEDIO_GPU_RENDER_WORKER"):
        return Path(os.environ["AIVEDIO_GPU_RENDER_WORKER"])
    return Path(__file__).resolve().parents[3] / "containers" / "gpu-render" / "worker.py"


def ffmpeg_path() -> str:
    """AIVEDIO_FFMPEG, else ffmpeg on PATH, else imageio-ffmpeg's binary (the dev extra)."""
    found = os.environ.get("AIVEDIO_FFMPEG") or shutil.which("ffmpeg")
    if found:
        return found
    import imageio_ffmpeg  # lazy: the dev extra's FFmpeg, only without one on PATH

    return imageio_ffmpeg.get_ffmpeg_exe()


def _load_worker(path: Path):
    spec = importlib.util.spec_from_file_location("aivedio_bench_gpu_render_worker", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def make_clip(path: Path, *, ffmpeg: str, resolution: str, duration_seconds: float, source: str) -> None:
    """"pattern": FFmpeg's testsrc2 at 24 fps with a tone (moving, so the encode does real work);
    "simulator": the provider simulator's own output (a flat frame at 2 fps, AAC silence)."""
    if source == "simulator":
        path.write_bytes(make_mp4(duration_seconds, resolution, True))
        return
    if source != "pattern":
        raise ValueError(f"source must be 'pattern' or 'simulator', not {source!r}")
    w, h = CLIP_HEIGHTS[resolution]
    subprocess.run([ffmpeg, "-hide_banner", "-loglevel", "error", "-nostdin", "-y",
                    "-f", "lavfi", "-i", f"testsrc2=size={w}x{h}:rate=24:duration={duration_seconds}",
                    "-f", "lavfi", "-i", f"sine=frequency=440:duration={duration_seconds}",
                    "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p", "-c:a", "aac", "-shortest",
                    str(path)], check=True, timeout=600)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _phase(run_one, *, seconds: float | None, clips: int | None, workers: int, cpu_units: int) -> dict:
    """Run jobs `workers` at a time: `clips` of them, or as many as start within `seconds`."""
    lock, started, results = threading.Lock(), [0], []
    t0, cpu0 = time.monotonic(), _children_cpu()

    def loop() -> None:
        while True:
            with lock:
                if (clips is not None and started[0] >= clips) or (
                        clips is None and time.monotonic() - t0 >= (seconds or 0)):
                    return
                started[0] += 1
            ok = run_one()
            with lock:
                results.append(ok)

    with ThreadPoolExecutor(workers) as pool:
        for f in [pool.submit(loop) for _ in range(workers)]:
            f.result()
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    done = sum(1 for ok in results if ok)
    per_minute = 60.0 * done / wall if wall > 0 else None
    return {"proxies": done, "failures": len(results) - done, "wall_seconds": round(wall, 3),
            "cpu_seconds": round(cpu, 3), "cpu_seconds_per_proxy": round(cpu / done, 3) if done else None,
            "proxies_per_minute": round(per_minute, 2) if per_minute else None,
            "proxies_per_minute_per_cpu_unit": round(per_minute / (workers * cpu_units), 3) if per_minute else None}


def bench_media(seconds: float | None = 10.0, clips: int | None = None, *, rounds: int = DEFAULT_ROUNDS,
                workers: int = 1, cpu_units: int = 1, resolution: str = "1080p", duration_seconds: float = 4,
                source: str = "pattern") -> dict:
    """Proxies per minute per CPU unit through the worker and through plain ffmpeg (the worker's
    proxy command line, run directly on a local copy of the same clip); `ratio_vs_ffmpeg` is the
    median of the rounds' ratios (worker / ffmpeg; 1.0 would mean the worker adds nothing)."""
    if clips is None and not seconds:
        raise ValueError("give seconds or clips")
    if resolution not in CLIP_HEIGHTS:
        raise ValueError(f"resolution must be one of {sorted(CLIP_HEIGHTS)}")
    ffmpeg, wpath = ffmpeg_path(), worker_path()
    worker = _load_worker(wpath)
    base = Path(tempfile.mkdtemp(prefix="aivedio-bench-media-"))
    server = None
    try:
        clip = base / "clip.mp4"
        make_clip(clip, ffmpeg=ffmpeg, resolution=resolution, duration_seconds=duration_seconds, source=source)

        facts = measure(str(clip))
        server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(base)))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/clip.mp4"
        encoder = worker.pick_encoder(ffmpeg)
        env = {**os.environ, "AIVEDIO_FFMPEG": ffmpeg, "AIVEDIO_FFMPEG_THREADS": str(cpu_units),
               "AIVEDIO_MEDIA_WORKDIR": str(base / "work"), "AIVEDIO_RESOURCE_CLASS": "cpu-proxy"}
        last_result: dict = {}

        def through_worker() -> bool:
            task = f"bench-{uuid.uuid4().hex[:12]}"
            out = base / "outputs" / task
            spec = {"operation": "ingest", "task_id": task, "tenant_id": "bench", "project": None, "attempt_id": task,
                    "output_version": 1, "fencing_token": 1, "source_url": url,
                    "order": {"duration_seconds": duration_seconds, "resolution": resolution, "with_audio": True,
                              "final": False},
                    "outputs": f"{out}/", "allow_private_addresses": True, "retention_class": "bench", "tags": {},
                    "limits": {"max_bytes": 4 << 30, "timeout_seconds": 600.0, "disk_quota_bytes": 16 << 30,
                               "duration_tolerance_seconds": 1.0, "resolution_tolerance_ratio": 0.1}}
            done = subprocess.run([sys.executable, str(wpath), json.dumps(spec)], env=env, capture_output=True,
                                  text=True, timeout=900)
            shutil.rmtree(out, ignore_errors=True)
            try:
                result = json.loads(done.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                return False
            last_result.update(result)
            return done.returncode == 0 and result.get("status") == "ok"

        def plain_ffmpeg() -> bool:
            dst = base / f"plain-{uuid.uuid4().hex[:12]}.mp4"
            cmd = worker.proxy_command(clip, dst, ffmpeg=ffmpeg, encoder=encoder, width=facts.width, height=facts.height,
                                       threads=cpu_units)  # the worker's own command line
            done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=900)
            ok = done.returncode == 0 and dst.exists() and dst.stat().st_size > 0
            dst.unlink(missing_ok=True)
            return ok

        phase = partial(_phase, seconds=seconds, clips=clips, workers=workers, cpu_units=cpu_units)
        got = alternate(lambda i: phase(through_worker), lambda i: phase(plain_ffmpeg), rounds=rounds,
                        figure=lambda r: r.get("proxies_per_minute_per_cpu_unit"),
                        baseline_figure=lambda r: r.get("proxies_per_minute_per_cpu_unit"))
        last = got["rounds"][-1]
        proxy = next((o for o in last_result.get("outputs", []) if o.get("asset_type") == "proxy"), None)
        return {
            "clip": {"source": source, "resolution": resolution, "width": facts.width, "height": facts.height,
                     "duration_seconds": facts.duration_seconds, "fps": facts.fps, "bytes": clip.stat().st_size},
            "proxy": proxy and {k: proxy[k] for k in ("width", "height", "codec", "bytes")},
            "encoder": encoder, "workers": workers, "cpu_units_per_proxy": cpu_units,
            **last["bench"],
            "baseline_ffmpeg": last["baseline"],
            "ratio_vs_ffmpeg": got["ratio"]["median"], "ratio_spread": got["ratio"], "rounds": rounds,
            "proxies_per_minute_per_cpu_unit_rounds": spread(
                [r["bench"].get("proxies_per_minute_per_cpu_unit") for r in got["rounds"]]),
            "ffmpeg_proxies_per_minute_per_cpu_unit_rounds": spread(
                [r["baseline"].get("proxies_per_minute_per_cpu_unit") for r in got["rounds"]]),
            "rounds_note": "the other figures are the last round's; the worker also fetches, checks, makes a "
                           "thumbnail and stores, the baseline runs only the proxy command",
        }
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        shutil.rmtree(base, ignore_errors=True)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass
