"""The chaos checkers against tiny models (issue 18, item 5): one consistent run that every checker
passes, and for each checker broken variants of it that make it fire. No database: a model is a
few dicts, shaped as the run directory's files are (records.Run)."""
from __future__ import annotations

import copy
import json

import pytest

from aivedio_tools.chaos import checkers
from aivedio_tools.chaos.checkers import CHECKERS, MAX_EXCERPT, Violation, check_all
from aivedio_tools.chaos.facts import FACT_FILES, OPTIONAL_FACTS
from aivedio_tools.chaos.records import Run, RunFileMalformed, RunFileMissing

T = "00000000-0000-0000-0000-00000000000t"  # the tenant
W = "00000000-0000-0000-0000-00000000000w"  # its wallet
LOT = "00000000-0000-0000-0000-0000000000l1"
A, B = "00000000-0000-0000-0000-0000000000aa", "00000000-0000-0000-0000-0000000000bb"  # tasks
A1, B1, B2 = "attempt-a1", "attempt-b1", "attempt-b2"
QUOTE = 70
STARTED = "2025-01-01T00:00:00+00:00"
SHARD = "provider-account:sim-p:acc-1"


def at(seconds: float) -> str:
    return f"2025-01-01T00:00:{seconds:06.3f}+00:00"


class History:
    """Builds history.jsonl lines: op() appends an invoke and its answer."""

    def __init__(self):
        self.lines: list[dict] = []

    def op(self, process: str, f: str, t0: float, t1: float | None, kind: str = "ok", *, key=None, body=None, task_id=None,
           **value) -> History:
        self.lines.append({"i": len(self.lines), "process": process, "type": "invoke", "f": f, "t": t0, "tenant": "acme",
                           "key": key, "body": body, "task_id": task_id if f != "submit" else None, "value": None})
        if t1 is not None:
            v = {"status": None, "decision": None, "task_id": None, "state": None, "code": None, "response": None, **value}
            self.lines.append({"i": len(self.lines), "process": process, "type": kind, "f": f, "t": t1, "tenant": "acme",
                               "key": key, "body": body, "task_id": v["task_id"] or task_id, "value": v})
        return self


def entry(txn: str, bucket: str, amount: int, lot: str | None = LOT) -> dict:
    return {"entry_id": f"{txn}:{bucket}:{amount}", "ledger_txn_id": txn, "tenant_id": T, "wallet_id": W, "lot_id": lot,
            "bucket": bucket, "amount_delta": amount, "unit_code": "CREDIT", "created_at": at(0)}


def txn(txn_id: str, event_type: str, task_id: str | None = None, reservation_id: str | None = None) -> dict:
    return {"ledger_txn_id": txn_id, "tenant_id": T, "wallet_id": W, "business_key": txn_id, "event_type": event_type,
            "task_id": task_id, "reservation_id": reservation_id, "reversal_of": None, "reason_code": None, "metadata": {},
            "created_at": at(0)}


def task(task_id: str, key: str, state: str, attempt: str, token: int, created: float) -> dict:
    return {"task_id": task_id, "tenant_id": T, "idempotency_key": key, "state": state, "error_code": None,
            "current_attempt_id": attempt, "current_fencing_token": token, "created_at": at(created), "version": 5}


def attempt(attempt_id: str, task_id: str, no: int, state: str, token: int) -> dict:
    return {"attempt_id": attempt_id, "task_id": task_id, "tenant_id": T, "attempt_no": no, "state": state,
            "fencing_token": token, "provider_request_key": f"{task_id}:{no}", "provider_account": "acc-1", "recoveries": 0}


def event(event_type: str, task_id: str, created: float, **payload) -> dict:
    return {"event_id": f"ev-{event_type}-{task_id}", "event_type": event_type, "aggregate_type": "generation_task",
            "aggregate_id": task_id, "tenant_id": T, "payload": {"task_id": task_id, **payload}, "created_at": at(created)}


