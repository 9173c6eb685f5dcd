"""Admission in one round trip (issue 15, part 2): the write path is one call of aivedio_admit
(migration 0190), over the real PostgreSQL and Redis.

- an admission sends one statement in one round trip (the call: the policy comes from the process's
  cache, and the call reads the key's record), no BEGIN or COMMIT, and one Redis command for both
  submit buckets;
- a replay is the same call, answered by the record, and gives its rate tokens back; a replay
  refused by the rates answers its record all the same;
- a policy changed since the process cached it applies to the next admission (migration 0240);
- the function's expected wait is queue_stats.expected_wait_seconds, and the body it stores is what
  json.dumps writes;
- the rate buckets in one call refuse like separate calls: a refused user bucket leaves the tenant
  bucket untouched."""
from __future__ import annotations

import json
import os
import random
import tempfile
import uuid

import psycopg
import pytest

from aivedio import caching
from aivedio.scheduling import queue_stats
from aivedio.admission import rate_limits
from aivedio.admission.models import GenerationRequest
from aivedio.scheduling.queue_stats import LaneStats
from aivedio.admission.decisions import Rejected
from aivedio.admission.service import IdempotencyKeyReused, admit
from aivedio_tools.bench.profile import count_trace
from tests.admission_support import BODY, new_tenant

pytestmark = pytest.mark.redis_cluster  # each test also runs on a 3-node Redis cluster


def traced(platform, fn):
    """Run fn() with the platform's only connection traced; (its result, the trace's counts)."""
    fd, path = tempfile.mkstemp(prefix="aivedio-test-trace-")
    with platform.db.connection() as c:
        c.pgconn.trace(fd)
        c.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE)
    try:
        out = fn()
    finally:
        with platform.db.connection() as c:
            c.pgconn.untrace()
        os.close(fd)
    with open(path) as f:
        text = f.read()
    os.unlink(path)
    return out, count_trace(text), text


def redis_counted(platform):
    calls: list = []
    original = platform.cache.r.execute_command

    def counted(*a, **k):
        calls.append(a[0])
        return original(*a, **k)

    platform.cache.r.execute_command = counted
    return calls


def user_tokens(platform, t) -> float:
    return float(platform.cache.r.hget(platform.cache.key_in_slot("rate", t.caller.tenant_id, f"user:{t.caller.user_id}:submit"), "tokens"))


@pytest.fixture
def long_caches(monkeypatch):
    """Admission's per-process caches (the policy, lane figures, the price version) kept for the
    test: one expiring between its admissions on a loaded machine would add its reload's statements."""
    from aivedio.admission import service

    monkeypatch.setattr(service, "POLICY_CACHE_SECONDS", 600.0)
    monkeypatch.setattr(caching, "CACHE_SECONDS", 600.0)


def test_an_admission_is_one_statement_in_one_round_trip_and_one_redis_call(make_platform, conn, long_caches):
    p = make_platform(pool_size=1)  # one connection: everything admission sends is traced
    t = new_tenant(p)
    req = GenerationRequest(**BODY)
    admit(p, t.caller, req, BODY, "warm")  # caches: policy, price version, lane figures, outbox state
    calls = redis_counted(p)
    got, counts, text = traced(p, lambda: admit(p, t.caller, req, BODY, "measured"))
    assert got.status == 202 and not got.replayed
    assert counts == {"statements": 1, "transaction_commands": 0, "round_trips": 1}, text
    assert "aivedio_admit" in text
    assert len(calls) == 1 and calls[0].upper() in ("EVALSHA", "EVAL"), calls
    # What the one call wrote is everything an admission writes.
    task_id = json.loads(got.body)["task_id"]
    for table in ("generation_task", "generation_charge", "credit_reservation", "idempotency_record"):
        assert conn.execute(f"select count(*) as n from {table} where task_id = %s", (task_id,)).fetchone()["n"] == 1, table
    assert conn.execute("""select count(*) as n from ledger_transaction where task_id = %s and event_type = 'RESERVE'
                            and business_key = %s""", (task_id, f"reserve:generation:{task_id}:v1")).fetchone()["n"] == 1
    assert conn.execute("select count(*) as n from outbox_event where aggregate_id = %s and event_type = 'TaskQueued'",
                        (task_id,)).fetchone()["n"] == 1

    tokens = user_tokens(p, t)
    calls.clear()
    again, counts, text = traced(p, lambda: admit(p, t.caller, req, BODY, "measured"))
    assert again.replayed and again.body == got.body
    assert counts == {"statements": 1, "transaction_commands": 0, "round_trips": 1}, text
    # A replay spends no rate: the tokens it took are given back (the bucket refills meanwhile, up
    # to its capacity; without the give-back it would hold one token less).
    assert len(calls) == 2, calls
    assert min(tokens + 1, 10_000) - 0.5 < user_tokens(p, t) <= 10_000, (tokens, user_tokens(p, t))


