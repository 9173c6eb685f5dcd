"""The media pipeline's core (aivedio.media.pipeline, issue 17) on the real PostgreSQL, with tasks
admitted and claimed by the real admission and scheduler and the provider's success applied by the
real lifecycle.apply_job; the worker's RESULT documents are made here (the worker itself is
exercised by the worker tests and the e2e test):

- a provider success queues a media job and no terminal event; a second report changes nothing;
- a claim reserves the job's worker slots (resource_reservation rows, pool counters) and moves the
  task to MEDIA_PROCESSING with a new fencing token; the pools never exceed their capacity and a
  flood of 4K work does not take the cpu-proxy slots;
- completion is fenced: a stale result is refused, a duplicate is a no-op, a retry keeps the output
  version, so the task ends with one set of outputs;
- MEDIA_INGEST_FAILED is terminal, charges nothing under SUCCESS_ONLY and records the provider's
  cost as the platform's;
- the tenant sees only the platform's URLs, and the signed local URL serves the bytes (a tampered or
  expired one is 403);
- the media-jobs reconciler retries a lost job, with one output version in the end."""
from __future__ import annotations

import json
import subprocess
from collections import Counter
import sys
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from uuid import UUID

import httpx
import pytest

from aivedio import tasks
from aivedio.admission.cancel import TaskTerminal, cancel
from aivedio.attempts import lifecycle
from aivedio.billing import policies
from aivedio.spend.costs import QUANTUM, cost_report
from aivedio.billing.settlement import settle
from aivedio.bootstrap import apply_config
from aivedio.config import ManualClock, MediaConfig, PlatformConfig, ProviderAccount, ProviderConfig
from aivedio.media import pipeline, storage_cost, urls
from aivedio.providers.adapter import parse_job
from aivedio.reconcile import media_jobs, room
from aivedio.scheduling.scheduler import Scheduler
from tests.admission_support import PRICE, new_tenant, serve  # noqa: F401 - serve is a fixture
from tests.scheduler_support import BODY_1U, OPEN, UNCAPPED, submit

pytestmark = pytest.mark.xdist_group("media")

BODY_4K = {**BODY_1U, "resolution": "4k"}


@pytest.fixture
def media_platform(make_platform, tmp_path):
    """media_platform(**media) -> a platform on a ManualClock whose media directory is tmp_path."""
    def make(maintenance: dict | None = None, **media):
        cfg = PlatformConfig(providers=[ProviderConfig(name="provider-a",
                                                       accounts=[ProviderAccount(account_id="account-01", max_concurrency=500)])],
                             media=MediaConfig(local_dir=tmp_path / "media", **media), maintenance=maintenance or {})
        p = make_platform(cfg, clock=ManualClock(datetime.now(timezone.utc)))
        with p.db.connection() as conn:
            apply_config(conn, p.config, p.clock)
        room.run(p, "redis-index")  # the rings' index built: the scheduler is not conservative (EXPENSIVE runs)
        return p

    return make


@pytest.fixture(autouse=True)
def _own_media_jobs(db_url):
    """Tests share the module's database: each starts with no media job in flight and empty media pools."""
    import psycopg

    with psycopg.connect(db_url, autocommit=True) as c:
        c.execute("update media_job set state = 'FAILED', lease_until = null where state in ('PENDING', 'RUNNING')")
        c.execute("""update resource_reservation set state = 'RELEASED', released_at = now()
                      where state = 'ACTIVE' and resource_key like 'worker:%%-%%'""")
        c.execute("update resource_pool_shard set used_units = 0 where resource_key like 'worker:%%-%%'")
    yield


def claimed(p, n: int = 1, body: dict = BODY_1U, tenant=None) -> list[lifecycle.AttemptRef]:
    """n tasks admitted and claimed by the scheduler (attempts DISPATCHING, provider slots reserved)."""
    t = tenant or new_tenant(p, credits=1_000_000, **{**OPEN, **UNCAPPED})
    task_ids = submit(p, t.tenant_id, t.user_id, body=body, n=n)
    Scheduler(p).tick(10.0)
    with p.db.connection() as conn:
        rows = conn.execute("""select tenant_id, task_id, attempt_id, fencing_token from task_attempt
                                where task_id = any(%s) order by task_id""", (task_ids,)).fetchall()
    assert len(rows) == n
    return [lifecycle.AttemptRef(r["tenant_id"], r["task_id"], r["attempt_id"], r["fencing_token"]) for r in rows]


def job_doc(ref: lifecycle.AttemptRef, status: str = "succeeded") -> dict:
    doc = {"id": f"job-{ref.task_id}", "status": status, "created_at": "2026-06-24T08:00:00Z",
           "finished_at": "2026-06-24T08:01:00Z", "usage": {"seconds": 5, "cost_amount": "0.25", "currency": "USD"},
           "charge_id": f"ch-{ref.task_id}"}
    if status == "succeeded":
        doc["output_url"] = f"https://cdn.provider.example/{ref.task_id}.mp4"
    return doc


def report(p, ref: lifecycle.AttemptRef, status: str = "succeeded", *, first: bool = True) -> lifecycle.Applied:
    """The provider's report of the job, applied by lifecycle.apply_job with the platform's media config
    (the first time after the job ran: attempt and task RUNNING)."""
    doc = job_doc(ref, status)
    now = p.clock.now()

    def tx(conn):
        if first:
            conn.execute("""update task_attempt set state = 'RUNNING', submit_started_at = %s, submit_finished_at = %s,
                                   provider_job_id = %s where attempt_id = %s""", (now, now, doc["id"], ref.attempt_id))
            lifecycle.move(conn, lifecycle.load(conn, ref, lock=True), "RUNNING", now, started_at=now)
        return lifecycle.apply_job(conn, ref, parse_job(doc), source="test", now=now, media=p.config.media)

    return p.db.transaction(tx)