def model() -> dict:
    """Two tasks of one tenant: A succeeded (charged its quote), B failed on its second attempt
    after its first was confirmed absent (charged nothing under SUCCESS_ONLY). A's key was
    replayed once, and reused once with another body (refused 422)."""
    h = (History()
         .op("client-1", "submit", 0.0, 0.1, key="k1", body="b1", status=202, task_id=A, response="r1")
         .op("client-2", "submit", 0.2, 0.3, key="k2", body="b2", status=202, task_id=B, response="r2")
         .op("client-1", "submit", 0.4, 0.5, key="k1", body="b1", status=202, task_id=A, response="r1")
         .op("client-2", "submit", 0.6, 0.7, "fail", key="k1", body="b3", status=422, code="IDEMPOTENCY_KEY_REUSED")
         .op("client-1", "get", 1.0, 1.1, task_id=A, status=200, state="RUNNING")
         .op("client-2", "get", 1.0, 1.2, task_id=B, status=200, state="QUEUED")
         .op("client-1", "get", 2.5, 2.6, task_id=A, status=200, state="SUCCEEDED")
         .op("client-2", "get", 2.5, 2.7, task_id=B, status=200, state="FAILED"))
    facts = {name: [] for name in FACT_FILES}
    facts["tasks"] = [task(A, "k1", "SUCCEEDED", A1, 5, 0.05), task(B, "k2", "FAILED", B2, 7, 0.25)]
    facts["attempts"] = [attempt(A1, A, 1, "SUCCEEDED", 5), attempt(B1, B, 1, "ABSENT_CONFIRMED", 6),
                         attempt(B2, B, 2, "FAILED", 7)]
    facts["outbox"] = [event("TaskQueued", A, 0.05), event("TaskQueued", B, 0.25),
                       event("TaskSucceeded", A, 2.05, attempt_id=A1, state="SUCCEEDED", provider_charged=True),
                       event("TaskFailed", B, 2.15, attempt_id=B2, state="FAILED", provider_charged=False)]
    facts["ledger_transactions"] = [txn("grant", "GRANT"), txn("reserve-a", "RESERVE", A, "res-a"),
                                    txn("reserve-b", "RESERVE", B, "res-b"), txn("settle-a", "SETTLE", A, "res-a"),
                                    txn("release-b", "RELEASE", B, "res-b")]
    facts["ledger_entries"] = [entry("grant", "ISSUED", -1000), entry("grant", "AVAILABLE", 1000),
                               entry("reserve-a", "AVAILABLE", -QUOTE), entry("reserve-a", "RESERVED", QUOTE),
                               entry("reserve-b", "AVAILABLE", -QUOTE), entry("reserve-b", "RESERVED", QUOTE),
                               entry("settle-a", "RESERVED", -QUOTE), entry("settle-a", "CONSUMED", QUOTE),
                               entry("release-b", "RESERVED", -QUOTE), entry("release-b", "AVAILABLE", QUOTE)]
    facts["wallets"] = [{"wallet_id": W, "tenant_id": T, "account_type": "PREPAID", "unit_code": "CREDIT",
                         "available_amount": 1000 - QUOTE, "reserved_amount": 0, "credit_limit_amount": 0,
                         "consumed_amount": QUOTE}]
    facts["lots"] = [{"lot_id": LOT, "wallet_id": W, "tenant_id": T, "original_amount": 1000, "remaining_amount": 1000 - QUOTE,
                      "reserved_amount": 0}]
    facts["credit_reservations"] = [
        {"reservation_id": "res-a", "tenant_id": T, "wallet_id": W, "task_id": A, "quoted_amount": QUOTE,
         "reserved_amount": QUOTE, "settled_amount": QUOTE, "released_amount": 0, "refunded_amount": 0, "state": "SETTLED"},
        {"reservation_id": "res-b", "tenant_id": T, "wallet_id": W, "task_id": B, "quoted_amount": QUOTE,
         "reserved_amount": QUOTE, "settled_amount": 0, "released_amount": QUOTE, "refunded_amount": 0, "state": "RELEASED"}]
    facts["charges"] = [
        {"task_id": A, "tenant_id": T, "quoted_amount": QUOTE, "charge_policy_code": "SUCCESS_ONLY", "final_charge_amount": QUOTE,
         "finalized_at": at(2.3), "settled_outcome": "SUCCEEDED/PROVIDER_SUCCEEDED", "settled_attempt_id": A1},
        {"task_id": B, "tenant_id": T, "quoted_amount": QUOTE, "charge_policy_code": "SUCCESS_ONLY", "final_charge_amount": 0,
         "finalized_at": at(2.4), "settled_outcome": "FAILED/PROVIDER_FAILED", "settled_attempt_id": B2}]
    facts["resource_reservations"] = [
        {"task_id": A, "attempt_id": A1, "tenant_id": T, "resource_key": SHARD, "shard_no": 0, "reserved_units": 1,
         "state": "RELEASED", "fencing_token": 5},
        {"task_id": B, "attempt_id": B2, "tenant_id": T, "resource_key": SHARD, "shard_no": 0, "reserved_units": 1,
         "state": "RELEASED", "fencing_token": 7}]
    facts["shards"] = [{"resource_key": SHARD, "shard_no": 0, "capacity_units": 3, "used_units": 0, "limit_units": 3}]
    facts["idempotency"] = [{"tenant_id": T, "idempotency_key": "k1", "status": "COMPLETED", "task_id": A},
                            {"tenant_id": T, "idempotency_key": "k2", "status": "COMPLETED", "task_id": B}]
    truth = {"jobs": [{"id": "job-a", "idempotency_key": f"{A}:1", "client_request_id": A, "status": "succeeded",
                       "submit_requests": 1, "webhook": {"webhook_id": "msg_a", "type": "job.succeeded", "dropped": False,
                                                         "copies": 2, "delivered": 2, "attempts": 2,
                                                         "answers": ["applied", "duplicate"]}},
                      {"id": "job-b", "idempotency_key": f"{B}:2", "client_request_id": B, "status": "failed",
                       "submit_requests": 1}],
             "accounts": {"acc-1": {"max_concurrency": 30, "current": 0, "peak": 2}}}
    samples = [{"t": 1.0, "shards": [{"resource_key": SHARD, "shard_no": 0, "used_units": 2, "capacity_units": 3,
                                      "active_reserved": 2}], "live_attempts": {"acc-1": 2}}]
    plan = {"params": {"time_scale": 40, "accounts": {"acc-1": 3}, "liveness_bound_s": 30, "breaks": [],
                       "tenants": {"acme": {"tenant_id": T, "charge_policy": "SUCCESS_ONLY"}}},
            "liveness_windows": [[0.5, 3.0]]}
    run = {"seed": 7, "duration_s": 3, "started_at": STARTED, "load_stopped_t": 1.0, "faults_stopped_t": 2.0,
           "settled_t": 3.0, "admitted": 2}
    return {"plan": plan, "history": h.lines, "facts": facts, "truth": truth, "samples": samples, "faults": [], "run": run}


