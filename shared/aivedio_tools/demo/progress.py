"""The demo's live progress: a Sampler thread reads, once a second, what the operator dashboard reads
(aivedio.admin.dashboard.snapshot: lanes, providers, SUBMIT_UNKNOWN), the demo tenants' queued and
running work, and the simulators' own concurrency; it keeps the series for the report. A view shows
the latest sample: a rich live table on a terminal, plain lines (one when something changed, at most
every few seconds) otherwise. rich is imported only here, and only for the live view."""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from typing import Any

from aivedio.admin import dashboard
from aivedio.tasks import TERMINAL

SAMPLE_SECONDS = 1.0

# Per demo tenant and lane: queued and running tasks and units, the oldest queued wait.
TENANT_WORK = """
select tenant_id::text as tenant_id, queue_class as lane,
       count(*) filter (where state = 'QUEUED')::int as queued_tasks,
       coalesce(sum(fairness_units) filter (where state = 'QUEUED'), 0)::int as queued_units,
       count(*) filter (where state not in ('QUEUED', 'SUCCEEDED', 'FAILED', 'CANCELLED', 'MEDIA_INGEST_FAILED'))::int as running_tasks,
       coalesce(sum(fairness_units) filter (where state not in ('QUEUED', 'SUCCEEDED', 'FAILED', 'CANCELLED',
                                                                 'MEDIA_INGEST_FAILED')), 0)::int as running_units,
       count(*) filter (where state in ('SUCCEEDED', 'FAILED', 'CANCELLED', 'MEDIA_INGEST_FAILED'))::int as done,
       coalesce(extract(epoch from now() - min(enqueue_at) filter (where state = 'QUEUED')), 0)::float as oldest_wait
  from generation_task where tenant_id = any(%s::uuid[])
 group by 1, 2
"""

# Attempts that went through SUBMIT_UNKNOWN (steps._mark_unknown leaves error_class UNKNOWN; an absence
# proven leaves ABSENT_CONFIRMED), and what became of them.
UNKNOWN_ATTEMPTS = """
select a.attempt_id::text as attempt_id, a.state, a.error_class from task_attempt a
 where a.tenant_id = any(%s::uuid[]) and (a.error_class = 'UNKNOWN' or a.state in ('SUBMIT_UNKNOWN', 'ABSENT_CONFIRMED'))
"""
STATES = "select state, count(*)::int as n from generation_task where tenant_id = any(%s::uuid[]) group by 1"
RESOLUTION = {"SUBMIT_UNKNOWN": "open", "ABSENT_CONFIRMED": "absent: requeued", "MANUAL_REVIEW": "manual review"}


def resolution(state: str) -> str:
    return RESOLUTION.get(state, "found at the provider: adopted")


class Sampler:
    def __init__(self, platform, sims: dict, workload, tenants: list, started: float):
        self.platform, self.sims, self.wl, self.tenants, self.started = platform, sims, workload, tenants, started
        self.names = {t.tenant_id: t.spec.key for t in tenants}
        self.samples: list[dict[str, Any]] = []
        self.unknown: dict[str, str] = {}  # attempt -> latest state seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-sampler", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001 - a missed sample is not a failed demo
                sys.stderr.write(f"demo: sample failed: {e!r}\n")

    def sample(self) -> dict[str, Any]:
        p = self.platform
        snap = dashboard.snapshot(p, fresh=True)
        ids = list(self.names)
        with p.db.connection() as conn:
            work = conn.execute(TENANT_WORK, (ids,)).fetchall()
            unknown = conn.execute(UNKNOWN_ATTEMPTS, (ids,)).fetchall()
            states = {r["state"]: r["n"] for r in conn.execute(STATES, (ids,)).fetchall()}
        sims = {}
        for name, s in self.sims.items():
            sim = s.simulator  # its truth copies every job: read the cheap parts, under its lock as truth does
            with sim._lock:  # noqa: SLF001
                sim._advance(time.monotonic())  # noqa: SLF001
                accounts = {a: {"current": sim._active[a], "peak": sim._peak[a]} for a in sim._active}  # noqa: SLF001
                counters = dict(sim._counters)  # noqa: SLF001
                webhooks = dict(sim._webhook_counters)  # noqa: SLF001
            sims[name] = {"accounts": accounts, "submits": counters, "webhooks": webhooks}
        with self._lock:
            for r in unknown:
                self.unknown[r["attempt_id"]] = r["state"]
            doc = {"t": round(time.monotonic() - self.started, 2),
                   "lanes": [{k: lane[k] for k in ("lane", "capacity_units", "used_units", "utilisation_percent",
                                                   "borrowable_units", "lent_units", "queued_tasks", "queued_units",
                                                   "running_tasks", "running_units", "borrowed_units", "oldest_wait_seconds")}
                             for lane in snap["lanes"]],
                   "providers": [{k: pr[k] for k in ("provider", "running", "capacity", "utilisation_percent", "breaker",
                                                     "submit_unknown_open", "success_rate")} for pr in snap["providers"]],
                   "tenants": [{**dict(r), "tenant": self.names.get(r["tenant_id"], r["tenant_id"])} for r in work],
                   "sims": sims, "states": states,
                   "submit_unknown": dict(Counter(resolution(s) for s in self.unknown.values())),
                   "rejections": dict(self.wl.rejections), "sent": self.wl.sent, "admitted": len(self.wl.submitted),
                   "cancels": dict(self.wl.cancels), "duplicates": self.wl.duplicates}
            self.samples.append(doc)
        return doc

    @property
    def latest(self) -> dict[str, Any] | None:
        with self._lock:
            return self.samples[-1] if self.samples else None

    def all_terminal(self) -> bool:
        ids = list(self.wl.submitted)
        if not ids:
            return False
        with self.platform.db.connection() as conn:
            n = conn.execute("select count(*) as n from generation_task where task_id = any(%s::uuid[]) and state <> all(%s)",
                             (ids, sorted(TERMINAL))).fetchone()["n"]
        return n == 0


