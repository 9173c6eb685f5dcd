"""`aivedio serve` with no database or Redis URL starts the embedded PostgreSQL and Redis, serves
/healthz, and stops cleanly on Ctrl-C."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

SCRIPT = Path(sys.executable).with_name("aivedio")
AIVEDIO = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "aivedio_tools.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_serve_on_embedded_servers_then_ctrl_c(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIVEDIO_")}
    env["AIVEDIO_HOME"] = str(tmp_path / "home")
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*AIVEDIO, "serve", "--port", str(port)], env=env, cwd=tmp_path,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/healthz"
        deadline = time.monotonic() + 90
        doc = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"serve exited early ({proc.returncode}):\n{log_path.read_text()}"
            try:
                r = httpx.get(url, timeout=2)
                if r.status_code == 200:
                    doc = r.json()
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        assert doc is not None, f"/healthz never answered 200:\n{log_path.read_text()}"
        assert (doc["status"], doc["database"], doc["redis"]) == ("ok", "ok", "ok")
        assert (tmp_path / "home" / "pgdata").is_dir() and (tmp_path / "home" / "redis").is_dir()

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log_path.read_text()
        out = log_path.read_text()
        assert f"http://127.0.0.1:{port}/swagger" in out
        with pytest.raises(httpx.TransportError):
            httpx.get(url, timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