def build(m: dict) -> Run:
    return Run(**copy.deepcopy(m))


def fired(name: str, m: dict) -> list[Violation]:
    return CHECKERS[name](build(m))


def rows(m: dict, table: str, **match) -> list[dict]:
    return [r for r in m["facts"][table] if all(r.get(k) == v for k, v in match.items())]


def one(m: dict, table: str, **match) -> dict:
    (r,) = rows(m, table, **match)
    return r


def assert_fires(name: str, m: dict, words: str) -> Violation:
    found = fired(name, m)
    assert found, f"{name} did not fire"
    assert all(v.checker == name and len(v.excerpt) <= MAX_EXCERPT for v in found)
    hit = [v for v in found if words in v.message]
    assert hit, f"{name} fired, but not about {words!r}: {[v.message for v in found]}"
    return hit[0]


# --- the consistent model --------------------------------------------------------------------------------

def test_the_consistent_model_passes_every_checker():
    found = check_all(build(model()))
    assert set(found) == set(CHECKERS)
    assert {k: [v.message for v in vs] for k, vs in found.items() if vs} == {}


def test_a_checker_that_raises_is_reported_not_passed():
    m = model()
    del m["facts"]["tasks"][0]["state"]
    found = check_all(build(m), ["total-queue"])
    assert [v.message[:14] for v in found["total-queue"]] == ["checker failed"]


# --- admission-idempotency -------------------------------------------------------------------------------

def test_idempotency_fires_on_two_tasks_for_one_key():
    m = model()
    m["facts"]["tasks"].append(task("00000000-0000-0000-0000-0000000000a2", "k1", "SUCCEEDED", A1, 5, 0.5))
    v = assert_fires("admission-idempotency", m, "2 tasks for one idempotency key")
    assert {r["task_id"] for r in v.excerpt} == {A, "00000000-0000-0000-0000-0000000000a2"}


def test_idempotency_fires_when_a_replay_names_another_task():
    m = model()
    m["history"][5]["value"]["task_id"] = B  # the replay of k1 answers B
    assert_fires("admission-idempotency", m, "ok answers name 2 different tasks")


def test_idempotency_fires_when_a_replay_is_not_the_stored_response():
    m = model()
    m["history"][5]["value"]["response"] = "r1-changed"
    assert_fires("admission-idempotency", m, "different answers to one request body")


def test_idempotency_fires_when_another_body_is_admitted_under_a_used_key():
    m = model()
    m["history"][7].update(type="ok", value={**m["history"][7]["value"], "status": 202, "task_id": A, "code": None,
                                             "response": "r3"})
    assert_fires("admission-idempotency", m, "2 different bodies were all admitted")


def test_idempotency_fires_when_another_body_is_refused_with_the_wrong_status():
    m = model()
    m["history"][7]["value"].update(status=409, code="IDEMPOTENCY_IN_PROGRESS")
    assert_fires("admission-idempotency", m, "not 422")


def test_idempotency_allows_another_body_racing_the_first_request():
    """A different body invoked before the first answer was recorded may be refused otherwise (a
    rate limit is taken before the key is claimed)."""
    m = model()
    m["history"][6]["t"] = 0.05  # invoked while k1's first request was in flight
    m["history"][7]["value"].update(status=429, code="REJECT_USER_RATE_LIMIT")
    assert fired("admission-idempotency", m) == []


# --- total-queue -------------------------------------------------------------------------------------

