"""Latency from an event to the work it starts, on the real local runtime (`aivedio bench --only
scheduler`, under `scheduler.latency`): the API behind its HTTP server, the outbox-relay and
scheduler-tick loops, dispatch, the attempt workflows and the built-in provider simulator, all of
`aivedio serve`, on a scratch database of the same PostgreSQL server, with a Redis prefix of its own.

Two providers are simulated, each with one account and jobs that take JOB_SECONDS:

- admission to submit: load clients (separate processes, at a fixed total rate) post generations
  for a model of the provider whose account never binds; each sample runs from the client's receipt
  of the 202 to the simulator's record of the job's creation (its `created_at`, matched by the
  task id it is given as client_request_id);
- freed slot to next submit: then the clients post, at the same rate, generations for the model
  of the provider whose account has `bound_slots` slots, which run fewer per second than arrive, so
  work queues and the account is the binding limit. Each job's completion at the provider (the
  simulator's `finished_at`) is paired, first freed first filled, with the next job created on that
  account, and counts while more tasks had been admitted (202s received) than jobs created, by more
  than the account's slots, so at least one task was queued when the slot was freed. The same
  pairing from the terminal release PostgreSQL records (the provider slot's reservation
  `released_at`) is reported beside it: it leaves out the webhook's way back.

Both are wall-clock intervals on one machine, in milliseconds. Logs (structured and standard) are
quietened to WARNING while the runtime runs. The scratch database and Redis keys are dropped afterwards."""
from __future__ import annotations

import bisect
import http.client
import json
import logging
import multiprocessing as mp
import time
import uuid
from collections import deque
from contextlib import contextmanager
from datetime import datetime
from urllib.parse import urlsplit

from aivedio.admin.tenants import create_tenant
from aivedio.config import (
    LaneConfig,
    Limits,
    PlatformConfig,
    Pools,
    ProviderAccount,
    ProviderConfig,
    Settings,
    SimulatorBehaviour,
)
from aivedio.context import build_platform
from aivedio.observability import logger
from aivedio_tools.bench.scratch import (
    CAP,
    OPEN_LIMITS,
    SCHEDULER_DATABASE_PREFIX,
    SCHEDULER_REDIS_PREFIX,
    percentile,
    scratch_database,
)
from aivedio_tools.bench.workers import get_or_fail, join_or_kill, raise_first_error
from aivedio_tools.local.runtime import LocalRuntime

OPEN_PROVIDER, BOUND_PROVIDER = "sim-open", "sim-bound"
OPEN_MODEL, BOUND_MODEL = "video-model-x", "video-model-y"
ACCOUNT = "account-01"
JOB_SECONDS = (0.3, 0.6)  # how long a simulated job runs (uniform), real seconds at time_scale 1
BODY = {"mode": "text_to_video", "prompt": "bench", "duration_seconds": 5, "resolution": "720p"}
RUNNING_LIMITS = dict(max_running_tasks=CAP, max_running_units=CAP, max_user_running_tasks=CAP, max_user_running_units=CAP)
DRAIN_SECONDS = 10.0  # after the load stops, how long admitted tasks may take to reach the provider


def latency_config(*, bound_slots: int) -> PlatformConfig:
    """Two simulated providers that never misbehave; nothing but the bound provider's account limits."""
    behaviour = SimulatorBehaviour(queue_seconds_min=0, queue_seconds_max=0, latency_seconds_min=JOB_SECONDS[0],
                                   latency_seconds_max=JOB_SECONDS[1], failure_rate=0.0)
    return PlatformConfig(
        providers=[ProviderConfig(name=OPEN_PROVIDER, models=[OPEN_MODEL], simulator=behaviour,
                                  accounts=[ProviderAccount(account_id=ACCOUNT, max_concurrency=CAP)]),
                   ProviderConfig(name=BOUND_PROVIDER, models=[BOUND_MODEL], simulator=behaviour,
                                  accounts=[ProviderAccount(account_id=ACCOUNT, max_concurrency=bound_slots)])],
        lanes={lane: LaneConfig(capacity_units=CAP, max_queue_units=CAP) for lane in
               ("PAID_SHARED", "STANDARD", "BEST_EFFORT", "EXPENSIVE", "RECOVERY")},
        limits=Limits(model_global_running_cap=CAP, platform_cost_per_minute=CAP),
        pools=Pools(worker_cpu_units=CAP, worker_gpu_units=CAP),
    )


# -- load clients (separate processes, so they do not share the runtime's interpreter) ----------------