@pytest.mark.parametrize("rate, decision", [("user_submit_rate_per_minute", "REJECT_USER_RATE_LIMIT"),
                                            ("tenant_submit_rate_per_minute", "REJECT_TENANT_RATE_LIMIT")])
def test_a_replay_refused_by_the_rates_answers_its_record(platform, conn, rate, decision):
    # The user's bucket at 60 a minute: it refills a thousandth of a token per ms, far less than the
    # token a missing give-back would leave it short.
    t = new_tenant(platform, **{"user_submit_rate_per_minute": 60, rate: 1})
    req = GenerationRequest(**BODY)
    first = admit(platform, t.caller, req, BODY, "k1")
    with pytest.raises(Rejected) as e:
        admit(platform, t.caller, req, BODY, "k2")
    assert e.value.decision == decision
    tokens = user_tokens(platform, t)
    again = admit(platform, t.caller, req, BODY, "k1")
    assert again.replayed and again.body == first.body
    # The user's bucket gave before the tenant's refused: its token is given back too.
    assert user_tokens(platform, t) > tokens - 0.5
    with pytest.raises(IdempotencyKeyReused):  # the record's refusal, too: the key with another body
        admit(platform, t.caller, GenerationRequest(**{**BODY, "prompt": "other"}), {**BODY, "prompt": "other"}, "k1")
    assert conn.execute("select count(*) as n from generation_task where tenant_id = %s", (t.tenant_id,)).fetchone()["n"] == 1


def test_a_policy_changed_after_the_process_cached_it_applies_to_the_next_admission(make_platform, conn, long_caches,
                                                                                    monkeypatch):
    from aivedio.admission import service

    p = make_platform(pool_size=1)
    t = new_tenant(p)
    req = GenerationRequest(**BODY)
    admit(p, t.caller, req, BODY, "cached")  # the policy is cached now
    # Another process changes the policy, as aivedio.policy.tenant_policy does: with its version.
    conn.execute("""update tenant_scheduling_policy set max_queued_tasks = 1, policy_version = policy_version + 1
                     where tenant_id = %s""", (t.tenant_id,))
    probes = []
    real_probe = service.probe_inputs
    monkeypatch.setattr(service, "probe_inputs", lambda *a, **kw: probes.append(1) or real_probe(*a, **kw))
    refused, counts, text = traced(p, lambda: pytest.raises(Rejected, admit, p, t.caller, req, BODY, "over"))
    assert refused.value.decision == "REJECT_TENANT_QUEUE_FULL"
    # The call decided under the cached version answered POLICY_STALE, then the policy was read and
    # the call made again; the inputs were probed once (a fetch is slow).
    assert counts == {"statements": 3, "transaction_commands": 0, "round_trips": 3}, text
    assert len(probes) == 1
    assert conn.execute("select count(*) as n from generation_task where tenant_id = %s", (t.tenant_id,)).fetchone()["n"] == 1
    # And the function itself refuses a stale version before any write.
    conn.execute("update tenant_scheduling_policy set max_queued_tasks = 100, policy_version = policy_version + 1 "
                 "where tenant_id = %s", (t.tenant_id,))
    got = admit(p, t.caller, req, BODY, "room")
    assert got.status == 202
    version = conn.execute("select policy_version from generation_task where task_id = %s",
                           (uuid.UUID(json.loads(got.body)["task_id"]),)).fetchone()["policy_version"]
    assert version == conn.execute("select policy_version from tenant_scheduling_policy where tenant_id = %s",
                                   (t.tenant_id,)).fetchone()["policy_version"]