def one(p, sql: str, *args):
    with p.db.connection() as conn:
        return conn.execute(sql, args).fetchone()


def rows(p, sql: str, *args) -> list[dict]:
    with p.db.connection() as conn:
        return conn.execute(sql, args).fetchall()


def task(p, ref) -> dict:
    return one(p, "select * from generation_task where task_id = %s", ref.task_id)


def media_job(p, ref) -> dict:
    return one(p, "select * from media_job where task_id = %s", ref.task_id)


def terminal_events(p, ref) -> list[dict]:
    return rows(p, """select event_type, payload from outbox_event where aggregate_id = %s
                       and event_type in ('TaskSucceeded', 'TaskFailed', 'TaskCancelled', 'TaskMediaIngestFailed')""", ref.task_id)


def used(p, key: str) -> int:
    return int(one(p, "select coalesce(sum(used_units), 0)::bigint as u from resource_pool_shard where resource_key = %s", key)["u"])


def capacity(p, key: str) -> int:
    return int(one(p, "select coalesce(sum(capacity_units), 0)::bigint as c from resource_pool_shard where resource_key = %s",
                   key)["c"])


def active_media_reservations(p, key: str) -> int:
    return int(one(p, """select coalesce(sum(reserved_units), 0)::bigint as u from resource_reservation
                          where resource_key = %s and state = 'ACTIVE'""", key)["u"])


def claim(p, limit: int = 50) -> list[dict]:
    now = p.clock.now()
    return p.db.transaction(lambda conn: pipeline.claim_next(p, conn, now=now, limit=limit))


def complete(p, result: dict) -> str:
    now = p.clock.now()
    return p.db.transaction(lambda conn: pipeline.complete(conn, result, now=now, platform=p))


def ok_result(p, job: dict, *, write: bool = False, transcode_seconds: float = 4.0) -> dict:
    """The RESULT of a worker that did the job; `write` puts the files where a local worker would."""
    spec = job["spec"]
    outs = []
    for asset, name, ct in (("proxy", "proxy.mp4", "video/mp4"), ("thumbnail", "thumbnail.jpg", "image/jpeg"),
                            ("delivery", "delivery.mp4", "video/mp4")):
        body = f"{asset} of {spec['task_id']} v{spec['output_version']}".encode() * 10
        if write:
            Path(spec["outputs"]).mkdir(parents=True, exist_ok=True)
            (Path(spec["outputs"]) / name).write_bytes(body)
        outs.append({"asset_type": asset, "key": str(Path(spec["outputs"]) / name), "bytes": len(body), "content_type": ct,
                     "width": 1280, "height": 720, "codec": "h264" if ct == "video/mp4" else None,
                     "duration_seconds": 5.0 if ct == "video/mp4" else None})
    return {"task_id": spec["task_id"], "output_version": spec["output_version"], "fencing_token": spec["fencing_token"],
            "status": "ok", "code": None, "message": None,
            "probe": {"container": "mp4", "video_codec": "h264", "duration_seconds": 5.0, "width": 1280, "height": 720,
                      "fps": 2.0, "has_audio": False, "bytes": 12345},
            "outputs": outs, "transcode_seconds": transcode_seconds, "bytes_stored": sum(o["bytes"] for o in outs)}


def failed_result(job: dict, status: str, code: str, *, transcode_seconds: float = 0.0) -> dict:
    spec = job["spec"]
    return {"task_id": spec["task_id"], "output_version": spec["output_version"], "fencing_token": spec["fencing_token"],
            "status": status, "code": code, "message": f"{code.lower()} (test)", "probe": None, "outputs": [],
            "transcode_seconds": transcode_seconds, "bytes_stored": 0}


def settle_terminal(p, ref):
    [ev] = rows(p, """select event_id, event_type, payload from outbox_event where aggregate_id = %s
                       and event_type in ('TaskSucceeded', 'TaskFailed', 'TaskCancelled', 'TaskMediaIngestFailed')""", ref.task_id)
    with p.db.connection() as conn:
        return settle(conn, ev["payload"], p.clock.now(), event_type=ev["event_type"], event_id=ev["event_id"])


# --- 1. the provider's success -----------------------------------------------------------------------

def test_a_provider_success_queues_a_media_job_and_no_terminal_event(media_platform):
    p = media_platform()
    [ref] = claimed(p)
    assert report(p, ref) == lifecycle.Applied("TERMINAL", "PROVIDER_SUCCEEDED")
    t, a, job = task(p, ref), one(p, "select * from task_attempt where attempt_id = %s", ref.attempt_id), media_job(p, ref)
    assert t["state"] == "PROVIDER_SUCCEEDED" and t["finished_at"] is None
    # The attempt is finished as the provider's: final, billable, its cost on it, its slots released.
    assert (a["state"], a["final_reason"], a["billable_state"]) == ("SUCCEEDED", "PROVIDER_SUCCEEDED", "BILLABLE")
    assert a["actual_cost_amount"] == Decimal("0.25") and a["lease_until"] is None
    assert one(p, "select count(*) as n from resource_reservation where attempt_id = %s and state = 'ACTIVE'",
               ref.attempt_id)["n"] == 0
    assert (job["state"], job["output_version"], job["tries"], job["resource_class"], job["slot_units"]) == (
        "PENDING", 1, 0, "cpu-proxy", 1)
    assert job["source_url"] == f"https://cdn.provider.example/{ref.task_id}.mp4"
    assert job["provider_report"]["charge_id"] == f"ch-{ref.task_id}" and job["provider_report"]["provider_charged"]
    assert terminal_events(p, ref) == []
    assert rows(p, "select * from task_output where task_id = %s", ref.task_id) == []  # never the provider's URL
    # The same success reported again (a webhook after the poll), or a reordered "running": nothing changes.
    assert report(p, ref, first=False).task_state == "PROVIDER_SUCCEEDED"
    assert report(p, ref, "running", first=False) == lifecycle.Applied("UNCHANGED", "PROVIDER_SUCCEEDED")
    assert task(p, ref)["version"] == t["version"]
    assert one(p, "select count(*) as n from media_job where task_id = %s", ref.task_id)["n"] == 1