# --- views ----------------------------------------------------------------------------------------------------

def view(use_rich: bool | None, sampler: Sampler, *, enabled: bool = True):
    if not enabled:
        return _Quiet()
    if use_rich is None:
        use_rich = sys.stdout.isatty()
    if use_rich:
        try:
            return _Rich(sampler)
        except ImportError:  # the demo extra is not installed: plain lines
            pass
    return _Plain(sampler)


class _Quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self) -> None:
        pass


class _Plain(_Quiet):
    EVERY_SECONDS = 3.0

    def __init__(self, sampler: Sampler):
        self.sampler, self._last, self._at = sampler, "", 0.0

    def update(self) -> None:
        s = self.sampler.latest
        if s is None or time.monotonic() - self._at < self.EVERY_SECONDS:
            return
        lanes = " ".join(f"{x['lane'][:4]}:q{x['queued_units']}/r{x['used_units']}/{x['capacity_units']}"
                         for x in s["lanes"] if x["queued_units"] or x["used_units"])
        provs = " ".join(f"{x['provider']}:{x['running']}/{x['capacity']}" for x in s["providers"])
        done = sum(r["done"] for r in s["tenants"])
        rej = ",".join(f"{k}={v}" for k, v in sorted(s["rejections"].items())) or "none"
        unk = ",".join(f"{k}={v}" for k, v in sorted(s["submit_unknown"].items())) or "none"
        states = " ".join(f"{k}={v}" for k, v in sorted(s["states"].items()) if k not in TERMINAL)
        line = (f"demo t={s['t']:.0f}s sent={s['sent']} admitted={s['admitted']} done={done} | {states or 'all terminal'} | "
                f"lanes {lanes or 'idle'} | "
                f"providers {provs} | rejected {rej} | SUBMIT_UNKNOWN {unk}")
        if line.split("|", 1)[1] != self._last.split("|", 1)[-1]:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            self._last, self._at = line, time.monotonic()


class _Rich(_Quiet):
    def __init__(self, sampler: Sampler):
        from rich.console import Console  # lazy: rich (the demo extra) only for a terminal
        from rich.live import Live  # lazy: as above

        self.sampler = sampler
        self.console = Console()
        self.live = Live(console=self.console, refresh_per_second=2, transient=False)

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc):
        return self.live.__exit__(*exc)

    def update(self) -> None:
        s = self.sampler.latest
        if s is not None:
            self.live.update(self._render(s))

    def _render(self, s: dict):
        from rich.console import Group  # lazy: as above
        from rich.table import Table  # lazy: as above

        scale = self.sampler.platform.clock.time_scale
        states = "  ".join(f"{k} {v}" for k, v in sorted(s["states"].items()))
        head = (f"[bold]AiVedio demo[/] t={s['t']:.0f}s real = {s['t'] * scale / 60:.1f} platform min   {states}\n"
                f"sent {s['sent']}  admitted {s['admitted']}  duplicates {s['duplicates']}  "
                f"cancels {sum(s['cancels'].values())}")
        lanes = Table("lane", "queued tasks", "queued units", "running units", "used/capacity", "util %", "borrowed",
                      "lent", "oldest wait (s)", title="lanes", title_justify="left")
        for x in s["lanes"]:
            lanes.add_row(x["lane"], str(x["queued_tasks"]), str(x["queued_units"]), str(x["running_units"]),
                          f"{x['used_units']}/{x['capacity_units']}", f"{x['utilisation_percent']:.0f}",
                          str(x["borrowed_units"]), f"{x['lent_units']}/{x['borrowable_units']}",
                          f"{x['oldest_wait_seconds']:.0f}")
        tenants = Table("tenant", "lane", "queued", "queued units", "running", "running units", "done",
                        "oldest wait (platform s)", title="tenants", title_justify="left")
        for r in sorted(s["tenants"], key=lambda r: (r["tenant"], r["lane"])):
            tenants.add_row(r["tenant"], r["lane"], str(r["queued_tasks"]), str(r["queued_units"]), str(r["running_tasks"]),
                            str(r["running_units"]), str(r["done"]), f"{r['oldest_wait'] * scale:.0f}")
        provs = Table("provider", "running/capacity", "util %", "sim peak/limit", "429s", "accept-then-timeout",
                      "webhooks dropped", "breaker", title="providers", title_justify="left")
        for x in s["providers"]:
            sim = s["sims"].get(x["provider"], {})
            peak = max((a["peak"] for a in sim.get("accounts", {}).values()), default=0)
            provs.add_row(x["provider"], f"{x['running']}/{x['capacity']}", f"{x['utilisation_percent']:.0f}", f"{peak}",
                          str(sim.get("submits", {}).get("rate_limited", 0)),
                          str(sim.get("submits", {}).get("accept_then_timeout", 0)),
                          str(sim.get("webhooks", {}).get("dropped", 0)), x["breaker"])
        rej = ", ".join(f"{k} {v}" for k, v in sorted(s["rejections"].items())) or "none"
        unk = ", ".join(f"{k} {v}" for k, v in sorted(s["submit_unknown"].items())) or "none yet"
        return Group(head, lanes, tenants, provs, f"rejections by code: {rej}", f"SUBMIT_UNKNOWN and how each resolved: {unk}")