def test_total_queue_fires_on_a_lost_task():
    m = model()
    m["facts"]["tasks"] = [t for t in m["facts"]["tasks"] if t["task_id"] != B]
    v = assert_fires("total-queue", m, f"task {B} was admitted but is not in the database")
    assert any(line.get("type") == "ok" for line in v.excerpt)


def test_total_queue_counts_an_unknown_outcome_whose_key_has_a_task():
    m = model()
    one(m, "tasks", task_id=B).update(state="RUNNING")
    del m["facts"]["outbox"][3]
    m["history"][3].update(type="info", value={**m["history"][3]["value"], "status": None, "task_id": None})
    assert_fires("total-queue", m, f"task {B} never ended: RUNNING")


def test_total_queue_fires_on_manual_review_without_a_reason():
    m = model()
    one(m, "tasks", task_id=B).update(state="MANUAL_REVIEW")
    del m["facts"]["outbox"][3]
    assert_fires("total-queue", m, "MANUAL_REVIEW without a reason")
    one(m, "tasks", task_id=B)["error_code"] = "SUBMIT_UNKNOWN_TIMEOUT"
    assert fired("total-queue", m) == []


def test_total_queue_fires_on_two_terminal_events():
    m = model()
    m["facts"]["outbox"].append(event("TaskFailed", A, 2.5, attempt_id=A1))
    assert_fires("total-queue", m, "has terminal events ['TaskFailed', 'TaskSucceeded']")


def test_total_queue_fires_on_a_terminal_event_of_another_state():
    m = model()
    m["facts"]["outbox"][2]["event_type"] = "TaskCancelled"
    assert_fires("total-queue", m, "expected ['TaskSucceeded']")


def test_total_queue_fires_on_a_task_no_client_submitted():
    m = model()
    m["facts"]["tasks"].append(task("00000000-0000-0000-0000-0000000000cc", "k-ghost", "QUEUED", None, None, 1.0))
    assert_fires("total-queue", m, "'k-ghost' was never submitted by a client")


def test_total_queue_fires_on_a_task_of_a_refused_request():
    m = model()
    m["history"] += History().op("client-3", "submit", 2.0, 2.1, "fail", key="k-refused", body="b9", status=429).lines
    for i, line in enumerate(m["history"]):
        line["i"] = i
    m["facts"]["tasks"].append(task("00000000-0000-0000-0000-0000000000dd", "k-refused", "CANCELLED", None, None, 2.05))
    m["facts"]["outbox"].append(event("TaskCancelled", "00000000-0000-0000-0000-0000000000dd", 2.2))
    assert_fires("total-queue", m, "every request with the key was refused")


# --- one-provider-job ----------------------------------------------------------------------------------

def test_one_job_allows_a_second_job_after_a_confirmed_absence():
    m = model()
    m["truth"]["jobs"].append({"id": "job-b-late", "idempotency_key": f"{B}:1", "client_request_id": B, "status": "cancelled",
                               "submit_requests": 1})
    assert fired("one-provider-job", m) == []


def test_one_job_fires_on_two_jobs_for_one_task():
    m = model()
    m["truth"]["jobs"].append({"id": "job-a2", "idempotency_key": f"{A}:2", "client_request_id": A, "status": "succeeded",
                               "submit_requests": 1})
    v = assert_fires("one-provider-job", m, f"task {A}: 2 provider jobs, 0 absences confirmed")
    assert {j["id"] for j in v.excerpt} == {"job-a", "job-a2"}


def test_one_job_fires_on_two_jobs_for_one_key():
    m = model()
    m["truth"]["jobs"].append({"id": "job-b-dup", "idempotency_key": f"{B}:2", "client_request_id": B, "status": "failed",
                               "submit_requests": 1})
    assert_fires("one-provider-job", m, "2 jobs for idempotency key")


# --- capacity --------------------------------------------------------------------------------------------

def test_capacity_fires_on_a_peak_over_max_concurrency():
    m = model()
    m["truth"]["accounts"]["acc-1"]["peak"] = 4
    assert_fires("capacity", m, "acc-1 ran 4 jobs at once; max_concurrency 3")


def _late_job_over_the_limit(m: dict, *, contained: bool) -> None:
    """Three jobs on acc-1 at once (its limit is 3) plus a replaced attempt's late submit among them."""
    t = "2026-12-01T10:00:0{}.000Z"
    jobs = [{"id": f"job-{i}", "account_id": "acc-1", "idempotency_key": f"k{i}", "client_request_id": f"c{i}",
             "status": "succeeded", "created_at": t.format(1), "finished_at": t.format(5), "cancel_requested_at": None}
            for i in range(3)]
    late = {"id": "job-late", "account_id": "acc-1", "idempotency_key": f"{A}:1", "client_request_id": A, "status": "cancelled",
            "created_at": "2026-12-01T10:00:02.000Z", "finished_at": "2026-12-01T10:00:02.005Z",
            "cancel_requested_at": "2026-12-01T10:00:02.005Z"}
    m["truth"]["jobs"] = jobs + [late]
    m["truth"]["accounts"]["acc-1"]["peak"] = 4
    if contained:
        m["facts"]["orphans"] = [{"provider_job_id": "job-late", "reason": "STALE_SUBMIT"}]


