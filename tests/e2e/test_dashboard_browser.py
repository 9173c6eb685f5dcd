"""The live operations dashboard in a real browser (issue 16 part 6, "Done means"): `aivedio serve`
runs the whole platform with its provider simulator, tenants and an operator are made through the
CLI as an operator would, and headless Chromium (Debian's package, driven by Playwright through
executable_path) opens /dashboard while a workload runs through the tenant HTTP API.

Checked: without a token the page is a sign-in form and shows no data (and the JSON answers 401);
signing in through the form (the token goes into an HttpOnly cookie the page's script cannot read)
shows lanes, tenants and providers; the figures update in place while work is admitted, claimed and
finished, without a reload (a marker set on `window` survives every update). A screenshot is written
to the test's tmp dir and copied to /tmp/dashboard.png.

Chromium missing is a failure that says how to install it, unless AIVEDIO_SKIP_BROWSER=1."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import _test_redis_url, create_test_database, drop_test_database, stop_if_running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = Path(sys.executable).with_name("aivedio")
AIVEDIO = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "aivedio_tools.cli"]
CHROMIUM = os.environ.get("AIVEDIO_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOT_COPY = Path("/tmp/dashboard.png")
PROVIDER = "provider-a"
TASKS_PER_TENANT = 4  # under the default policy's 5 submits per user-minute
# Jobs run 30-40 platform seconds, 3-4 real seconds at time scale 10; two slots on the account, so
# work queues, runs and finishes while the page watches.
CONFIG = f"""
time_scale = 10.0

[[providers]]
name = "{PROVIDER}"

[[providers.accounts]]
account_id = "account-01"
max_concurrency = 2