def test_with_the_pipeline_off_a_provider_success_is_the_tasks(media_platform):
    p = media_platform(enabled=False)
    [ref] = claimed(p)
    assert report(p, ref) == lifecycle.Applied("TERMINAL", "SUCCEEDED")
    assert media_job(p, ref) is None
    [ev] = terminal_events(p, ref)
    assert ev["event_type"] == "TaskSucceeded"


# --- 2. the claim and the worker slots -----------------------------------------------------------------

def test_a_claim_reserves_the_slots_moves_the_task_and_draws_a_new_fencing_token(media_platform):
    p = media_platform()
    [ref] = claimed(p)
    report(p, ref)
    before = media_job(p, ref)
    [job] = claim(p)
    after = media_job(p, ref)
    assert after["state"] == "RUNNING" and after["tries"] == 1 and after["fencing_token"] > before["fencing_token"]
    assert after["lease_until"] > p.clock.now()
    assert task(p, ref)["state"] == "MEDIA_PROCESSING"
    [res] = rows(p, "select * from resource_reservation where attempt_id = %s and resource_key = 'worker:cpu-proxy'",
                 ref.attempt_id)
    assert (res["state"], res["reserved_units"], res["fencing_token"]) == ("ACTIVE", 1, after["fencing_token"])
    assert used(p, "worker:cpu-proxy") == 1
    spec = job["spec"]
    assert spec["operation"] == "ingest" and spec["task_id"] == str(ref.task_id) and spec["tenant_id"] == str(ref.tenant_id)
    assert (spec["output_version"], spec["fencing_token"]) == (1, after["fencing_token"])
    assert spec["order"] == {"duration_seconds": 5, "resolution": "720p", "with_audio": False, "final": True}
    assert spec["outputs"] == str(pipeline.media_root(p) / f"outputs/{ref.tenant_id}/{ref.task_id}/v1") + "/"
    assert spec["allow_private_addresses"] is False  # a provider at a base URL of its own: never
    assert spec["source_url"] == before["source_url"] and spec["retention_class"] == "final"
    assert spec["tags"] == {"tenant_id": str(ref.tenant_id), "project": None, "task_id": str(ref.task_id),
                            "retention_class": "final"}
    assert set(spec["limits"]) == {"max_bytes", "timeout_seconds", "disk_quota_bytes", "duration_tolerance_seconds",
                                   "resolution_tolerance_ratio"}
    assert job["units"] == 1 and job["resource_class"] == "cpu-proxy"
    assert claim(p) == []  # claimed once
    now = p.clock.now()
    assert p.db.transaction(lambda c: pipeline.mark_started(c, task_id=ref.task_id, output_version=1,
                                                            fencing_token=after["fencing_token"], worker_ref="pid:1", now=now))
    assert not p.db.transaction(lambda c: pipeline.mark_started(c, task_id=ref.task_id, output_version=1,
                                                                fencing_token=before["fencing_token"], worker_ref="pid:2", now=now))
    assert media_job(p, ref)["worker_ref"] == "pid:1"


def test_media_classes_follow_the_order():
    t = {"resolution": "720p", "interactive": False}
    assert pipeline.media_class_of(t) == "cpu-proxy"
    assert pipeline.media_class_of({**t, "resolution": "1080p", "interactive": True}) == "cpu-proxy"
    assert pipeline.media_class_of({**t, "resolution": "1080p"}) == "gpu-render"
    assert pipeline.media_class_of({**t, "resolution": "4k", "interactive": True}) == "gpu-highmem"
    assert [pipeline.slot_units("cpu-proxy", r) for r in ("720p", "1080p", "4k")] == [1, 2, 6]
    assert pipeline.slot_units("gpu-render", "1080p") == 1 and pipeline.slot_units("gpu-highmem", "4k") == 2
    assert {c.pool_key for c in pipeline.MEDIA_CLASSES.values()} == {"worker:cpu-proxy", "worker:gpu-render", "worker:gpu-highmem"}