def test_capacity_counts_a_contained_late_submit_apart():
    m = model()
    _late_job_over_the_limit(m, contained=True)
    assert fired("capacity", m) == []


def test_capacity_fires_on_a_late_submit_the_platform_did_not_contain():
    m = model()
    _late_job_over_the_limit(m, contained=False)
    assert_fires("capacity", m, "acc-1 ran 4 jobs at once; max_concurrency 3")


def test_capacity_fires_on_a_sample_whose_counter_drifted():
    m = model()
    m["samples"][0]["shards"][0]["active_reserved"] = 1
    assert_fires("capacity", m, "t=1.0: shard")


def test_capacity_fires_on_a_counter_over_capacity():
    m = model()
    m["samples"][0]["shards"][0].update(used_units=4, active_reserved=4)
    assert_fires("capacity", m, "used 4 outside [0, 3]")


def test_capacity_fires_on_a_final_counter_without_its_reservation():
    m = model()
    m["facts"]["shards"][0]["used_units"] = 1
    assert_fires("capacity", m, "at the end: shard")


def test_capacity_fires_on_a_negative_balance():
    m = model()
    m["facts"]["lots"][0]["remaining_amount"] = -5
    assert_fires("capacity", m, "has a negative balance")


# --- fencing ---------------------------------------------------------------------------------------------

def test_fencing_fires_on_a_token_that_does_not_increase():
    m = model()
    one(m, "attempts", attempt_id=B2)["fencing_token"] = 6
    one(m, "tasks", task_id=B)["current_fencing_token"] = 6
    one(m, "resource_reservations", attempt_id=B2)["fencing_token"] = 6
    assert_fires("fencing", m, "attempt 2 has token 6, not above attempt 1's 6")


def test_fencing_fires_when_the_task_token_is_not_its_attempts():
    m = model()
    one(m, "tasks", task_id=A)["current_fencing_token"] = 4
    assert_fires("fencing", m, "token 4, its current attempt's is 5")


def test_fencing_fires_on_two_live_attempts():
    m = model()
    one(m, "attempts", attempt_id=B1)["state"] = "SUBMIT_UNKNOWN"
    one(m, "attempts", attempt_id=B2)["state"] = "RUNNING"
    assert_fires("fencing", m, "2 attempts live at once")
    assert_fires("fencing", m, "a replaced attempt is still live")


def test_fencing_fires_when_a_replaced_attempt_ended_the_task():
    m = model()
    m["facts"]["outbox"][3]["payload"]["attempt_id"] = B1
    one(m, "charges", task_id=B)["settled_attempt_id"] = B1
    assert_fires("fencing", m, f"task {B} ended by replaced attempt {B1}")
    assert_fires("fencing", m, f"settled for replaced attempt {B1}")


def test_fencing_fires_on_a_reservation_with_a_stale_token():
    m = model()
    one(m, "resource_reservations", attempt_id=B2)["fencing_token"] = 6
    assert_fires("fencing", m, "has token 6, the attempt's is 7")


# --- transitions -----------------------------------------------------------------------------------------

def test_transitions_fires_when_a_terminal_state_is_left():
    m = model()
    m["history"] += History().op("client-1", "get", 3.0, 3.1, task_id=A, status=200, state="RUNNING").lines
    for i, line in enumerate(m["history"]):
        line["i"] = i
    v = assert_fires("transitions", m, f"task {A}: left terminal state SUCCEEDED -> RUNNING")
    assert [line["t"] for line in v.excerpt] == [2.5, 2.6, 3.0, 3.1]


def test_transitions_ignores_reads_that_overlap():
    """Two reads in flight at once may see the states in either order."""
    m = model()
    m["history"] += History().op("client-3", "get", 2.4, 2.8, task_id=A, status=200, state="RUNNING").lines
    for i, line in enumerate(m["history"]):
        line["i"] = i
    assert fired("transitions", m) == []


def test_transitions_fires_when_the_end_is_not_the_terminal_state_observed():
    m = model()
    one(m, "tasks", task_id=B)["state"] = "CANCELLED"
    assert_fires("transitions", m, "observed terminal FAILED, but it ended CANCELLED")


def test_transitions_fires_on_an_unknown_state():
    m = model()
    m["history"][9]["value"]["state"] = "HALF_DONE"
    assert_fires("transitions", m, "unknown state HALF_DONE")