[providers.simulator]
queue_seconds_min = 0.0
queue_seconds_max = 0.0
latency_seconds_min = 30.0
latency_seconds_max = 40.0
failure_rate = 0.0
"""
BODY = {"model": "video-model-x", "mode": "text_to_video", "duration_seconds": 5, "resolution": "480p"}
START_TIMEOUT = 90.0
UPDATE_TIMEOUT = 45.0


@pytest.fixture
def sync_playwright():
    """Playwright's sync API, or a failure saying what is missing (a skip with AIVEDIO_SKIP_BROWSER=1),
    before anything is started."""
    skip = os.environ.get("AIVEDIO_SKIP_BROWSER") == "1"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if skip:
            pytest.skip("playwright not installed (AIVEDIO_SKIP_BROWSER=1)")
        pytest.fail("the playwright package is missing: `make venv` installs the dev extra (pyproject.toml), "
                    "or set AIVEDIO_SKIP_BROWSER=1 to skip the browser test")
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        if skip:
            pytest.skip(f"no chromium at {CHROMIUM} (AIVEDIO_SKIP_BROWSER=1)")
        pytest.fail(f"no chromium at {CHROMIUM}: `make test` installs Debian's package (apt-get install -y chromium), "
                    "or set AIVEDIO_SKIP_BROWSER=1 to skip the browser test")
    return sync_playwright


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(env: dict, *args: str) -> dict:
    done = subprocess.run([*AIVEDIO, *args, "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"aivedio {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-2000:]}"
    return json.loads(done.stdout)


@pytest.fixture
def served(tmp_path, redis_prefix):
    """`aivedio serve` on a fresh database: (base URL, the environment the CLI uses)."""
    url = create_test_database("dashboard_e2e")
    config = tmp_path / "platform.toml"
    config.write_text(CONFIG)
    port = _free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AIVEDIO_")},
           "AIVEDIO_DATABASE_URL": url, "AIVEDIO_REDIS_URL": _test_redis_url(), "AIVEDIO_REDIS_PREFIX": redis_prefix,
           "AIVEDIO_HOME": str(tmp_path / "home"), "AIVEDIO_CONFIG": str(config)}
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*AIVEDIO, "serve", "--port", str(port), "--api-workers", "1"], env=env, cwd=tmp_path,
                                stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert proc.poll() is None, f"serve exited early ({proc.returncode}):\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"/healthz never answered 200:\n{log_path.read_text()[-4000:]}"
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        yield base, env, log_path
    finally:
        stop_if_running(proc)
        drop_test_database(url)


def _lane_figures(page, lane: str) -> str:
    return page.locator(f'#lanes tbody tr[data-lane="{lane}"]').inner_text()


def test_the_dashboard_signs_in_and_updates_live_while_work_runs(sync_playwright, served, tmp_path):
    base, env, log_path = served
    run = uuid.uuid4().hex[:6]
    tenants = {name: _cli(env, "admin", "tenant", "create", "--name", f"dash-{name}-{run}", "--service-class", "PAID_SHARED",
                          "--weight", str(weight), "--credits", "100000")
               for name, weight in (("heavy", 3), ("light", 1))}
    operator = _cli(env, "admin", "operator", "create", "--name", f"dash-{run}", "--role", "viewer")
    assert operator["token"].startswith("avop_")
    shot = tmp_path / "dashboard.png"

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            # Without a token: the sign-in form, no figures, and the data route refuses.
            anonymous = browser.new_context()
            page = anonymous.new_page()
            resp = page.goto(f"{base}/dashboard")
            assert resp is not None and resp.status == 200
            assert page.locator("form#signin input[name=token]").is_visible()
            assert page.locator("#lanes").count() == 0 and page.locator("#providers").count() == 0
            assert "PAID_SHARED" not in page.content()
            assert page.request.get(f"{base}/admin/v1/dashboard").status == 401
            # A wrong token: still the form, no cookie.
            page.fill("input[name=token]", "avop_not-a-token")
            page.click("#signin-submit")
            page.wait_for_selector("#signin-error:not(:empty)")
            assert page.locator("#lanes").count() == 0 and not anonymous.cookies()
            anonymous.close()

            ctx = browser.new_context(viewport={"width": 1400, "height": 1300})
            page = ctx.new_page()
            console_errors: list[str] = []
            page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: console_errors.append(str(e)))
            page.goto(f"{base}/dashboard")
            page.fill("input[name=token]", operator["token"])
            page.click("#signin-submit")
            for selector in ('#lanes tbody tr[data-lane="PAID_SHARED"]', f'#providers tbody tr[data-provider="{PROVIDER}"]'):
                try:
                    page.wait_for_selector(selector, timeout=15_000)
                except Exception:
                    pytest.fail(f"{selector} never appeared on {page.url}; console: {console_errors}\n"
                                f"{page.locator('body').inner_text()[:2000]}\nserve log:\n{log_path.read_text()[-3000:]}")
            (session,) = [c for c in ctx.cookies() if c["name"] == "aivedio_admin_session"]
            assert session["httpOnly"] and session["sameSite"] == "Strict"
            assert session["value"].startswith("avds_") and operator["token"] not in session["value"]  # a session id, not the token
            assert page.evaluate("document.cookie") == ""  # the session is out of the script's reach
            assert page.locator("#operator").inner_text() == f"dash-{run} (viewer)"
            assert page.locator("#status").inner_text() == "live"
            page.evaluate("window.__notReloaded = true")
            first_lane = _lane_figures(page, "PAID_SHARED")
            first_snapshot = page.locator("#generated-at").get_attribute("datetime")

            # The workload, over the tenant HTTP API, while the page polls.
            with httpx.Client(base_url=base, timeout=30) as http:
                for i in range(TASKS_PER_TENANT):
                    for name, t in tenants.items():
                        r = http.post("/v1/generations", json={**BODY, "prompt": f"a fox, take {i}"},
                                      headers={"Authorization": f"Bearer {t['api_key']}", "Idempotency-Key": f"{run}-{name}-{i}"})
                        assert r.status_code == 202, r.text

            # Lanes move (queued, running, then drained), tenants appear, a snapshot replaces the last.
            seen_lane, seen_running = {first_lane}, False
            deadline = time.monotonic() + UPDATE_TIMEOUT
            names = [f"dash-{n}-{run}" for n in tenants]
            while time.monotonic() < deadline:
                lane = _lane_figures(page, "PAID_SHARED")
                seen_lane.add(lane)
                running = page.locator('#lanes tbody tr[data-lane="PAID_SHARED"] td.running-tasks').inner_text()
                seen_running = seen_running or running not in ("0", "-")
                tenants_shown = all(page.locator(f'#tenants tbody tr[data-tenant="{n}"]').count() for n in names)
                if seen_running and len(seen_lane) >= 3 and tenants_shown:
                    break
                time.sleep(0.25)
            page.screenshot(path=str(shot), full_page=True)
            shutil.copyfile(shot, SCREENSHOT_COPY)
            assert seen_running, f"the PAID_SHARED lane never showed running work: {seen_lane}\n{log_path.read_text()[-3000:]}"
            assert len(seen_lane) >= 3, f"the lane's figures did not keep updating: {seen_lane}"
            for n in names:
                row = page.locator(f'#tenants tbody tr[data-tenant="{n}"]')
                assert row.count() == 1, f"tenant {n} not shown"
            assert page.locator("#generated-at").get_attribute("datetime") != first_snapshot
            assert page.locator(f'#providers tbody tr[data-provider="{PROVIDER}"] td.provider-running').inner_text().endswith("%)")
            assert page.evaluate("window.__notReloaded === true"), "the page reloaded instead of updating in place"
            page.wait_for_selector("#status.good", timeout=10_000)  # the latest poll succeeded
            # The audit trail shows the CLI's writes (the tenants and the operator made above).
            assert page.locator("#audit tbody tr").count() >= 3
            assert not console_errors, console_errors

            # Signing out drops the cookie and the page goes back to the form.
            page.click("#logout button")
            page.wait_for_selector("form#signin")
            assert not [c for c in ctx.cookies() if c["name"] == "aivedio_admin_session"]
            # ... and ends the session: its cookie, replayed, is refused.
            replayed = httpx.get(f"{base}/admin/v1/dashboard", headers={"Cookie": f"aivedio_admin_session={session['value']}"},
                                 timeout=30)
            assert replayed.status_code == 401, replayed.text
            ctx.close()
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
