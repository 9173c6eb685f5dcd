"""The local media dispatcher (issue 17, "Locally the same worker runs as a subprocess"): under
`aivedio serve` the media-dispatch schedule (aivedio.events_routing; functions/media_submit without
AWS Batch) calls run_local(), which claims the PENDING media jobs whose worker slots fit
(pipeline.claim_next: the slots are the bound, so a run never starts more workers than the pools
hold) and starts the gpu-render worker for each as a subprocess:

    python containers/gpu-render/worker.py '<SPEC json>'

with its outputs in the platform's media directory ([media] local_dir, else <AIVEDIO_HOME>/media).
A thread per worker waits for it (within the SPEC's timeout, then kills it), parses the last line
of its stdout as its RESULT and applies it (pipeline.complete, fenced). A worker that printed no
RESULT is a transient error of its claim (MEDIA_WORKER_LOST, or MEDIA_TIMEOUT), retried like any
other. A task that ends MEDIA_INGEST_FAILED leaves no partial outputs: its output directory is
removed. When the runtime stops, its workers are killed and their jobs left RUNNING: the
media-jobs reconciler finds them past their lease (the pid is gone) and retries them."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from aivedio.config import child_environment, environment_value
from aivedio.media import pipeline
from aivedio.observability import logger

RUNNER = "media_runner"  # platform.extras key
KILL_GRACE_SECONDS = 30.0  # real seconds past the SPEC's timeout before the dispatcher kills a worker
STDERR_TAIL = 2000
WORKER_SCRIPT = Path(__file__).resolve().parents[3] / "containers" / "gpu-render" / "worker.py"


def worker_command(platform) -> list[str]:
    """[media] worker_command, else this Python running the repository's worker."""
    return list(platform.config.media.worker_command) or [sys.executable, str(WORKER_SCRIPT)]


def _ffmpeg_environment() -> dict[str, str]:
    """The worker finds FFmpeg through AIVEDIO_FFMPEG or PATH; without either, the imageio-ffmpeg
    wheel's binary (the dev extra) when it is installed. The worker's own settings of this
    process's environment (AIVEDIO_FFMPEG, AIVEDIO_MEDIA_WORKDIR) are passed on."""
    own = {k: v for k in ("AIVEDIO_FFMPEG", "AIVEDIO_MEDIA_WORKDIR") if (v := environment_value(k))}
    if own.get("AIVEDIO_FFMPEG") or shutil.which("ffmpeg"):
        return own
    try:
        import imageio_ffmpeg
    except ImportError:
        return own
    return {**own, "AIVEDIO_FFMPEG": imageio_ffmpeg.get_ffmpeg_exe()}


def last_json_line(stdout: str) -> dict | None:
    """The RESULT: the last non-empty line of the worker's stdout, when it is a JSON object."""
    for line in reversed((stdout or "").splitlines()):
        if line.strip():
            try:
                doc = json.loads(line)
            except ValueError:
                return None
            return doc if isinstance(doc, dict) else None
    return None