def test_a_flood_of_4k_work_never_takes_the_proxy_slots_and_no_pool_overflows(media_platform):
    p = media_platform(cpu_proxy_units=3, gpu_highmem_units=4)
    t = new_tenant(p, credits=10_000_000, **{**OPEN, **UNCAPPED})
    big = claimed(p, 8, BODY_4K, tenant=t)  # admitted first: their media jobs are the oldest
    small = claimed(p, 5, BODY_1U, tenant=t)
    for ref in big + small:
        report(p, ref)
    first = claim(p)
    by_class = {c: [j for j in first if j["resource_class"] == c] for c in ("gpu-highmem", "cpu-proxy")}
    assert len(by_class["gpu-highmem"]) == 2  # 2 units each in a pool of 4
    assert len(by_class["cpu-proxy"]) == 3  # the proxies got their own pool's every slot
    assert claim(p) == []  # both pools full
    for key, cap in (("worker:gpu-highmem", 4), ("worker:cpu-proxy", 3)):
        assert capacity(p, key) == cap and used(p, key) == cap == active_media_reservations(p, key)
    # Freed slots go to the waiting work of that class only.
    [done] = by_class["cpu-proxy"][:1]
    assert complete(p, ok_result(p, done)) == pipeline.APPLIED
    assert used(p, "worker:cpu-proxy") == 2
    [nxt] = claim(p)
    assert nxt["resource_class"] == "cpu-proxy" and used(p, "worker:cpu-proxy") == 3
    assert used(p, "worker:gpu-highmem") == 4


def test_media_slots_go_to_backlogged_tenants_by_their_weights(media_platform):
    # The media slots are a binding pool like a provider account (issue 14): three tenants at weights
    # 4, 2 and 1, each with more finished provider work than the 7 cpu-proxy slots hold. The light
    # tenant's provider work finished first, so oldest-first gave it every slot.
    p = media_platform(cpu_proxy_units=7)
    weights = {"light": 1, "middle": 2, "heavy": 4}
    tenants = {n: new_tenant(p, credits=10_000_000, weight=w, **{**OPEN, **UNCAPPED}) for n, w in weights.items()}
    name_of = {t.tenant_id: n for n, t in tenants.items()}
    for n in weights:  # light's media jobs are the oldest, heavy's the newest
        for ref in claimed(p, 12, BODY_1U, tenant=tenants[n]):
            report(p, ref)
    first = claim(p)
    assert Counter(name_of[j["tenant_id"]] for j in first) == Counter({"heavy": 4, "middle": 2, "light": 1}), first
    assert claim(p) == [] and used(p, "worker:cpu-proxy") == 7
    # Slots freed by the heavy tenant's jobs go back by weight against what each still runs: the
    # heavy tenant is at its share, so they go to it again, not to the others.
    for j in [j for j in first if name_of[j["tenant_id"]] == "heavy"][:2]:
        assert complete(p, ok_result(p, j)) == pipeline.APPLIED
    assert Counter(name_of[j["tenant_id"]] for j in claim(p)) == Counter({"heavy": 2})
    # Everything done: the next 7 slots split 4:2:1 again.
    for j in rows(p, "select * from media_job where state = 'RUNNING'"):
        assert complete(p, ok_result(p, j)) == pipeline.APPLIED
    assert Counter(name_of[j["tenant_id"]] for j in claim(p)) == Counter({"heavy": 4, "middle": 2, "light": 1})


# --- 3. completion -------------------------------------------------------------------------------------

def test_an_ok_result_applies_once_and_a_stale_or_duplicate_one_changes_nothing(media_platform):
    p = media_platform()
    [ref] = claimed(p)
    report(p, ref)
    [job] = claim(p)
    stale = {**ok_result(p, job), "fencing_token": job["fencing_token"] - 1}
    assert complete(p, stale) == pipeline.STALE
    assert task(p, ref)["state"] == "MEDIA_PROCESSING"
    result = ok_result(p, job)
    assert complete(p, result) == pipeline.APPLIED
    t = task(p, ref)
    assert t["state"] == "SUCCEEDED" and t["finished_at"] is not None and tasks.is_terminal(t["state"])
    outs = rows(p, "select * from task_output where task_id = %s order by asset_type", ref.task_id)
    prefix = f"outputs/{ref.tenant_id}/{ref.task_id}/v1/"
    assert [(o["asset_type"], o["object_key"], o["output_version"], o["url"]) for o in outs] == [
        ("delivery", prefix + "delivery.mp4", 1, None), ("proxy", prefix + "proxy.mp4", 1, None),
        ("thumbnail", prefix + "thumbnail.jpg", 1, None)]
    assert outs[1]["content_type"] == "video/mp4" and outs[1]["duration_ms"] == 5000 and outs[1]["metadata"]["height"] == 720
    assert used(p, "worker:cpu-proxy") == 0
    assert media_job(p, ref)["state"] == "SUCCEEDED"
    [ev] = terminal_events(p, ref)
    assert ev["event_type"] == "TaskSucceeded"
    assert ev["payload"]["stage"] == "PROVIDER_SUCCEEDED" and ev["payload"]["output_seconds"] == 5
    assert ev["payload"]["usage"]["cost_amount"] == "0.25" and ev["payload"]["charge_id"] == f"ch-{ref.task_id}"
    # Media cost beside the generation cost: the transcode (units x seconds) and the stored bytes.
    costs = {r["kind"]: r for r in rows(p, "select * from media_cost_event where task_id = %s", ref.task_id)}
    assert set(costs) == {"TRANSCODE", "STORAGE"}
    assert costs["TRANSCODE"]["amount"] == Decimal("4") * Decimal("0.00005")
    assert costs["TRANSCODE"]["tenant_id"] == ref.tenant_id and costs["STORAGE"]["amount"] > 0
    # The same result again, and a stale one: nothing more.
    assert complete(p, result) == pipeline.DUPLICATE
    assert complete(p, stale) == pipeline.STALE
    assert len(terminal_events(p, ref)) == 1
    assert one(p, "select count(*) as n from task_output where task_id = %s", ref.task_id)["n"] == 3
    assert one(p, "select count(*) as n from media_cost_event where task_id = %s", ref.task_id)["n"] == 2
    # Charged the quote, as for any success; the cost report counts the media cost per video.
    assert settle_terminal(p, ref).charged == PRICE
    with p.db.connection() as conn:
        doc = cost_report(conn, start=p.clock.now() - timedelta(hours=1), end=p.clock.now() + timedelta(hours=1))
    usd = doc["currencies"]["USD"]  # the module's other tests' tasks are in it too
    assert {k: Decimal(v) for k, v in usd["media_by_tenant"][str(ref.tenant_id)].items()} == {
        k: c["amount"] for k, c in costs.items()}
    videos = doc["successful_videos"]
    assert videos >= 1
    q = Decimal("0.00000001")
    assert Decimal(usd["media_cost_per_successful_video"]) == (Decimal(usd["media_cost"]) / videos).quantize(q)
    assert Decimal(usd["all_in_cost_per_successful_video"]) == (
        (Decimal(usd["provider_cost"]) + Decimal(usd["media_cost"])) / videos).quantize(q)