def test_the_stored_body_is_what_json_dumps_writes(platform, conn):
    t = new_tenant(platform)
    got = admit(platform, t.caller, GenerationRequest(**BODY), BODY, "shape")
    body = json.loads(got.body)
    assert got.body == json.dumps(body)
    assert list(body) == ["task_id", "state", "decision", "queue_class", "estimated_start_at", "queue_position_level", "quote"]
    assert list(body["quote"]) == ["price_version_id", "quoted_amount", "max_reserve_amount", "unit"]
    assert body["estimated_start_at"].endswith("Z") and len(body["estimated_start_at"]) == len("2025-01-01T00:00:00Z")
    event = conn.execute("select payload from outbox_event where aggregate_id = %s", (uuid.UUID(body["task_id"]),)).fetchone()
    assert set(event["payload"]) == {"task_id", "tenant_id", "queue_class", "priority_band", "fairness_units", "enqueue_at"}


@pytest.mark.parametrize("seed", range(3))
def test_the_functions_expected_wait_is_the_python_one(conn, seed):
    rng = random.Random(seed)
    for _ in range(200):
        stats = LaneStats(queued_units=rng.randint(0, 10_000), queued_tasks=0, active_weight=rng.randint(0, 500),
                          mu_units_per_second=rng.choice([0.0, rng.uniform(0.001, 50.0)]), measured=True)
        kw = dict(tenant_weight=rng.randint(1, 100), tenant_queued_units=rng.randint(0, 1000),
                  tenant_active=rng.random() < 0.5, units=rng.randint(1, 50))
        want = queue_stats.expected_wait_seconds(stats, **kw)
        got = conn.execute("select aivedio_expected_wait(%s, %s, %s::float8, %s, %s, %s, %s) as w",
                           (stats.queued_units, stats.active_weight, stats.mu_units_per_second, kw["tenant_weight"],
                            kw["tenant_queued_units"], kw["tenant_active"], kw["units"])).fetchone()["w"]
        assert got == pytest.approx(want, rel=1e-12), (stats, kw)


def test_the_buckets_in_one_call_refuse_like_separate_calls(platform):
    first = rate_limits.take_all(platform, [("u:a", 1), ("t:a", 5)], slot="a")
    assert first is None
    refused = rate_limits.take_all(platform, [("u:a", 1), ("t:a", 5)], slot="a")
    assert refused is not None and refused[0] == 0 and refused[1].retry_after_seconds >= 1
    # The user bucket refused, so the tenant bucket was left alone: it still has 4 of its 5.
    assert [rate_limits.take(platform, "t:a", 5, slot="a").allowed for _ in range(5)] == [True] * 4 + [False]
    # A bucket with no rate refuses without a call, after the ones before it gave.
    assert rate_limits.take_all(platform, [("u:b", 3), ("t:b", 0)], slot="a")[0] == 1
    assert [rate_limits.take(platform, "u:b", 3, slot="a").allowed for _ in range(3)] == [True, True, False]


USAGE_VS_TASKS = """
select coalesce(u.tenant_id, t.tenant_id) as tenant_id, coalesce(u.user_id, t.user_id) as user_id,
       coalesce(u.queue_class, t.queue_class) as queue_class, coalesce(u.queued_tasks, 0) as usage_tasks,
       coalesce(u.queued_units, 0) as usage_units, coalesce(t.n, 0) as tasks, coalesce(t.units, 0) as units
  from (select * from task_queue_usage where tenant_id = %(t)s) u
  full join (select tenant_id, user_id, queue_class, count(*) as n, sum(fairness_units) as units from generation_task
              where tenant_id = %(t)s and state = 'QUEUED' group by 1, 2, 3) t using (tenant_id, user_id, queue_class)
"""