def test_transitions_fires_on_an_illegal_transition(monkeypatch):
    """With today's table every non-terminal state reaches every other (through QUEUED and
    MANUAL_REVIEW); with a stricter table, a read that goes backwards fires."""
    reach = {**checkers.REACHABLE, "SUCCEEDED": frozenset(), "RUNNING": frozenset({"SUCCEEDED"})}
    monkeypatch.setattr(checkers, "REACHABLE", reach)
    m = model()
    m["history"] += History().op("client-1", "get", 1.5, 1.6, task_id=A, status=200, state="QUEUED").lines
    for i, line in enumerate(m["history"]):
        line["i"] = i
    assert_fires("transitions", m, "illegal transition RUNNING -> QUEUED")


# --- ledger ----------------------------------------------------------------------------------------------

def test_ledger_fires_on_an_unbalanced_transaction():
    m = model()
    one(m, "ledger_entries", ledger_txn_id="settle-a", bucket="CONSUMED")["amount_delta"] = QUOTE + 1
    one(m, "wallets", wallet_id=W)["consumed_amount"] = QUOTE + 1
    assert_fires("ledger", m, "ledger transaction settle-a does not balance: {'CREDIT': 1}")
    assert_fires("ledger", m, "money is not conserved")


def test_ledger_fires_when_the_snapshot_is_not_the_aggregate():
    m = model()
    one(m, "wallets", wallet_id=W)["reserved_amount"] = QUOTE
    v = assert_fires("ledger", m, f"wallet {W}: snapshot differs")
    assert "reserved_amount" in v.message


def test_ledger_fires_when_the_lots_are_not_the_snapshot():
    m = model()
    m["facts"]["lots"][0]["remaining_amount"] = 1000
    assert_fires("ledger", m, "available_amount vs lots remaining")


def test_ledger_counts_allowances_as_reserved():
    m = model()
    m["facts"]["allowances"] = [{"wallet_id": W, "slot": 0, "lot_id": LOT, "tenant_id": T, "amount": 10}]
    assert_fires("ledger", m, "reserved vs open reservations")
    m["facts"]["ledger_transactions"].append(txn("carve", "RESERVE"))
    m["facts"]["ledger_entries"] += [entry("carve", "AVAILABLE", -10), entry("carve", "RESERVED", 10)]
    one(m, "wallets", wallet_id=W).update(available_amount=1000 - QUOTE - 10, reserved_amount=10)
    m["facts"]["lots"][0].update(remaining_amount=1000 - QUOTE - 10, reserved_amount=10)
    assert fired("ledger", m) == []


# --- charged-once ---------------------------------------------------------------------------------------

def test_charged_once_fires_on_a_double_charge():
    m = model()
    m["facts"]["ledger_transactions"].append(txn("settle-a-again", "SETTLE", A, "res-a"))
    m["facts"]["ledger_entries"] += [entry("settle-a-again", "RESERVED", -QUOTE), entry("settle-a-again", "CONSUMED", QUOTE)]
    assert_fires("charged-once", m, f"task {A} charged 2 times (140 in all)")


def test_charged_once_fires_on_a_failure_charged_under_success_only():
    m = model()
    release = one(m, "ledger_transactions", ledger_txn_id="release-b")
    release["event_type"] = "SETTLE"
    one(m, "ledger_entries", ledger_txn_id="release-b", bucket="AVAILABLE")["bucket"] = "CONSUMED"
    one(m, "charges", task_id=B)["final_charge_amount"] = QUOTE
    one(m, "credit_reservations", task_id=B).update(settled_amount=QUOTE, released_amount=0, state="SETTLED")
    assert_fires("charged-once", m, "charged 70, the locked policy charges [0]")


def test_charged_once_fires_on_a_success_charged_off_its_quote():
    m = model()
    one(m, "ledger_entries", ledger_txn_id="settle-a", bucket="CONSUMED")["amount_delta"] = 50
    one(m, "ledger_entries", ledger_txn_id="settle-a", bucket="RESERVED")["amount_delta"] = -50
    one(m, "charges", task_id=A)["final_charge_amount"] = 50
    assert_fires("charged-once", m, "charged 50, the locked policy charges [70]")


def test_charged_once_allows_the_cancel_fee_the_provider_billed():
    """SUCCESS_ONLY passes a cancellation the provider billed on as a fee (20 % of the quote)."""
    m = model()
    one(m, "tasks", task_id=A)["state"] = "CANCELLED"
    m["facts"]["outbox"][2].update(event_type="TaskCancelled")
    m["facts"]["outbox"][2]["payload"].update(state="CANCELLED", provider_charged=True)
    fee = 14
    one(m, "charges", task_id=A).update(final_charge_amount=fee, settled_outcome="CANCELLED/PROVIDER_RUNNING")
    one(m, "ledger_entries", ledger_txn_id="settle-a", bucket="CONSUMED")["amount_delta"] = fee
    one(m, "ledger_entries", ledger_txn_id="settle-a", bucket="RESERVED")["amount_delta"] = -fee
    m["facts"]["ledger_transactions"].append(txn("release-a", "RELEASE", A, "res-a"))
    m["facts"]["ledger_entries"] += [entry("release-a", "RESERVED", fee - QUOTE), entry("release-a", "AVAILABLE", QUOTE - fee)]
    one(m, "credit_reservations", task_id=A).update(settled_amount=fee, released_amount=QUOTE - fee)
    one(m, "wallets", wallet_id=W).update(available_amount=1000 - fee, consumed_amount=fee)
    m["facts"]["lots"][0]["remaining_amount"] = 1000 - fee
    assert fired("charged-once", m) == []
    m["facts"]["outbox"][2]["payload"]["provider_charged"] = False  # not billed: no fee
    assert_fires("charged-once", m, "charged 14, the locked policy charges [0]")


