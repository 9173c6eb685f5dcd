"""`aivedio demo`, as `make run` runs it but short: a fresh database, the whole platform, three
simulated providers, six tenants made through the admin API, a workload over the HTTP API, and a
report whose verdicts all pass, written as one HTML file (rendered in headless Chromium when it is
there). And a broken invariant (an unbalanced ledger row) turns its verdict red and the exit status 1."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from tests.conftest import _test_redis_url, create_test_database, drop_test_database

SCRIPT = Path(sys.executable).with_name("aivedio")
AIVEDIO = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "aivedio_tools.cli"]
CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = Path("/tmp/demo_report.png")
SECTIONS = ("id='verdicts'", "id='shares'", "id='waits'", "id='lanes'", "id='costs'", "id='ledger'", "id='invoices'")
VERDICTS = {"ledger_balanced", "snapshots_equal_ledger", "no_capacity_exceeded", "no_duplicate_generation",
            "every_task_terminal", "nothing_left_reserved"}


def _env(url: str, tmp_path: Path, redis_prefix: str) -> dict:
    return {**os.environ, "AIVEDIO_DATABASE_URL": url, "AIVEDIO_REDIS_URL": _test_redis_url(),
            "AIVEDIO_REDIS_PREFIX": redis_prefix, "AIVEDIO_HOME": str(tmp_path)}


@pytest.mark.slow
def test_short_demo_passes_every_verdict_and_writes_the_report(tmp_path, redis_prefix):
    url = create_test_database("demo")
    report = tmp_path / "report.html"
    try:
        r = subprocess.run([*AIVEDIO, "demo", "--short", "--json", "--report", str(report)],
                           env=_env(url, tmp_path, redis_prefix), cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-4000:]
        doc = json.loads(r.stdout)
        assert {v["name"] for v in doc["verdicts"]} == VERDICTS
        assert all(v["ok"] for v in doc["verdicts"]) and doc["verdicts_passed"], doc["verdicts"]
        assert doc["admitted"] > 0 and sum(doc["states"].values()) == doc["admitted"]
        assert {t["tenant"] for t in doc["tenants"]} == {"enterprise", "paid-gold", "paid-silver", "free", "whale", "studio-4k"}
        assert set(doc["providers"]) == {"premium", "bulk", "flaky"}
        assert "AiVedio is running" in r.stderr and "VERDICTS" in r.stderr and "/dashboard" in r.stderr
        page = report.read_text()
        assert page.count("<svg") >= 3, "the plots are inline SVG"
        for section in SECTIONS:
            assert section in page, section
        _screenshot(report)
    finally:
        drop_test_database(url)


def _screenshot(report: Path) -> None:
    if os.environ.get("AIVEDIO_SKIP_BROWSER") == "1" or not Path(CHROMIUM).exists():
        return
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.goto(report.resolve().as_uri())
            assert page.locator("#verdicts").is_visible()
            assert page.locator("svg").count() >= 3
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()


def test_an_unbalanced_ledger_row_turns_its_verdict_red(tmp_path, redis_prefix):
    """A scratch database with one tenant; one ledger entry edited behind the append-only trigger."""
    from aivedio.admin.tenants import create_tenant
    from aivedio.config import PlatformConfig, Settings
    from aivedio.context import build_platform

    url = create_test_database("demo_broken")
    env = _env(url, tmp_path, redis_prefix)
    try:
        platform = build_platform(Settings(database_url=url, redis_url="none", home=tmp_path), PlatformConfig(), migrate=True)
        try:
            create_tenant(platform, name="ledger-victim", service_class="STANDARD", weight=1, credits=1000, trusted=True)
        finally:
            platform.close()
        verify = [*AIVEDIO, "demo", "--verify", "--json"]
        ok = subprocess.run(verify, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stdout + ok.stderr[-2000:]
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("alter table ledger_entry disable trigger ledger_entry_append_only")
            c.execute("""update ledger_entry set amount_delta = amount_delta + 1
                          where entry_id = (select entry_id from ledger_entry where bucket = 'AVAILABLE' limit 1)""")
            c.execute("alter table ledger_entry enable trigger ledger_entry_append_only")
        bad = subprocess.run(verify, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert bad.returncode == 1, bad.stdout + bad.stderr[-2000:]
        verdicts = {v["name"]: v for v in json.loads(bad.stdout)["verdicts"]}
        assert not verdicts["ledger_balanced"]["ok"] and verdicts["ledger_balanced"]["figure"].startswith("1 of ")
        assert not verdicts["snapshots_equal_ledger"]["ok"]
        assert verdicts["every_task_terminal"]["ok"] and verdicts["nothing_left_reserved"]["ok"]
    finally:
        drop_test_database(url)