def test_an_ok_result_that_breaks_the_contract_is_a_failed_try(media_platform):
    p = media_platform()
    [ref] = claimed(p)
    report(p, ref)
    [job] = claim(p)
    bad = ok_result(p, job)
    bad["outputs"][0]["key"] = "/etc/passwd"
    assert complete(p, bad) == pipeline.RETRY
    assert media_job(p, ref)["error_code"] == pipeline.RESULT_INVALID
    assert rows(p, "select * from task_output where task_id = %s", ref.task_id) == []
    with pytest.raises(pipeline.MediaResultInvalid):
        complete(p, {"status": "ok"})


def test_a_transient_error_retries_with_the_same_output_version(media_platform):
    p = media_platform(max_tries=3, retry_base_seconds=10)
    [ref] = claimed(p)
    report(p, ref)
    [first] = claim(p)
    assert complete(p, failed_result(first, "error", "MEDIA_FETCH_FAILED", transcode_seconds=1.5)) == pipeline.RETRY
    job = media_job(p, ref)
    assert (job["state"], job["output_version"], job["tries"], job["error_code"]) == ("PENDING", 1, 1, "MEDIA_FETCH_FAILED")
    assert job["next_eligible_at"] == p.clock.now() + timedelta(seconds=10)
    assert task(p, ref)["state"] == "MEDIA_PROCESSING"  # not terminal, no event
    assert terminal_events(p, ref) == [] and used(p, "worker:cpu-proxy") == 0
    assert claim(p) == []  # backing off
    p.clock.advance(11)
    [second] = claim(p)
    assert second["output_version"] == 1 and second["fencing_token"] > first["fencing_token"]
    assert used(p, "worker:cpu-proxy") == 1  # the released reservation row taken back
    assert one(p, """select count(*) as n from resource_reservation where attempt_id = %s and resource_key = 'worker:cpu-proxy'""",
               ref.attempt_id)["n"] == 1
    # The first claim's worker reporting late (success, even) is stale: the second claim runs it.
    assert complete(p, ok_result(p, first)) == pipeline.STALE
    assert complete(p, ok_result(p, second)) == pipeline.APPLIED
    assert {o["output_version"] for o in rows(p, "select * from task_output where task_id = %s", ref.task_id)} == {1}
    assert one(p, "select count(*) as n from task_output where task_id = %s", ref.task_id)["n"] == 3
    # Each try's worker time is a media cost (1.5 s of the failed one, 4 s of the good one).
    assert {r["amount"] for r in rows(p, "select amount from media_cost_event where task_id = %s and kind = 'TRANSCODE'",
                                      ref.task_id)} == {Decimal("1.5") * Decimal("0.00005"), Decimal("4") * Decimal("0.00005")}


def test_bad_media_ends_media_ingest_failed_charging_nothing_under_success_only(media_platform, serve):
    p = media_platform()
    [ref] = claimed(p)
    report(p, ref)
    [job] = claim(p)
    assert complete(p, failed_result(job, "rejected", "MEDIA_TRUNCATED", transcode_seconds=0.5)) == pipeline.FAILED
    t = task(p, ref)
    assert t["state"] == "MEDIA_INGEST_FAILED" and tasks.is_terminal(t["state"]) and t["error_code"] == "MEDIA_TRUNCATED"
    assert tasks.TRANSITIONS["MEDIA_INGEST_FAILED"] == frozenset()
    assert (media_job(p, ref)["state"], media_job(p, ref)["tries"]) == ("FAILED", 1)  # bad media is never retried
    assert used(p, "worker:cpu-proxy") == 0
    assert one(p, "select count(*) as n from resource_reservation where task_id = %s and state = 'ACTIVE'", ref.task_id)["n"] == 0
    assert rows(p, "select * from task_output where task_id = %s", ref.task_id) == []
    [ev] = terminal_events(p, ref)
    assert ev["event_type"] == "TaskMediaIngestFailed"
    assert (ev["payload"]["state"], ev["payload"]["stage"], ev["payload"]["error_code"]) == (
        "MEDIA_INGEST_FAILED", "MEDIA_DELIVERY_FAILED", "MEDIA_TRUNCATED")
    assert ev["payload"]["provider_charged"] and ev["payload"]["output_seconds"] == 0
    assert complete(p, failed_result(job, "rejected", "MEDIA_TRUNCATED")) == pipeline.DUPLICATE
    # SUCCESS_ONLY: nothing charged, the whole reservation released; the provider's cost is recorded
    # (GENERATION: the provider did the job) and is the platform's.
    s = settle_terminal(p, ref)
    assert (s.outcome, s.charged, s.released) == ("SETTLED", 0, PRICE)
    charge = one(p, "select * from generation_charge where task_id = %s", ref.task_id)
    assert (charge["final_charge_amount"], charge["settled_outcome"]) == (0, "MEDIA_INGEST_FAILED/MEDIA_DELIVERY_FAILED")
    [cost] = rows(p, "select * from provider_cost_event where task_id = %s", ref.task_id)
    assert (cost["event_type"], cost["amount"]) == ("GENERATION", Decimal("0.25"))
    with p.db.connection() as conn:
        before = cost_report(conn, start=p.clock.now() - timedelta(hours=1), end=p.clock.now() + timedelta(hours=1))
    assert Decimal(before["currencies"]["USD"]["failed_cost"]) >= Decimal("0.25")  # not a delivered video's cost
    assert settle_terminal(p, ref).outcome == "REPLAY"
    # Terminal for the tenant too: a mapped error, and no cancel.
    from aivedio.context import set_platform

    api = serve(p)
    key = issue(p, ref)
    got = api.http.get(f"/v1/generations/{ref.task_id}", headers={"Authorization": f"Bearer {key}"}).json()
    assert got["state"] == "MEDIA_INGEST_FAILED" and got["outputs"] == []
    assert got["error"] == {"code": "MEDIA_PROCESSING_FAILED", "message": "the generated video could not be processed"}
    set_platform(p)
    try:
        with pytest.raises(TaskTerminal):
            cancel(p, caller_of(p, ref), ref.task_id)
    finally:
        set_platform(None)