def test_charged_once_fires_on_a_reservation_never_released():
    m = model()
    one(m, "credit_reservations", task_id=B).update(released_amount=0, state="ACTIVE")
    m["facts"]["ledger_transactions"] = [t for t in m["facts"]["ledger_transactions"] if t["ledger_txn_id"] != "release-b"]
    m["facts"]["ledger_entries"] = [e for e in m["facts"]["ledger_entries"] if e["ledger_txn_id"] != "release-b"]
    assert_fires("charged-once", m, f"task {B}: credit reservation left ACTIVE")


def test_charged_once_fires_on_a_reservation_released_twice():
    m = model()
    m["facts"]["ledger_transactions"].append(txn("release-b-again", "RELEASE", B, "res-b"))
    m["facts"]["ledger_entries"] += [entry("release-b-again", "RESERVED", -QUOTE), entry("release-b-again", "AVAILABLE", QUOTE)]
    assert_fires("charged-once", m, "reservation closed by {'RELEASE': 2}, not once")


def test_charged_once_fires_on_a_terminal_task_never_settled():
    m = model()
    one(m, "charges", task_id=B).update(finalized_at=None, final_charge_amount=None, settled_outcome=None)
    assert_fires("charged-once", m, f"task {B} is FAILED but was never settled")


def test_charged_once_fires_on_capacity_held_by_a_terminal_task():
    m = model()
    one(m, "resource_reservations", task_id=A)["state"] = "ACTIVE"
    assert_fires("charged-once", m, "holds ACTIVE resource reservations")


# --- liveness --------------------------------------------------------------------------------------------

def test_liveness_fires_on_a_run_that_never_settled():
    m = model()
    m["run"]["settled_t"] = None
    v = assert_fires("liveness", m, "never settled")
    assert v.excerpt[0]["seed"] == 7


def test_liveness_fires_on_settling_past_the_bound():
    m = model()
    m["run"]["settled_t"] = 40.0
    assert_fires("liveness", m, "settled 38.0 s after the faults stopped; bound 30 s")


def test_liveness_fires_on_a_window_without_progress():
    m = model()
    m["plan"]["liveness_windows"] = [[0.5, 2.0]]  # both tasks pending, none ended before 2.05 s
    assert_fires("liveness", m, "no task reached a terminal state in liveness window [0.5, 2.0]")


def test_liveness_skips_a_window_with_nothing_pending():
    m = model()
    m["plan"]["liveness_windows"] = [[2.2, 2.9]]
    assert fired("liveness", m) == []
    del m["plan"]["liveness_windows"]
    assert fired("liveness", m) == []


# --- rescues ---------------------------------------------------------------------------------------------

def test_rescues_fires_on_a_rescue_in_a_quiet_run():
    m = model()
    one(m, "attempts", attempt_id=A1)["recoveries"] = 1
    assert_fires("rescues", m, f"attempt {A1} of task {A} was rescued 1 times")


def test_rescues_allows_a_rescue_when_an_execution_may_have_been_lost():
    m = model()
    one(m, "attempts", attempt_id=A1)["recoveries"] = 1
    m["faults"] = [{"t": 1.0, "kind": "kill", "target": "dispatcher-0", "detail": {}}]
    assert fired("rescues", m) == []
    m["faults"] = []
    m["plan"]["failpoints"] = {"after-claim-before-dispatch": 0.01}
    assert fired("rescues", m) == []


# --- webhooks --------------------------------------------------------------------------------------------

def test_webhooks_fires_on_a_webhook_applied_twice():
    m = model()
    m["truth"]["jobs"][0]["webhook"]["answers"] = ["applied", "applied"]
    v = assert_fires("webhooks", m, "webhook msg_a (job.succeeded) of job job-a was applied 2 times")
    assert v.excerpt[0]["client_request_id"] == A


# --- the excerpt and the cap ------------------------------------------------------------------------------