def test_the_queue_usage_the_limits_read_equals_the_queued_tasks(platform, conn):
    from aivedio.admission.cancel import cancel
    from tests.admission_support import second_user

    t = new_tenant(platform)
    other = second_user(platform, t)
    ids = []
    for who in (t, other):
        for i in range(4):
            ids.append(json.loads(admit(platform, who.caller, GenerationRequest(**BODY), BODY, uuid.uuid4().hex).body)["task_id"])
    cancel(platform, t.caller, uuid.UUID(ids[0]))  # QUEUED -> CANCELLED
    conn.execute("update generation_task set state = 'DISPATCHING', version = version + 1 where task_id = %s", (ids[1],))  # a claim
    conn.execute("update generation_task set state = 'DISPATCHING' where task_id = %s", (ids[5],))
    conn.execute("update generation_task set state = 'QUEUED' where task_id = %s", (ids[5],))  # and its requeue
    conn.execute("update generation_task set queue_class = 'STANDARD', fairness_units = 3 where task_id = %s", (ids[6],))
    conn.execute("update generation_task set priority_band = 1 where task_id = %s", (ids[7],))  # not counted: no change
    rows = conn.execute(USAGE_VS_TASKS, {"t": t.tenant_id}).fetchall()
    assert rows and all((r["usage_tasks"], r["usage_units"]) == (r["tasks"], r["units"]) for r in rows), rows
    assert sum(r["tasks"] for r in rows) == 6
    # And the limits read it: the user with 3 queued tasks is full at 3.
    conn.execute("update tenant_scheduling_policy set max_user_queued_tasks = 3, policy_version = policy_version + 1 "
                 "where tenant_id = %s", (t.tenant_id,))  # a change moves the version (aivedio.policy.tenant_policy)
    with pytest.raises(Rejected) as e:
        admit(platform, other.caller, GenerationRequest(**BODY), BODY, "over")
    assert e.value.decision == "REJECT_USER_QUEUE_FULL"
    assert admit(platform, t.caller, GenerationRequest(**BODY), BODY, "room").status == 202  # 2 queued: room for one


def test_a_spent_key_answers_before_a_refusal(make_platform, conn):
    from datetime import datetime, timezone

    from aivedio.admission.service import IdempotencyKeyReused
    from aivedio.config import ManualClock

    clock = ManualClock(datetime.now(timezone.utc))
    p = make_platform(clock=clock)
    t = new_tenant(p, credits=70)  # one task's worth
    req = GenerationRequest(**BODY)
    assert admit(p, t.caller, req, BODY, "once").status == 202
    clock.advance(p.config.timers.idempotency_ttl_seconds + 1)
    # The record expired; the key is still its task's. The wallet is empty too: the key answers.
    with pytest.raises(IdempotencyKeyReused):
        admit(p, t.caller, req, BODY, "once")
    conn.execute("update tenant_scheduling_policy set max_queued_tasks = 0, policy_version = policy_version + 1 "
                 "where tenant_id = %s", (t.tenant_id,))
    with pytest.raises(IdempotencyKeyReused):
        admit(p, t.caller, req, BODY, "once")


def test_a_rate_changed_after_the_process_cached_the_policy_binds_from_the_next_admission(platform, conn, long_caches):
    t = new_tenant(platform, user_submit_rate_per_minute=100)
    req = GenerationRequest(**BODY)
    assert admit(platform, t.caller, req, BODY, "a").status == 202  # the policy is cached, at 100 a minute
    conn.execute("""update tenant_scheduling_policy set user_submit_rate_per_minute = 1, policy_version = policy_version + 1
                     where tenant_id = %s""", (t.tenant_id,))
    # Decided under the cached policy, the call answers POLICY_STALE: the tokens taken at 100 a minute
    # go back, and the bucket is taken again at 1 a minute (it holds one token then: this one).
    assert admit(platform, t.caller, req, BODY, "b").status == 202
    with pytest.raises(Rejected) as e:
        admit(platform, t.caller, req, BODY, "c")
    assert e.value.decision == "REJECT_USER_RATE_LIMIT"