def test_transient_errors_spend_the_tries_then_fail(media_platform):
    p = media_platform(max_tries=2, retry_base_seconds=1)
    [ref] = claimed(p)
    report(p, ref)
    [job] = claim(p)
    assert complete(p, failed_result(job, "error", "MEDIA_TIMEOUT")) == pipeline.RETRY
    p.clock.advance(2)
    [job] = claim(p)
    assert complete(p, failed_result(job, "error", "MEDIA_TIMEOUT")) == pipeline.FAILED
    assert (task(p, ref)["state"], task(p, ref)["error_code"], media_job(p, ref)["tries"]) == ("MEDIA_INGEST_FAILED", "MEDIA_TIMEOUT", 2)


@pytest.mark.parametrize("policy, provider_charged, amount", [
    ("SUCCESS_ONLY", True, 0), ("SUBMIT_CHARGED", True, 70), ("USAGE_BASED", True, 70)])
def test_each_policy_prices_a_media_ingest_failure_as_an_undelivered_result(policy, provider_charged, amount):
    snap = policies.ChargeSnapshot(policy_code=policy, quoted_amount=70, reserved_open=70,
                                   model_rules={"base_amount": 20, "per_second_amount": 10,
                                                "resolution_multiplier_pct": {"720p": 100},
                                                "audio_surcharge_amount": 10, "mode_multiplier_pct": {"text_to_video": 100}},
                                   params={"resolution": "720p", "mode": "text_to_video", "with_audio": False})
    out = policies.Outcome("MEDIA_INGEST_FAILED", "MEDIA_DELIVERY_FAILED", provider_charged=provider_charged,
                           usage_seconds=Decimal(5))
    assert policies.decide(snap, out).amount == amount
    assert policies.decide(snap, out).amount == policies.decide(
        snap, policies.Outcome("FAILED", "MEDIA_DELIVERY_FAILED", provider_charged=provider_charged, usage_seconds=Decimal(5))).amount


def test_a_cancel_during_the_media_step_keeps_the_result(media_platform):
    p = media_platform()
    [ref] = claimed(p)
    report(p, ref)
    [job] = claim(p)
    from aivedio.context import set_platform

    set_platform(p)
    try:
        assert cancel(p, caller_of(p, ref), ref.task_id)["state"] == "CANCEL_REQUESTED"
    finally:
        set_platform(None)
    a = one(p, "select * from task_attempt where attempt_id = %s", ref.attempt_id)
    assert a["state"] in tasks.ATTEMPT_LIVE  # reopened: its workflow asks the provider again
    # The reopened workflow hears the job finished: the task goes back to the media step, whose slots it keeps.
    assert report(p, ref, first=False).task_state == "MEDIA_PROCESSING"
    assert used(p, "worker:cpu-proxy") == 1
    assert one(p, "select state from task_attempt where attempt_id = %s", ref.attempt_id)["state"] == "SUCCEEDED"
    assert complete(p, ok_result(p, job)) == pipeline.APPLIED
    assert task(p, ref)["state"] == "SUCCEEDED" and used(p, "worker:cpu-proxy") == 0


def test_a_result_during_a_cancel_still_delivers(media_platform):
    p = media_platform()
    [ref] = claimed(p)
    report(p, ref)
    [job] = claim(p)
    from aivedio.context import set_platform

    set_platform(p)
    try:
        cancel(p, caller_of(p, ref), ref.task_id)
    finally:
        set_platform(None)
    assert complete(p, ok_result(p, job)) == pipeline.APPLIED
    assert task(p, ref)["state"] == "SUCCEEDED"
    a = one(p, "select * from task_attempt where attempt_id = %s", ref.attempt_id)
    assert a["state"] == "SUCCEEDED" and a["lease_until"] is None  # the reopened attempt is final again
    assert one(p, "select count(*) as n from resource_reservation where task_id = %s and state = 'ACTIVE'", ref.task_id)["n"] == 0


# --- 4. what the tenant sees ---------------------------------------------------------------------------