def test_violations_are_capped_and_counted():
    m = model()
    m["truth"]["jobs"] += [{"id": f"job-x{i}", "idempotency_key": f"dup-{i}", "client_request_id": f"t{i}", "status": "x"}
                           for i in range(2 * checkers.MAX_VIOLATIONS) for _ in range(2)]
    found = fired("one-provider-job", m)
    assert len(found) == checkers.MAX_VIOLATIONS + 1
    assert found[-1].message.startswith(f"... and {2 * 2 * checkers.MAX_VIOLATIONS - checkers.MAX_VIOLATIONS} more")
    assert "[one-provider-job]" in found[0].render()


# --- records: the run directory ---------------------------------------------------------------------------

def write_run(tmp_path, m: dict, *, skip: tuple[str, ...] = ()) -> None:
    files = {"plan.json": m["plan"], "truth.json": m["truth"], "run.json": m["run"]}
    for name, doc in files.items():
        if name not in skip:
            (tmp_path / name).write_text(json.dumps(doc))
    for name, lines in (("history.jsonl", m["history"]), ("samples.jsonl", m["samples"]), ("faults.jsonl", m["faults"])):
        if name not in skip:
            (tmp_path / name).write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "facts").mkdir()
    for name, rs in m["facts"].items():
        if f"facts/{name}.json" not in skip:
            (tmp_path / "facts" / f"{name}.json").write_text(json.dumps(rs))


def test_a_run_directory_loads_and_checks_clean(tmp_path):
    write_run(tmp_path, model(), skip=("samples.jsonl", "faults.jsonl", "facts/allowances.json"))
    run = Run.load(tmp_path)
    assert run.samples == [] and run.faults == [] and "allowances" not in run.facts
    assert [op.type for op in run.ops] == ["ok", "ok", "ok", "fail", "ok", "ok", "ok", "ok"]
    assert all(vs == [] for vs in check_all(run).values())


@pytest.mark.parametrize("missing", ["plan.json", "history.jsonl", "facts/tasks.json", "truth.json", "run.json"])
def test_a_missing_required_file_is_named(tmp_path, missing):
    write_run(tmp_path, model(), skip=(missing,))
    with pytest.raises(RunFileMissing, match=missing.replace(".", r"\.")):
        Run.load(tmp_path)


def test_a_history_cut_off_mid_line_loads_a_bad_line_inside_does_not(tmp_path):
    write_run(tmp_path, model())
    hist = tmp_path / "history.jsonl"
    text = hist.read_text()
    hist.write_text(text + '{"i": 99, "process": "client-1", "ty')
    assert len(Run.load(tmp_path).history) == len(model()["history"])
    hist.write_text('{"i": 0, "ty\n' + text)
    with pytest.raises(RunFileMalformed, match="history.jsonl:1"):
        Run.load(tmp_path)


def test_pending_ops_and_tenant_names():
    h = History().op("client-1", "submit", 0.0, None, key="k", body="b")
    h.op("client-2", "get", 0.1, 0.2, task_id=A, state="QUEUED")
    run = Run(plan=model()["plan"], history=h.lines)
    ops = run.ops
    assert [(op.type, op.t1) for op in ops] == [("pending", float("inf")), ("ok", 0.2)]
    assert run.tenant_id("acme") == T and run.tenant_id("other") == "other"
    assert set(FACT_FILES) >= OPTIONAL_FACTS


def test_column_values_become_json():
    from datetime import UTC, datetime, timedelta
    from decimal import Decimal
    from uuid import UUID

    from aivedio_tools.chaos.facts import json_safe

    when = datetime(2025, 1, 1, tzinfo=UTC)
    row = {"id": UUID(int=1), "cost": Decimal("0.250"), "at": when, "raw": b"\x00\x01", "doc": {"nested": [Decimal(1)]},
           "n": 3, "gone": None, "lag": timedelta(seconds=2)}
    assert json.loads(json.dumps({k: json_safe(v) for k, v in row.items()})) == {
        "id": "00000000-0000-0000-0000-000000000001", "cost": "0.250", "at": "2025-01-01T00:00:00+00:00", "raw": "AAE=",
        "doc": {"nested": ["1"]}, "n": 3, "gone": None, "lag": 2.0}


def test_the_verdict_names_the_seed_the_checker_and_the_excerpt():
    clean = checkers.verdict(build(model()))
    assert clean == {"ok": True, "seed": 7, "checked": list(CHECKERS), "violations": {}}
    assert checkers.describe_verdict(clean) == [f"seed 7: ok, {len(CHECKERS)} checkers silent"]
    m = model()
    m["truth"]["accounts"]["acc-1"]["peak"] = 4
    v = json.loads(json.dumps(checkers.verdict(build(m))))  # JSON as it is written to verdict.json
    assert v["ok"] is False and list(v["violations"]) == ["capacity"]
    lines = checkers.describe_verdict(v)
    assert lines[0].startswith("seed 7: 1 violations of capacity")
    assert lines[1].startswith("seed 7 [capacity] provider account acc-1 ran 4 jobs at once") and '"peak": 4' in lines[2]