def _client(base_url: str, keys: list[str], model: str, seconds: float, rate: float, seed: int, out: mp.Queue) -> None:
    """Posts generations for `seconds` at `rate` per second; reports each accepted task id with the
    wall-clock time its 202 arrived."""
    u = urlsplit(base_url)
    assert u.hostname in ("127.0.0.1", "localhost", "::1"), "bench traffic stays on loopback"
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    body = json.dumps({**BODY, "model": model}).encode()
    accepted: list[tuple[str, float]] = []
    statuses: dict[str, int] = {}
    try:
        end, next_at, i = time.monotonic() + seconds, time.monotonic(), 0
        while time.monotonic() < end:
            if (wait := next_at - time.monotonic()) > 0:
                time.sleep(wait)
            next_at += 1.0 / rate
            headers = {"Authorization": f"Bearer {keys[(seed + i) % len(keys)]}", "Content-Type": "application/json",
                       "Idempotency-Key": f"lat-{seed}-{i}-{uuid.uuid4().hex[:8]}"}
            conn.request("POST", "/v1/generations", body=body, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            received = time.time()
            statuses[str(resp.status)] = statuses.get(str(resp.status), 0) + 1
            if resp.status == 202:
                accepted.append((json.loads(raw)["task_id"], received))
            i += 1
        out.put({"accepted": accepted, "statuses": statuses})
    except BaseException as e:  # the parent must not wait forever
        out.put({"error": repr(e)})
        raise
    finally:
        conn.close()


def _get(q: mp.Queue, procs: list, timeout: float):
    return get_or_fail(q, procs, timeout, "latency load clients")


def _post_all(base_url: str, keys: list[str], model: str, *, clients: int, seconds: float,
              rate: float) -> tuple[list[tuple[str, float]], dict[str, int]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_client, args=(base_url, keys, model, seconds, rate / clients, 7919 * n, out))
             for n in range(clients)]
    for p in procs:
        p.start()
    try:
        results = [_get(out, procs, seconds + 120) for _ in procs]
    finally:
        join_or_kill(procs)
    raise_first_error(results, "latency load client")
    statuses: dict[str, int] = {}
    for r in results:
        for k, v in r["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    return [a for r in results for a in r["accepted"]], statuses


# -- reading the results -------------------------------------------------------------------------------

def _ts(iso: str | None) -> float | None:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() if iso else None


def summary(ms: list[float]) -> dict:
    """p50 and p99 (nearest rank) in milliseconds, with the sample count."""
    if not ms:
        return {"samples": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {"samples": len(ms), "p50_ms": round(percentile(ms, 0.50), 1), "p99_ms": round(percentile(ms, 0.99), 1),
            "max_ms": round(max(ms), 1)}


def pair_freed_slots(freed: list[float], created: list[float], queued=lambda t: True) -> list[float]:
    """Each creation on a full account fills the slot freed earliest and not yet filled: the
    intervals in milliseconds, for the slots freed while `queued(freed_at)` (work was waiting).
    Creations with no freed slot before them (the first fill) and freed slots never filled (the
    window ended) give no sample."""
    out: list[float] = []
    waiting: deque[float] = deque()
    freed, i = sorted(freed), 0
    for c in sorted(created):
        while i < len(freed) and freed[i] <= c:
            waiting.append(freed[i])
            i += 1
        if waiting:
            f = waiting.popleft()
            if queued(f):
                out.append((c - f) * 1000)
    return out


def queue_was_deep(admitted: list[float], created: list[float], margin: int):
    """A predicate on a time t: more tasks admitted (202 received, which is after their commit)
    than jobs created by t, by more than `margin` (the tasks claimed but not yet created)."""
    admitted, created = sorted(admitted), sorted(created)

    def deep(t: float) -> bool:
        return bisect.bisect_right(admitted, t) - bisect.bisect_right(created, t) > margin

    return deep


def _sim_jobs(rt, provider: str) -> list[dict]:
    return rt.platform.extras["provider_simulators"][provider].truth["jobs"]


def _wait_submitted(rt, provider: str, task_ids: set[str], timeout: float) -> dict[str, float]:
    """task id -> the simulator's creation time of its job, once every task has one or `timeout` passed."""
    end = time.monotonic() + timeout
    while True:
        created = {j["client_request_id"]: _ts(j["created_at"]) for j in _sim_jobs(rt, provider)
                   if j["client_request_id"] in task_ids}
        if len(created) == len(task_ids) or time.monotonic() > end:
            return created
        time.sleep(0.1)


STAGES = {  # where a task is on its way to the provider, as PostgreSQL records it
    "queued_event_relayed": "(select published_at from outbox_event where aggregate_id = t.task_id and event_type = 'TaskQueued' "
                            "order by created_at limit 1)",
    "claimed": "a.created_at",
    "dispatch_event_relayed": "(select published_at from outbox_event where aggregate_id = t.task_id "
                              "and event_type = 'TaskDispatchRequested' order by created_at limit 1)",
    "submit_started": "a.submit_started_at",
}


def _stages(conn, accepted: list[tuple[str, float]], created: dict[str, float]) -> dict:
    """The p50 of each stage's time after the 202 (ms), for the tasks that reached the provider."""
    at = dict(accepted)
    cols = ", ".join(f"{sql} as {name}" for name, sql in STAGES.items())
    rows = conn.execute(
        f"""select t.task_id::text as task_id, {cols}
              from generation_task t join task_attempt a on a.task_id = t.task_id and a.attempt_no = 1
             where t.task_id = any(%s::uuid[])""", ([t for t in created],)).fetchall()
    out = {}
    for name in STAGES:
        ms = [(r[name].timestamp() - at[r["task_id"]]) * 1000 for r in rows if r[name] is not None]
        out[name] = round(percentile(ms, 0.5), 1) if ms else None
    out["provider_created"] = round(percentile([(created[t] - at[t]) * 1000 for t in created], 0.5), 1) if created else None
    return out


def _releases(conn, provider: str) -> list[float]:
    rows = conn.execute(
        """select r.released_at from resource_reservation r join task_attempt a using (attempt_id)
            where a.provider = %s and r.state = 'RELEASED' and r.resource_key like 'provider-account:%%'""",
        (provider,)).fetchall()
    return [r["released_at"].timestamp() for r in rows]


@contextmanager
def _quiet():
    """Structured logs and the standard loggers (httpx logs every request at INFO) at WARNING."""
    root, level = logging.getLogger(), logger.log_level
    root_level = root.level
    logger.setLevel("WARNING")
    root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)
        root.setLevel(root_level)


# -- the benchmark ----------------------------------------------------------------------------------------

def bench_latency(admin_url: str, redis_url: str | None, *, seconds: float = 10.0, rate: float = 20.0, clients: int = 4,
                  bound_slots: int = 4, tenants: int = 4) -> dict:
    """Half of `seconds` (at most 20 in all) for each measurement, one after the other, on one
    runtime, each under `rate` admissions per second from `clients` processes. The bound account
    runs bound_slots / mean(JOB_SECONDS) jobs a second: keep it below `rate`, so work queues."""
    seconds = min(seconds, 20.0)
    window = seconds / 2
    config = latency_config(bound_slots=bound_slots)
    prefix = f"{SCHEDULER_REDIS_PREFIX}{uuid.uuid4().hex[:6]}"
    with scratch_database(admin_url, prefix=SCHEDULER_DATABASE_PREFIX) as db_url:
        settings = Settings(database_url=db_url, redis_url=redis_url or "none", redis_prefix=prefix)
        p = build_platform(settings, config, pool_size=16)
        try:
            keys = [create_tenant(p, name=f"lat-{i}", service_class="PAID_SHARED", weight=1, credits=10**12,
                                  policy_overrides={**OPEN_LIMITS, **RUNNING_LIMITS},
                                  trusted=True).api_key for i in range(tenants)]  # open limits on purpose
            with _quiet(), LocalRuntime(p, port=0) as rt:
                intervals = {loop.name: p.clock.real_seconds(loop.interval_platform_seconds) for loop in rt.loops}
                # 1. admission to submit, at a fixed rate the open account never binds.
                accepted, statuses_a = _post_all(rt.base_url, keys, OPEN_MODEL, clients=clients, seconds=window, rate=rate)
                created = _wait_submitted(rt, OPEN_PROVIDER, {t for t, _ in accepted}, DRAIN_SECONDS)
                admission_ms = [(created[t] - at) * 1000 for t, at in accepted if t in created]
                # 2. freed slot to next submit: more arrive than the bound account runs, so work queues.
                queued, statuses_b = _post_all(rt.base_url, keys, BOUND_MODEL, clients=clients, seconds=window, rate=rate)
                jobs = _sim_jobs(rt, BOUND_PROVIDER)
                with p.db.connection() as conn:
                    stages = _stages(conn, accepted, created)
                    released = _releases(conn, BOUND_PROVIDER)
                    still_queued = conn.execute(
                        "select count(*) as n from generation_task where state = 'QUEUED' and model_code = %s",
                        (BOUND_MODEL,)).fetchone()["n"]
                peak = rt.platform.extras["provider_simulators"][BOUND_PROVIDER].truth["accounts"][ACCOUNT]["peak"]
        finally:
            if p.cache is not None:
                p.cache.delete_prefix()
            p.close()
    creations = [_ts(j["created_at"]) for j in jobs]
    finished = [_ts(j["finished_at"]) for j in jobs if j["finished_at"]]
    deep = queue_was_deep([at for _, at in queued], creations, bound_slots)
    return {
        "definition": ("admission_to_submit: the 202 of POST /v1/generations (at the client) to the simulator's creation "
                       "of the job, while the provider account has room; freed_slot_to_next_submit: a job's completion at "
                       "the provider (from_release: its terminal release in PostgreSQL) to the next job created on that "
                       "account, paired first freed first filled, while work is queued and the account is full"),
        "runtime": "aivedio serve's LocalRuntime in this process: API, loops, dispatch, workflows, provider simulators",
        "loop_intervals_seconds": intervals, "job_seconds": list(JOB_SECONDS),
        "admission_to_submit": {**summary(admission_ms), "rate_per_second": rate, "seconds": window,
                                "accepted": len(accepted), "never_submitted": len(accepted) - len(admission_ms),
                                "statuses": statuses_a, "stages_p50_ms": stages},
        "freed_slot_to_next_submit": {**summary(pair_freed_slots(finished, creations, deep)), "bound_slots": bound_slots,
                                      "rate_per_second": rate, "seconds": window, "accepted": len(queued),
                                      "jobs_created": len(creations), "queued_at_end": still_queued, "account_peak": peak,
                                      "statuses": statuses_b, "from_release": summary(pair_freed_slots(released, creations, deep))},
    }