def issue(p, ref) -> str:
    from aivedio.auth import issue_key

    u = one(p, "select user_id from generation_task where task_id = %s", ref.task_id)["user_id"]
    return p.db.transaction(lambda conn: issue_key(conn, ref.tenant_id, u).secret)


def caller_of(p, ref):
    from aivedio.auth import Caller

    return Caller(ref.tenant_id, one(p, "select user_id from generation_task where task_id = %s", ref.task_id)["user_id"],
                  "OWNER", None)


def test_the_tenant_sees_only_platform_urls_and_the_signed_url_serves_the_bytes(media_platform, serve):
    p = media_platform()
    [ref] = claimed(p)
    report(p, ref)
    [job] = claim(p)
    assert complete(p, ok_result(p, job, write=True)) == pipeline.APPLIED
    api = serve(p)
    key = issue(p, ref)
    r = api.http.get(f"/v1/generations/{ref.task_id}", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    view = r.json()
    assert [o["asset_type"] for o in view["outputs"]] == ["delivery", "proxy", "thumbnail"]
    assert "cdn.provider.example" not in r.text
    for o in view["outputs"]:
        assert o["url"].startswith(f"{api.rt.base_url}/v1/media/")
        got = httpx.get(o["url"], timeout=30)  # no bearer key: the URL is the credential
        assert got.status_code == 200, got.text
        name = {"delivery": "delivery.mp4", "proxy": "proxy.mp4", "thumbnail": "thumbnail.jpg"}[o["asset_type"]]
        assert got.content == (Path(job["spec"]["outputs"]) / name).read_bytes()
        assert got.headers["content-type"] == ("image/jpeg" if name.endswith(".jpg") else "video/mp4")
    url = view["outputs"][1]["url"]
    sig = url.rsplit("sig=", 1)[1]
    tampered = url[:-len(sig)] + ("A" if sig[0] != "A" else "B") + sig[1:]
    assert httpx.get(tampered, timeout=30).status_code == 403
    other = urls.ref_of(f"outputs/{ref.tenant_id}/{ref.task_id}/v1/delivery.mp4")
    assert httpx.get(url.replace(url.split("/v1/media/")[1].split("?")[0], other), timeout=30).status_code == 403
    obj = f"outputs/{ref.tenant_id}/{ref.task_id}/v1/proxy.mp4"
    expired = urls.local_url(p, obj, now=0)  # expired in 1970
    assert httpx.get(expired.replace(urls.public_base(p), api.rt.base_url), timeout=30).status_code == 403
    r = httpx.get(f"{api.rt.base_url}/v1/media/{urls.ref_of(obj)}", timeout=30)
    assert r.status_code == 403 and r.json()["error"] == "MEDIA_URL_REFUSED"
    # A signed key outside the outputs is refused too (no path out of the media directory).
    sneaky = "outputs/../../../etc/passwd"
    assert httpx.get(urls.local_url(p, sneaky).replace(urls.public_base(p), api.rt.base_url), timeout=30).status_code == 403


# --- 5. the reconciler ---------------------------------------------------------------------------------

def test_the_media_jobs_service_retries_a_lost_job_and_ends_with_one_output_version(media_platform):
    p = media_platform(max_tries=3, retry_base_seconds=1)
    refs = claimed(p, 3)
    for ref in refs:
        report(p, ref)
    jobs = {UUID(j["spec"]["task_id"]): j for j in claim(p)}
    gone, hung, fine = refs
    now = p.clock.now()
    # A worker that died (its pid is gone) ...
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # ... and one that hangs "mid-transcode": a process whose command line is its SPEC, as the worker's is.
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                              json.dumps(jobs[hung.task_id]["spec"], separators=(",", ":"))])
    try:
        for ref, worker in ((gone, f"pid:{dead.pid}"), (hung, f"pid:{stuck.pid}"), (fine, f"pid:{dead.pid}")):
            j = jobs[ref.task_id]
            p.db.transaction(lambda c, j=j, w=worker: pipeline.mark_started(
                c, task_id=j["task_id"], output_version=1, fencing_token=j["fencing_token"], worker_ref=w, now=now))
        assert complete(p, ok_result(p, jobs[fine.task_id])) == pipeline.APPLIED  # reported in time: never looked at
        assert media_jobs.run_once(p).repaired == 0  # within their leases: left alone
        p.clock.advance(pipeline.lease_for(p).total_seconds() * p.clock.time_scale + 120)
        rep = room.run(p, media_jobs.NAME)
        assert rep.repaired == 2 and rep.details["retry"] == 2 and rep.details["killed_hung"] == 1, rep
        assert stuck.wait(10) is not None  # the hung worker was killed
    finally:
        if stuck.poll() is None:
            stuck.kill()
    for ref in (gone, hung):
        job = media_job(p, ref)
        assert (job["state"], job["output_version"], job["error_code"]) == ("PENDING", 1, pipeline.WORKER_LOST)
        assert task(p, ref)["state"] == "MEDIA_PROCESSING"
    assert used(p, "worker:cpu-proxy") == 0
    p.clock.advance(5)
    again = {UUID(j["spec"]["task_id"]): j for j in claim(p)}
    assert set(again) == {gone.task_id, hung.task_id}
    # The killed worker's partial outputs were under the same version: the retry writes over them.
    for ref in (gone, hung):
        assert complete(p, ok_result(p, again[ref.task_id], write=True)) == pipeline.APPLIED
        assert complete(p, ok_result(p, jobs[ref.task_id])) == pipeline.STALE  # the lost claim's late word
        outs = rows(p, "select output_version, asset_type from task_output where task_id = %s", ref.task_id)
        assert sorted(outs, key=lambda o: o["asset_type"]) == [{"output_version": 1, "asset_type": a}
                                                               for a in ("delivery", "proxy", "thumbnail")]
    assert media_jobs.run_once(p).examined == 0


