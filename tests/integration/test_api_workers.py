"""`aivedio serve --api-workers 2`: two processes serve the API on one port, a task admitted
through a worker is relayed, claimed and run to SUCCEEDED by the main process, a killed worker is
replaced, and Ctrl-C leaves no process behind and the port free."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psycopg
import pytest

SCRIPT = Path(sys.executable).with_name("aivedio")
AIVEDIO = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "aivedio_tools.cli"]

CONFIG = """
time_scale = 60.0
[timers]
scheduler_tick_seconds = 1200.0
# 20 s real between relay polls and ticks: a worker's events are relayed (and the task claimed)
# promptly only through its wake-ups, forwarded to the main process.
outbox_relay_seconds = 1200.0
[[providers]]
name = "provider-a"
[providers.simulator]
latency_seconds_min = 5
latency_seconds_max = 10
failure_rate = 0.0
"""
BODY = {"model": "video-model-x", "mode": "text_to_video", "duration_seconds": 5, "resolution": "720p",
        "prompt": "a paper boat in rain"}


def free_port() -> int:
    # Port 0 cannot be shared by several processes: pick one, as a user would.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(log_path: Path) -> list[int]:
    """The API workers' pids, in the order they reported listening."""
    return [int(m) for m in re.findall(r"API worker \d+ listening \(pid (\d+)\)", log_path.read_text())]


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes only once reaped; ps shows its state.
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


@pytest.mark.slow
def test_two_api_workers_serve_one_port_and_ctrl_c_stops_all(tmp_path, db_url, redis_url, redis_prefix):
    port = free_port()
    (tmp_path / "aivedio.toml").write_text(CONFIG)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AIVEDIO_")},
           "AIVEDIO_DATABASE_URL": db_url, "AIVEDIO_REDIS_URL": redis_url, "AIVEDIO_REDIS_PREFIX": redis_prefix,
           "AIVEDIO_HOME": str(tmp_path / "home")}
    tenant = json.loads(subprocess.run([*AIVEDIO, "admin", "tenant", "create", "--name", "workers", "--service-class",
                                        "PAID_SHARED", "--weight", "2", "--credits", "100000", "--json"],
                                       env=env, capture_output=True, text=True, check=True, timeout=60).stdout)
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*AIVEDIO, "serve", "--config", str(tmp_path / "aivedio.toml"), "--port", str(port),
                                 "--api-workers", "2"], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    workers: list[int] = []
    everything: list[int] = []
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while "Ctrl-C stops it." not in log_path.read_text():
            assert proc.poll() is None, f"serve exited early ({proc.returncode}):\n{log_path.read_text()}"
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        assert "2 API worker processes" in log_path.read_text()
        workers = listening(log_path)
        assert len(workers) == 2 and set(workers) <= set(children(proc.pid))

        # Concurrent requests, each on its own connection: the kernel spreads them over both workers.
        def health(_: int) -> str:
            with httpx.Client(base_url=url, timeout=10) as c:
                r = c.get("/healthz")
                assert r.status_code == 200 and r.json()["database"] == "ok"
                assert "outbox-relay" in r.json()["loops"]  # the main process's loops, seen from a worker
                return r.headers["X-Aivedio-Worker"]

        with ThreadPoolExecutor(8) as pool:
            pids = {int(p) for p in pool.map(health, range(40))}
        assert len(pids) == 2 and proc.pid not in pids and pids <= set(workers), (pids, workers)
        # The admin API shares the port in every worker (aivedio_tools.local.handlers.api_server).
        with httpx.Client(base_url=url, timeout=10) as c:
            r = c.get("/admin/v1/openapi.json")
            assert r.status_code == 200 and int(r.headers["X-Aivedio-Worker"]) in pids, r.text

        auth = {"Authorization": f"Bearer {tenant['api_key']}"}
        with httpx.Client(base_url=url, timeout=10) as c:
            r = c.post("/v1/generations", json=BODY, headers={**auth, "Idempotency-Key": "workers-1"})
            assert r.status_code == 202, r.text
            assert int(r.headers["X-Aivedio-Worker"]) in pids
            task_id = r.json()["task_id"]
            deadline, state = time.monotonic() + 25, None
            while time.monotonic() < deadline:
                state = c.get(f"/v1/generations/{task_id}", headers=auth).json()["state"]
                if state in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    break
                time.sleep(0.3)
        assert state == "SUCCEEDED", log_path.read_text()[-3000:]
        with psycopg.connect(db_url) as conn:
            lag = conn.execute("select extract(epoch from published_at - created_at) from outbox_event "
                               "where aggregate_id = %s order by created_at limit 1", (task_id,)).fetchone()[0]
        assert lag < 3, f"the worker's first event waited {lag}s for the relay: its wake-up was lost"

        # The claim was counted in the main process; whichever worker answers /metrics shows it.
        def claims_seen(_: int) -> tuple[str, float]:
            with httpx.Client(base_url=url, timeout=10) as c:
                r = c.get("/metrics")
                assert r.status_code == 200, r.text
                found = re.search(r'^aivedio_claims_total\{lane="PAID_SHARED"\} (\S+)$', r.text, re.M)
                return r.headers["X-Aivedio-Worker"], float(found.group(1)) if found else 0.0

        deadline, answers = time.monotonic() + 10, {}
        while time.monotonic() < deadline:
            with ThreadPoolExecutor(8) as pool:
                answers = dict(pool.map(claims_seen, range(24)))
            if len(answers) == 2 and all(v >= 1 for v in answers.values()):
                break
            time.sleep(0.5)
        assert len(answers) == 2 and all(v >= 1 for v in answers.values()), answers

        # A worker that dies is logged and replaced; the port keeps answering.
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while len(listening(log_path)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        assert f"(pid {workers[0]}) died with exit code -9" in log_path.read_text()
        replacement = listening(log_path)[-1]
        assert replacement in children(proc.pid)
        workers = [*workers, replacement]
        with ThreadPoolExecutor(8) as pool:
            assert replacement in {int(p) for p in pool.map(health, range(40))}

        everything = children(proc.pid)  # the workers and multiprocessing's own helpers
        assert set(workers[1:]) <= set(everything)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log_path.read_text()
        assert not [p for p in workers if alive(p)], log_path.read_text()
        deadline = time.monotonic() + 5  # a helper may take a moment after its parent is gone
        while [p for p in everything if alive(p)]:
            assert time.monotonic() < deadline, ([p for p in everything if alive(p)], log_path.read_text()[-2000:])
            time.sleep(0.1)
        with socket.socket() as s:  # the port is free again: nothing listens, and it binds
            assert s.connect_ex(("127.0.0.1", port)) != 0
        with socket.socket() as s:  # as a server binds (TIME_WAIT from the requests is no listener)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in workers + everything:
            if alive(p):
                os.kill(p, signal.SIGKILL)