class LocalMediaRunner:
    """This process's media worker subprocesses, one thread each."""

    def __init__(self, platform):
        self.platform = platform
        self._lock = threading.Lock()
        self._running: dict[tuple[str, int], subprocess.Popen | None] = {}
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._running)

    def dispatch(self) -> dict[str, int]:
        """One run: claim what fits and start a worker for each claim."""
        if self._stopping.is_set():
            return {"claimed": 0}
        p = self.platform
        now = p.clock.now()
        jobs = p.db.transaction(lambda conn: pipeline.claim_next(p, conn, now=now, limit=p.config.media.dispatch_batch))
        for job in jobs:
            key = (str(job["task_id"]), int(job["output_version"]))
            with self._lock:
                self._running[key] = None
            t = threading.Thread(target=self._run, args=(job,), name=f"media-{key[0][:8]}-v{key[1]}", daemon=True)
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()
        return {"claimed": len(jobs), "running": self.running}

    def _run(self, job: dict) -> None:
        key = (str(job["task_id"]), int(job["output_version"]))
        try:
            result = self._work(job)
            if result is not None and not self._stopping.is_set():
                self._complete(job, result)
        except Exception:  # a worker's thread never takes the runtime down; the reconciler retries its job
            logger.exception("local media worker failed", extra={"task_id": key[0], "output_version": key[1]})
        finally:
            with self._lock:
                self._running.pop(key, None)

    def _work(self, job: dict) -> dict | None:
        """Run the worker; its RESULT, or the error RESULT of a worker that gave none. None when
        the runtime is stopping (the job is left to the reconciler)."""
        p, spec = self.platform, job["spec"]
        outputs = Path(spec["outputs"])
        outputs.mkdir(parents=True, exist_ok=True)
        cmd = worker_command(p) + [json.dumps(spec, separators=(",", ":"))]
        t0 = time.monotonic()
        try:
            # FFmpeg's threads: the CPU units the job holds (a GPU job's encoder is the GPU's).
            env = child_environment(**_ffmpeg_environment(), AIVEDIO_RESOURCE_CLASS=job["resource_class"],
                                    AIVEDIO_FFMPEG_THREADS=str(job["units"] if job["resource_class"] == "cpu-proxy" else 1))
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=env)
        except OSError as e:
            return pipeline.error_result(job, pipeline.WORKER_LOST, f"the worker could not start: {e}")
        with self._lock:
            self._running[(str(job["task_id"]), int(job["output_version"]))] = proc
        p.db.transaction(lambda conn: pipeline.mark_started(
            conn, task_id=job["task_id"], output_version=job["output_version"], fencing_token=job["fencing_token"],
            worker_ref=f"pid:{proc.pid}", now=p.clock.now()))
        timeout = float(spec["limits"]["timeout_seconds"]) + KILL_GRACE_SECONDS
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            return pipeline.error_result(job, "MEDIA_TIMEOUT", f"the worker ran past {timeout:.0f}s and was killed")
        if self._stopping.is_set():
            return None
        result = last_json_line(out)
        took = round(time.monotonic() - t0, 3)
        if result is None:
            logger.warning("media worker gave no result", extra={"task_id": str(job["task_id"]), "exit_status": proc.returncode,
                                                                "stderr": (err or "")[-STDERR_TAIL:], "seconds": took})
            return pipeline.error_result(job, pipeline.WORKER_LOST,
                                         f"the worker exited {proc.returncode} without a result: {(err or '')[-300:]}")
        logger.info("media worker done", extra={"task_id": str(job["task_id"]), "output_version": job["output_version"],
                                                "status": result.get("status"), "code": result.get("code"),
                                                "exit_status": proc.returncode, "seconds": took})
        return result

    def _complete(self, job: dict, result: dict) -> str:
        p = self.platform
        try:
            outcome = p.db.transaction(lambda conn: pipeline.complete(conn, result, now=p.clock.now(), platform=p))
        except pipeline.MediaResultInvalid as e:
            outcome = p.db.transaction(lambda conn: pipeline.complete(
                conn, pipeline.error_result(job, pipeline.RESULT_INVALID, str(e)), now=p.clock.now(), platform=p))
        if outcome == pipeline.FAILED:
            pipeline.remove_outputs(job["spec"]["outputs"], p)
        p.wake("scheduler-tick")  # a terminal task released its capacity
        return outcome

    def wait_idle(self, timeout: float) -> bool:
        """Tests: wait until no worker runs. True when idle."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.running == 0:
                return True
            time.sleep(0.05)
        return self.running == 0

    def stop(self, timeout: float = 10.0) -> None:
        """Kill the workers; their jobs stay RUNNING for the reconciler (their pids are gone)."""
        self._stopping.set()
        with self._lock:
            procs = [proc for proc in self._running.values() if proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for t in self._threads:
            t.join(timeout)


def runner(platform) -> LocalMediaRunner:
    r = platform.extras.get(RUNNER)
    if r is None:
        r = platform.extras.setdefault(RUNNER, LocalMediaRunner(platform))
    return r


def run_local(platform) -> dict[str, Any]:
    """The media-dispatch schedule's body without AWS Batch (functions/media_submit)."""
    if not platform.config.media.enabled:
        return {"claimed": 0, "disabled": True}
    return runner(platform).dispatch()


def stop_local(platform) -> None:
    """The local runtime's stop: kill this process's workers."""
    r = platform.extras.pop(RUNNER, None)
    if r is not None:
        r.stop()