def test_the_media_jobs_service_fails_a_task_whose_tries_are_spent(media_platform):
    p = media_platform(max_tries=1)
    [ref] = claimed(p)
    report(p, ref)
    [job] = claim(p)
    p.clock.advance(pipeline.lease_for(p).total_seconds() + 600)
    rep = media_jobs.run_once(p)  # never started at all: no worker_ref
    assert rep.details["failed"] == 1
    assert task(p, ref)["state"] == "MEDIA_INGEST_FAILED" and task(p, ref)["error_code"] == pipeline.WORKER_LOST
    [ev] = terminal_events(p, ref)
    assert ev["event_type"] == "TaskMediaIngestFailed"
    assert not Path(job["spec"]["outputs"]).exists()  # no partial outputs left behind


def test_the_media_jobs_service_crosses_a_batch_boundary(media_platform):
    from aivedio.config import MaintenanceService

    p = media_platform(maintenance={media_jobs.NAME: MaintenanceService(batch_size=2)})
    refs = claimed(p, 5)
    for ref in refs:
        report(p, ref)
    assert len(claim(p)) == 5
    p.clock.advance(pipeline.lease_for(p).total_seconds() + 600)
    rep = media_jobs.run_once(p)
    assert rep.batches == 3 and rep.details["retry"] == 5 and rep.complete


def test_an_unsettled_media_ingest_failure_is_settled_from_the_facts(media_platform):
    """Its terminal event lost, unsettled-terminals rebuilds it from the task and its attempt."""
    from aivedio.reconcile.unsettled_terminals import terminal_payload

    p = media_platform()
    [ref] = claimed(p)
    report(p, ref)
    [job] = claim(p)
    assert complete(p, failed_result(job, "rejected", "MEDIA_NOT_VIDEO")) == pipeline.FAILED
    [ev] = terminal_events(p, ref)
    event_type, payload = terminal_payload(task(p, ref), one(p, "select * from task_attempt where attempt_id = %s", ref.attempt_id))
    assert event_type == ev["event_type"] == "TaskMediaIngestFailed"
    assert {k: payload[k] for k in ("state", "stage", "provider_charged", "output_seconds", "error_code")} == {
        k: ev["payload"][k] for k in ("state", "stage", "provider_charged", "output_seconds", "error_code")}
    with p.db.connection() as conn:
        s = settle(conn, payload, p.clock.now(), event_type=event_type)
    assert (s.outcome, s.charged) == ("SETTLED", 0)


def test_in_aws_outputs_go_to_the_media_bucket_and_the_tenant_gets_presigned_urls(make_platform, monkeypatch, tmp_path):
    """With Settings.media_bucket the SPEC's outputs are the bucket's prefix, the RESULT's s3:// keys
    become the platform's object keys, and the view presigns each at read time (moto for S3)."""
    import boto3
    from moto import mock_aws
    from urllib.parse import parse_qs, urlsplit

    from aivedio import views

    with mock_aws():
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        cfg = PlatformConfig(providers=[ProviderConfig(name="provider-a",
                                                       accounts=[ProviderAccount(account_id="account-01", max_concurrency=500)])])
        p = make_platform(cfg, clock=ManualClock(datetime.now(timezone.utc)), media_bucket="aivedio-media-test")
        p.extras["s3_client"] = boto3.client("s3", region_name="us-east-1")
        with p.db.connection() as conn:
            apply_config(conn, p.config, p.clock)
        room.run(p, "redis-index")
        [ref] = claimed(p)
        report(p, ref)
        [job] = claim(p)
        prefix = f"outputs/{ref.tenant_id}/{ref.task_id}/v1/"
        assert job["spec"]["outputs"] == f"s3://aivedio-media-test/{prefix}"
        result = ok_result(p, job)
        for o in result["outputs"]:
            o["key"] = prefix + Path(o["key"]).name  # an S3 worker reports the object key
        result["outputs"][0]["key"] = "s3://aivedio-media-test/" + result["outputs"][0]["key"]  # or the s3:// URL
        assert complete(p, result) == pipeline.APPLIED
        # The outputs' storage life is booked by the platform in AWS too: cost allocation never reads an
        # object's tags, so the CUR bills the bucket as a whole (aivedio.media.storage_cost).
        [stored] = rows(p, "select * from media_cost_event where task_id = %s and kind = 'STORAGE'", ref.task_id)
        m = p.config.media
        assert stored["tags"]["retention_class"] == pipeline.retention_class(task(p, ref)) == "final"
        assert stored["amount"] == storage_cost.lifetime_cost(
            stored["tags"]["bytes"], "final", storage_cost.StoragePrices.of(m), m.storage_horizon_months).quantize(QUANTUM)
        with p.db.connection() as conn:
            doc = views.get_task(conn, ref.tenant_id, ref.task_id, platform=p)
        assert {o["asset_type"] for o in doc["outputs"]} == {"proxy", "thumbnail", "delivery"}
        for o in doc["outputs"]:
            u = urlsplit(o["url"])
            assert "aivedio-media-test" in u.netloc + u.path and u.path.endswith(f"{o['asset_type']}.{'jpg' if o['asset_type'] == 'thumbnail' else 'mp4'}")
            q = parse_qs(u.query)
            assert "X-Amz-Signature" in q or "Signature" in q
            assert prefix in u.path
