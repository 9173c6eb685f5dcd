"""The chaos suite's checkers: each a pure function of a recorded run (aivedio_tools.chaos.records.Run:
history, facts, the provider's truth, samples, run.json), so `aivedio chaos check DIR` re-checks a
run offline. Each returns Violations; a Violation names its checker and carries the smallest excerpt
(history lines, fact rows, truth jobs; at most MAX_EXCERPT records) that shows it.

They generalise the end-of-run checks of tests/reliability/test_attempt_invariants.py. The promises:

- admission-idempotency: one task per (tenant, idempotency key); every ok answer under a key names
  that task, and answers to the same body are byte-identical (a replay returns the stored response);
  a different body under a key already answered is refused with 422, never admitted.
- total-queue: every task a client was told of (an ok submit, or an info submit whose key has a
  task) exists and ends terminal, or in MANUAL_REVIEW with a reason; each terminal task has exactly
  one terminal outbox event, of its state, and a task that is not terminal has none; no task exists
  that no client request accounts for.
- one-provider-job: at most one provider job per task, plus one per attempt whose absence at the
  provider was confirmed (ABSENT_CONFIRMED); never two jobs for one idempotency key.
- capacity: no provider account ran more jobs at once than its max_concurrency (plan params); in
  every sample and at the end, each shard's used_units equals its ACTIVE reservations and lies in
  [0, capacity]; no balance is negative (a POSTPAID wallet's available down to -credit_limit).
- fencing: a task's attempts carry strictly increasing fencing tokens; the task's token is its
  current attempt's; at most one attempt is live, and only the current one; the attempt whose result
  ended the task (its terminal event, its settlement) is the current one; a reservation carries its
  attempt's token.
- transitions: the states clients observed follow the task state machine (aivedio.tasks.TRANSITIONS:
  each later observation reachable from an earlier one, since reads miss steps), a terminal state
  once observed never changes, and the final state is every terminal state observed. (Today every
  non-terminal state reaches every other through QUEUED and MANUAL_REVIEW, so what reads can catch
  is an unknown state and a terminal state left; a stricter table tightens this on its own.)
- ledger: every transaction sums to zero per unit; each wallet's snapshot equals its entries'
  aggregate per bucket, and its lots' and reservations' totals, as the wallet check compares them
  (aivedio.invariants: the same promises, over the recorded rows); the money of each unit sums to
  zero over all entries.
- charged-once: a terminal task is settled once: at most one SETTLE, charging what its locked policy
  and quote decide for its outcome (billing.policies.decide; a success at the quote, a failure under
  SUCCESS_ONLY nothing); its reservation is closed with settled + released = reserved by at most one
  SETTLE and one RELEASE, nothing left RESERVED; no ACTIVE resource reservation is left on it.
- liveness: the run settled, within liveness_bound_s of the faults stopping; in every liveness
  window of the plan where work was pending, some task reached a terminal state.
- rescues: the lease scanner takes over only executions that were lost. In a run where nothing
  could lose one (no fault injected, no failpoint armed), no attempt was rescued (recoveries 0).
- webhooks: a webhook-id is applied once; every other copy is answered "duplicate" (the provider
  simulator's truth records the receiver's answer to each copy it delivered).

States, buckets and event types come from the modules that own them (aivedio.tasks,
aivedio.attempts.lifecycle, aivedio.billing); only the facts' own vocabulary is named here."""
from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from itertools import pairwise
from typing import Any

from aivedio import invariants
from aivedio.billing import policies
from aivedio.tasks import ATTEMPT_LIVE, STATES, TERMINAL, TRANSITIONS
from aivedio.terminal_events import TERMINAL_EVENT
from aivedio_tools.chaos.records import FAIL, OK, Op, Run

MAX_EXCERPT = 10  # records in one violation's excerpt
MAX_VIOLATIONS = 25  # per checker; the rest are counted in one last violation

MANUAL_REVIEW = "MANUAL_REVIEW"
ABSENT_CONFIRMED = "ABSENT_CONFIRMED"  # task_attempt.state: the provider has no job for its key
TERMINAL_EVENTS = frozenset(TERMINAL_EVENT.values())
SUBMIT, GET = "submit", "get"
KEY_REUSED_STATUS = 422  # a different body under a used Idempotency-Key (docs/tenant-api.md)
SETTLE, RELEASE = "SETTLE", "RELEASE"  # ledger_transaction.event_type
RESERVED, CONSUMED = "RESERVED", "CONSUMED"  # ledger_entry.bucket
ACTIVE = "ACTIVE"  # resource_reservation.state, credit_reservation.state
COMPLETED = "COMPLETED"  # idempotency_record.status: the record answers with its stored response


@dataclass(frozen=True)
class Violation:
    checker: str
    message: str
    excerpt: list[dict[str, Any]] = field(default_factory=list)

    def render(self) -> str:
        return "\n".join([f"[{self.checker}] {self.message}"]
                         + [f"    {json.dumps(r, sort_keys=True, default=str)}" for r in self.excerpt])


class _Found:
    """A checker's violations, at most MAX_VIOLATIONS of them (then one that counts the rest)."""

    def __init__(self, checker: str):
        self.checker, self.out, self.more = checker, [], 0

    def add(self, message: str, *records: dict[str, Any] | Iterable[dict[str, Any]]) -> None:
        if len(self.out) >= MAX_VIOLATIONS:
            self.more += 1
            return
        flat: list[dict[str, Any]] = []
        for r in records:
            flat.extend([r] if isinstance(r, dict) else r)
        self.out.append(Violation(self.checker, message, flat[:MAX_EXCERPT]))

    def result(self) -> list[Violation]:
        if self.more:
            return self.out + [Violation(self.checker, f"... and {self.more} more violations of {self.checker}")]
        return self.out


# --- small views of the facts -------------------------------------------------------------------------

def _by(rows: Iterable[dict[str, Any]], *cols: str) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        out[r[cols[0]] if len(cols) == 1 else tuple(r[c] for c in cols)].append(r)
    return out


def _tasks(run: Run) -> dict[str, dict[str, Any]]:
    return {r["task_id"]: r for r in run.rows("tasks")}


def _task_keys(run: Run) -> dict[tuple[str, str], list[dict[str, Any]]]:
    return _by(run.rows("tasks"), "tenant_id", "idempotency_key")


def _submits(run: Run) -> dict[tuple[str | None, str | None], list[Op]]:
    out: dict[tuple[str | None, str | None], list[Op]] = defaultdict(list)
    for op in run.ops:
        if op.f == SUBMIT:
            out[(run.tenant_id(op.tenant), op.key)].append(op)
    return out


def _terminal_events(run: Run) -> dict[str, list[dict[str, Any]]]:
    return _by((e for e in run.rows("outbox") if e["event_type"] in TERMINAL_EVENTS), "aggregate_id")


def _ts(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


# --- admission-idempotency ----------------------------------------------------------------------------

def check_admission_idempotency(run: Run) -> list[Violation]:
    found = _Found("admission-idempotency")
    tasks_by_key = _task_keys(run)
    for (tenant, key), rows in tasks_by_key.items():
        if len(rows) > 1:
            found.add(f"tenant {tenant} key {key!r}: {len(rows)} tasks for one idempotency key", rows)
    for (tenant, key), ops in _submits(run).items():
        oks = [op for op in ops if op.type == OK]
        task = (tasks_by_key.get((tenant, key)) or [None])[0]
        named = {op.task_id for op in oks}
        if len(named) > 1:
            found.add(f"tenant {tenant} key {key!r}: ok answers name {len(named)} different tasks",
                      [next(op.done for op in oks if op.task_id == t) for t in sorted(named, key=str)])
        elif named and task is not None and task["task_id"] not in named:
            found.add(f"tenant {tenant} key {key!r}: answered task {next(iter(named))} but the key's task is {task['task_id']}",
                      oks[0].lines(), [task])
        bodies = {op.body for op in oks}
        if len(bodies) > 1:
            found.add(f"tenant {tenant} key {key!r}: requests with {len(bodies)} different bodies were all admitted",
                      [next(op.invoke for op in oks if op.body == b) for b in sorted(bodies, key=str)])
        for body in bodies:
            same = [op for op in oks if op.body == body]
            answers = {(op.value.get("status"), op.value.get("response")) for op in same}
            if len(answers) > 1:
                found.add(f"tenant {tenant} key {key!r}: {len(answers)} different answers to one request body "
                          f"(a replay returns the stored response)", [op.done for op in same][:MAX_EXCERPT])
        if not oks:
            continue
        first = min(oks, key=lambda op: op.t1)
        for op in ops:
            if op.type == FAIL and op.body != first.body and op.t0 > first.t1 \
                    and op.value.get("status") != KEY_REUSED_STATUS:
                found.add(f"tenant {tenant} key {key!r}: a different body under a key already admitted answered "
                          f"{op.value.get('status')} {op.value.get('code')}, not {KEY_REUSED_STATUS}", first.done, op.lines())
    for rec in run.rows("idempotency"):
        task = (tasks_by_key.get((rec["tenant_id"], rec["idempotency_key"])) or [None])[0]
        if rec["status"] == COMPLETED and task is not None and rec["task_id"] != task["task_id"]:
            found.add(f"idempotency record of key {rec['idempotency_key']!r} answers task {rec['task_id']}, "
                      f"the key's task is {task['task_id']}", rec, task)
    return found.result()


# --- total-queue ----------------------------------------------------------------------------------------

def _admitted(run: Run) -> dict[str, list[dict[str, Any]]]:
    """task_id -> the history lines that tell a client of it: ok submits naming it, and info
    submits (outcome unknown) whose key has it."""
    tasks_by_key = _task_keys(run)
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for (tenant, key), ops in _submits(run).items():
        for op in ops:
            if op.type == OK and op.task_id:
                out[op.task_id] += op.lines()
            elif op.type not in (OK, FAIL):
                for t in tasks_by_key.get((tenant, key), []):
                    out[t["task_id"]] += op.lines()
    return out


def check_total_queue(run: Run) -> list[Violation]:
    found = _Found("total-queue")
    tasks = _tasks(run)
    for task_id, lines in _admitted(run).items():
        t = tasks.get(task_id)
        if t is None:
            found.add(f"task {task_id} was admitted but is not in the database (lost)", lines)
        elif t["state"] == MANUAL_REVIEW and not t.get("error_code"):
            found.add(f"task {task_id} is in MANUAL_REVIEW without a reason", t)
        elif t["state"] not in TERMINAL and t["state"] != MANUAL_REVIEW:
            found.add(f"task {task_id} never ended: {t['state']}", lines[:2], [t])
    submits = _submits(run)
    for (tenant, key), rows in _task_keys(run).items():
        ops = submits.get((tenant, key), [])
        if not ops:
            found.add(f"task of tenant {tenant} key {key!r} was never submitted by a client", rows)
        elif all(op.type == FAIL for op in ops):
            found.add(f"task of tenant {tenant} key {key!r} exists though every request with the key was refused",
                      rows, [op.done for op in ops])
    events = _terminal_events(run)
    for task_id, t in tasks.items():
        want = [TERMINAL_EVENT[t["state"]]] if t["state"] in TERMINAL else []
        got = sorted(e["event_type"] for e in events.get(task_id, []))
        if got != want:
            found.add(f"task {task_id} ({t['state']}) has terminal events {got}, expected {want}",
                      [t], events.get(task_id, []))
    for task_id, evs in events.items():
        if task_id not in tasks:
            found.add(f"terminal events for task {task_id}, which does not exist", evs)
    return found.result()


# --- one-provider-job -----------------------------------------------------------------------------------

def check_one_provider_job(run: Run) -> list[Violation]:
    found = _Found("one-provider-job")
    jobs = run.jobs()
    attempts = _by(run.rows("attempts"), "task_id")
    for task_id, js in _by(jobs, "client_request_id").items():
        confirmed = [a for a in attempts.get(task_id, []) if a["state"] == ABSENT_CONFIRMED]
        if len(js) > 1 + len(confirmed):
            found.add(f"task {task_id}: {len(js)} provider jobs, {len(confirmed)} absences confirmed", js, confirmed)
    for key, js in _by(jobs, "idempotency_key").items():
        if len(js) > 1:
            found.add(f"provider created {len(js)} jobs for idempotency key {key!r}", js)
    return found.result()


# --- capacity -------------------------------------------------------------------------------------------

# A replaced attempt's worker paused at the last instant before its send sends late, and the provider
# protocol has no deadline on a submit: the platform refuses the answer, records the job as a
# STALE_SUBMIT orphan and cancels it (the fencing checker holds it to that). Such a job, cancelled
# within this long of its creation, is counted apart from the account's concurrency: the answer may
# come only after the provider's accept-then-timeout hold (1.5 submit timeouts), then the cancel.
CONTAINED_WITHIN_S = 5.0


def _epoch(value: str | None) -> float | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() if value else None


def _contained_late_jobs(run: Run) -> set[str]:
    stale = {o["provider_job_id"] for o in run.rows("orphans") if o.get("reason") == "STALE_SUBMIT"}
    out = set()
    for j in run.jobs():
        created, cancelled = _epoch(j.get("created_at")), _epoch(j.get("cancel_requested_at"))
        if j["id"] in stale and cancelled is not None and created is not None and cancelled - created <= CONTAINED_WITHIN_S:
            out.add(j["id"])
    return out


def _peak_without(run: Run, account: str, left_out: set[str]) -> int:
    """The account's most jobs at once (created to finished, as the simulator counts them), from its
    jobs' own times, leaving out `left_out`; an end and a start at one instant free the slot first."""
    edges = []
    for j in run.jobs():
        if j.get("account_id") != account or j["id"] in left_out:
            continue
        start, end = _epoch(j.get("created_at")), _epoch(j.get("finished_at"))
        edges += [(start, 1), (end if end is not None else float("inf"), -1)]
    live = peak = 0
    for _, d in sorted(edges):
        live += d
        peak = max(peak, live)
    return peak


def check_capacity(run: Run) -> list[Violation]:
    found = _Found("capacity")
    limits = run.params.get("accounts") or {}
    contained = None
    for acct, a in run.provider_accounts().items():
        if acct in limits and a["peak"] > limits[acct]:
            contained = _contained_late_jobs(run) if contained is None else contained
            # The simulator's own peak, less what the contained late jobs added to it (0 without any).
            added = _peak_without(run, acct, set()) - _peak_without(run, acct, contained) if contained else 0
            peak = a["peak"] - added
            if peak > limits[acct]:
                found.add(f"provider account {acct} ran {peak} jobs at once; max_concurrency {limits[acct]}",
                          {"account": acct, **a, "peak_without_contained_late_submits": peak,
                           "platform_max_concurrency": limits[acct]})
    for sample in run.samples:
        for s in sample.get("shards", []):
            why = invariants.shard_problem(s, s["active_reserved"])
            if why:
                found.add(f"t={sample['t']}: shard {s['resource_key']}#{s['shard_no']}: {why}", {"t": sample["t"], **s})
    active: Counter = Counter()
    reservations = _by((r for r in run.rows("resource_reservations") if r["state"] == ACTIVE), "resource_key", "shard_no")
    for k, rs in reservations.items():
        active[k] = sum(r["reserved_units"] for r in rs)
    for s in run.rows("shards"):
        k = (s["resource_key"], s["shard_no"])
        why = invariants.shard_problem(s, active[k])
        if why:
            found.add(f"at the end: shard {k[0]}#{k[1]}: {why}", [s], reservations.get(k, []))
    for w in run.rows("wallets"):
        floor = -w["credit_limit_amount"] if w["account_type"] == invariants.POSTPAID else 0
        if w["available_amount"] < floor or w["reserved_amount"] < 0 or w["consumed_amount"] < 0:
            found.add(f"wallet {w['wallet_id']} has a negative balance", w)
    for lot in run.rows("lots"):
        if lot["remaining_amount"] < 0 or lot["reserved_amount"] < 0:
            found.add(f"credit lot {lot['lot_id']} has a negative balance", lot)
    for r in run.rows("credit_reservations"):
        if min(r["reserved_amount"], r["settled_amount"], r["released_amount"]) < 0 \
                or r["settled_amount"] + r["released_amount"] > r["reserved_amount"]:
            found.add(f"credit reservation {r['reservation_id']} is negative or over-closed", r)
    return found.result()


# --- fencing --------------------------------------------------------------------------------------------

def check_fencing(run: Run) -> list[Violation]:
    found = _Found("fencing")
    tasks = _tasks(run)
    attempts = {a["attempt_id"]: a for a in run.rows("attempts")}
    for task_id, rows in _by(attempts.values(), "task_id").items():
        rows = sorted(rows, key=lambda a: a["attempt_no"])
        for a, b in pairwise(rows):
            if b["fencing_token"] <= a["fencing_token"]:
                found.add(f"task {task_id}: attempt {b['attempt_no']} has token {b['fencing_token']}, "
                          f"not above attempt {a['attempt_no']}'s {a['fencing_token']}", a, b)
        t = tasks.get(task_id)
        live = [a for a in rows if a["state"] in ATTEMPT_LIVE]
        if len(live) > 1:
            found.add(f"task {task_id}: {len(live)} attempts live at once", live)
        stale = [a for a in live if t is None or a["attempt_id"] != t["current_attempt_id"]]
        if stale:
            found.add(f"task {task_id}: a replaced attempt is still live", stale, [t] if t else [])
    for task_id, t in tasks.items():
        cur = t["current_attempt_id"]
        if cur is None:
            continue
        a = attempts.get(cur)
        if a is None:
            found.add(f"task {task_id}: its current attempt {cur} does not exist", t)
        elif t["current_fencing_token"] != a["fencing_token"]:
            found.add(f"task {task_id}: token {t['current_fencing_token']}, its current attempt's is {a['fencing_token']}", t, a)
    for task_id, evs in _terminal_events(run).items():
        t = tasks.get(task_id)
        for e in evs:
            by = (e.get("payload") or {}).get("attempt_id")
            if t is not None and by is not None and by != t["current_attempt_id"]:
                found.add(f"task {task_id} ended by replaced attempt {by} (current {t['current_attempt_id']})", t, e,
                          [attempts[by]] if by in attempts else [])
    for c in run.rows("charges"):
        t = tasks.get(c["task_id"])
        if t is not None and c.get("settled_attempt_id") and c["settled_attempt_id"] != t["current_attempt_id"]:
            found.add(f"task {c['task_id']} settled for replaced attempt {c['settled_attempt_id']}", t, c)
    # A replaced attempt's late submit (a worker paused past its lease, then sending on its old
    # token): its answer must be refused, and the job it made contained as an orphan, never mapped.
    absent = {a["provider_request_key"]: a for a in attempts.values() if a["state"] == "ABSENT_CONFIRMED"}
    for a in absent.values():
        if a.get("provider_job_id"):
            found.add(f"task {a['task_id']}: attempt {a['attempt_no']}, replaced after its absence was confirmed, "
                      f"holds job {a['provider_job_id']} (a stale write applied)", a)
    orphaned = {o["provider_job_id"] for o in run.rows("orphans")}
    for j in run.truth.get("jobs", []):
        a = absent.get(j["idempotency_key"])
        if a is not None and j["id"] not in orphaned:
            found.add(f"task {a['task_id']}: job {j['id']} of attempt {a['attempt_no']} (absence confirmed) is not "
                      f"contained as an orphan", a, j)
    for r in run.rows("resource_reservations"):
        a = attempts.get(r["attempt_id"])
        if a is not None and r["fencing_token"] != a["fencing_token"]:
            found.add(f"reservation {r['resource_key']}#{r['shard_no']} of attempt {r['attempt_id']} has token "
                      f"{r['fencing_token']}, the attempt's is {a['fencing_token']}", r, a)
    return found.result()


# --- transitions ----------------------------------------------------------------------------------------

def _reachable() -> dict[str, frozenset[str]]:
    """state -> every state some sequence of legal transitions leads to (observations are sparse:
    a client may miss any number of steps between two reads)."""
    out = {}
    for s in TRANSITIONS:
        seen, todo = set(), list(TRANSITIONS[s])
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(TRANSITIONS[n])
        out[s] = frozenset(seen)
    return out


REACHABLE = _reachable()


def _follows(earlier: str, later: str) -> bool:
    return later == earlier or later in REACHABLE.get(earlier, frozenset())


def check_transitions(run: Run) -> list[Violation]:
    found = _Found("transitions")
    tasks = _tasks(run)
    observed: dict[str, list[Op]] = defaultdict(list)
    for op in run.ops:
        if op.f == GET and op.type == OK and op.value.get("state") and op.task_id:
            observed[op.task_id].append(op)
    for task_id, ops in observed.items():
        ops.sort(key=lambda op: op.t1)
        bad = next((op for op in ops if op.value["state"] not in STATES), None)
        if bad is not None:
            found.add(f"task {task_id}: observed unknown state {bad.value['state']}", bad.lines())
            continue
        # a before b in real time: a's answer was recorded before b was invoked.
        pair = next(((a, b) for b in ops for a in ops if a.t1 < b.t0
                     and not _follows(a.value["state"], b.value["state"])), None)
        if pair is not None:
            a, b = pair
            what = "left terminal state" if a.value["state"] in TERMINAL else "illegal transition"
            found.add(f"task {task_id}: {what} {a.value['state']} -> {b.value['state']}", a.lines(), b.lines())
            continue
        t = tasks.get(task_id)
        if t is None:
            continue
        last = ops[-1]
        terminal_seen = [op for op in ops if op.value["state"] in TERMINAL]
        if terminal_seen and terminal_seen[-1].value["state"] != t["state"]:
            found.add(f"task {task_id}: observed terminal {terminal_seen[-1].value['state']}, but it ended {t['state']}",
                      terminal_seen[-1].lines(), [t])
        elif not _follows(last.value["state"], t["state"]):
            found.add(f"task {task_id}: last observed {last.value['state']}, cannot have ended {t['state']}", last.lines(), [t])
    return found.result()


# --- ledger ---------------------------------------------------------------------------------------------

def check_ledger(run: Run) -> list[Violation]:
    found = _Found("ledger")
    entries = run.rows("ledger_entries")
    txns = {t["ledger_txn_id"]: t for t in run.rows("ledger_transactions")}
    wallets = {w["wallet_id"]: w for w in run.rows("wallets")}
    unbalanced = invariants.unbalanced(entries)
    for txn_id, es in _by(entries, "ledger_txn_id").items():
        if txn_id in unbalanced:
            found.add(f"ledger transaction {txn_id} does not balance: {unbalanced[txn_id]}",
                      [txns[txn_id]] if txn_id in txns else [], es)
        if txn_id not in txns:
            found.add(f"ledger entries of transaction {txn_id}, which does not exist", es)
    for e in entries:
        w = wallets.get(e["wallet_id"])
        if w is not None and e["unit_code"] != w["unit_code"]:
            found.add(f"entry {e['entry_id']} in {e['unit_code']} on a wallet in {w['unit_code']}", e, w)
    totals = Counter()
    for e in entries:
        totals[e["unit_code"]] += e["amount_delta"]
    if any(totals.values()):
        found.add(f"money is not conserved: all entries sum to {dict(totals)}")
    aggregate: dict[str, Counter] = defaultdict(Counter)
    for e in entries:
        aggregate[e["wallet_id"]][e["bucket"]] += e["amount_delta"]
    lots = _by(run.rows("lots"), "wallet_id")
    open_reserved: Counter = Counter()
    for r in run.rows("credit_reservations"):
        open_reserved[r["wallet_id"]] += r["reserved_amount"] - r["settled_amount"] - r["released_amount"]
    for a in run.rows("allowances"):
        open_reserved[a["wallet_id"]] += a["amount"]
    for wid, w in wallets.items():
        # invariants.wallet_findings, over the facts (open reservations only where allowances were recorded).
        diffs = invariants.wallet_differences(w, aggregate[wid], lots.get(wid, []),
                                              open_reserved[wid] if "allowances" in run.facts else None)
        if diffs:
            found.add(f"wallet {wid}: snapshot differs (expected, actual): {diffs}", w, lots.get(wid, [])[:3])
    return found.result()


# --- charged-once ---------------------------------------------------------------------------------------

def _expected_charges(charge: dict[str, Any], reservation: dict[str, Any], wallet: dict[str, Any] | None,
                      provider_charged: bool | None) -> set[int] | None:
    """What billing.policies.decide charges for the charge's settled outcome under its locked
    policy and quote (both answers when the provider's billing is unknown); None when the rule is
    USAGE (priced from the seconds the provider reports), the policy may top up beyond the quote, or
    the wallet is not in the facts. The reservation stands for what was open at settlement."""
    policy = policies.resolve(charge["charge_policy_code"])
    state, _, stage = (charge["settled_outcome"] or "").partition("/")
    account = wallet["account_type"] if wallet else None
    if account is None or (policy.over_reservation == policies.POSTPAID_CREDIT and account == invariants.POSTPAID):
        return None
    out = set()
    for pc in ([provider_charged] if provider_charged is not None else [True, False]):
        outcome = policies.Outcome(state=state, stage=stage, provider_charged=pc)
        if policies.rule_for(policy, outcome) == policies.USAGE:
            return None
        snap = policies.ChargeSnapshot(policy_code=charge["charge_policy_code"], quoted_amount=charge["quoted_amount"],
                                       reserved_open=reservation["reserved_amount"], model_rules={}, params={},
                                       account_type=account)
        out.add(policies.decide(snap, outcome).amount)
    return out


def check_charged_once(run: Run) -> list[Violation]:
    found = _Found("charged-once")
    charges = {c["task_id"]: c for c in run.rows("charges")}
    reservations = {r["task_id"]: r for r in run.rows("credit_reservations")}
    wallets = {w["wallet_id"]: w for w in run.rows("wallets")}
    entries = _by(run.rows("ledger_entries"), "ledger_txn_id")
    txns = run.rows("ledger_transactions")
    by_task = _by((t for t in txns if t["task_id"]), "task_id")
    by_reservation = _by((t for t in txns if t["reservation_id"]), "reservation_id")
    events = _terminal_events(run)
    active = _by((r for r in run.rows("resource_reservations") if r["state"] == ACTIVE), "task_id")
    for task_id, t in _tasks(run).items():
        if t["state"] not in TERMINAL:
            continue
        if active.get(task_id):
            found.add(f"task {task_id} is {t['state']} but holds ACTIVE resource reservations", [t], active[task_id])
        c, r = charges.get(task_id), reservations.get(task_id)
        if c is None or r is None:
            found.add(f"task {task_id} has no {'charge snapshot' if c is None else 'credit reservation'}", t)
            continue
        if c["finalized_at"] is None:
            found.add(f"task {task_id} is {t['state']} but was never settled", t, c, r)
            continue
        settles = [x for x in by_task.get(task_id, []) if x["event_type"] == SETTLE]
        charged = sum(e["amount_delta"] for x in settles for e in entries.get(x["ledger_txn_id"], []) if e["bucket"] == CONSUMED)
        if len(settles) > 1:
            found.add(f"task {task_id} charged {len(settles)} times ({charged} in all)", settles, c)
            continue
        if not (c["settled_outcome"] or "").startswith(t["state"] + "/"):
            found.add(f"task {task_id} is {t['state']} but was settled as {c['settled_outcome']}", t, c)
        if charged != c["final_charge_amount"]:
            found.add(f"task {task_id}: the ledger charged {charged}, the snapshot says {c['final_charge_amount']}", c, settles)
        evs = events.get(task_id, [])
        pc = (evs[0].get("payload") or {}).get("provider_charged") if len(evs) == 1 else None
        try:
            want = _expected_charges(c, r, wallets.get(r["wallet_id"]), pc)
        except (policies.UnknownPolicy, policies.UnknownOutcome) as e:
            found.add(f"task {task_id}: its charge cannot be priced: {e}", c)
            want = None
        if want is not None and charged not in want:
            found.add(f"task {task_id} ({c['settled_outcome']}, {c['charge_policy_code']}, quote {c['quoted_amount']}): "
                      f"charged {charged}, the locked policy charges {sorted(want)}", c, settles, evs)
        # The reservation: closed exactly once, nothing left reserved.
        mine = by_reservation.get(r["reservation_id"], [])
        closes = Counter(x["event_type"] for x in mine if x["event_type"] in (SETTLE, RELEASE))
        held = sum(e["amount_delta"] for x in mine for e in entries.get(x["ledger_txn_id"], []) if e["bucket"] == RESERVED)
        if r["state"] not in invariants.CLOSED_CREDIT_RESERVATION or r["settled_amount"] + r["released_amount"] != r["reserved_amount"]:
            found.add(f"task {task_id}: credit reservation left {r['state']}, settled {r['settled_amount']} + released "
                      f"{r['released_amount']} of {r['reserved_amount']}", t, r)
        elif any(n > 1 for n in closes.values()) or (r["reserved_amount"] > 0 and not closes):
            found.add(f"task {task_id}: reservation closed by {dict(closes) or 'nothing'}, not once", r,
                      [x for x in mine if x["event_type"] in (SETTLE, RELEASE)])
        elif held != 0:
            found.add(f"task {task_id}: {held} still RESERVED in the ledger for its closed reservation", r, mine)
        elif r["settled_amount"] != charged:
            found.add(f"task {task_id}: reservation settled {r['settled_amount']}, the ledger charged {charged}", r, settles)
    return found.result()


# --- liveness -------------------------------------------------------------------------------------------

def check_liveness(run: Run) -> list[Violation]:
    found = _Found("liveness")
    info = run.run
    settled, stopped = info.get("settled_t"), info.get("faults_stopped_t")
    bound = run.params.get("liveness_bound_s")
    run_line = {k: info.get(k) for k in ("seed", "started_at", "load_stopped_t", "faults_stopped_t", "settled_t", "admitted")}
    if settled is None:
        found.add("the run never settled: some task was not terminal (or in MANUAL_REVIEW) at the deadline", run_line)
    elif bound is not None and settled - (stopped or 0) > bound:
        found.add(f"settled {settled - (stopped or 0):.1f} s after the faults stopped; bound {bound} s", run_line)
    windows = run.plan.get("liveness_windows") or []
    start = _ts(info.get("started_at"))
    if not windows or start is None:
        return found.result()
    ended: dict[str, float] = {}
    for task_id, evs in _terminal_events(run).items():
        ended[task_id] = min((_ts(e["created_at"]) - start).total_seconds() for e in evs)
    created = {t["task_id"]: (_ts(t["created_at"]) - start).total_seconds() for t in run.rows("tasks")}
    for w0, w1 in windows:
        pending = [tid for tid, c in created.items() if c <= w0 and ended.get(tid, math.inf) >= w0]
        if pending and not any(w0 <= e <= w1 for e in ended.values()):
            some = set(pending[:3])
            found.add(f"no task reached a terminal state in liveness window [{w0}, {w1}] s, {len(pending)} pending",
                      {"window": [w0, w1], "pending": len(pending)}, [t for t in run.rows("tasks") if t["task_id"] in some])
    return found.result()


# --- rescues ---------------------------------------------------------------------------------------------

def check_rescues(run: Run) -> list[Violation]:
    found = _Found("rescues")
    armed = {n: p for n, p in (run.plan.get("failpoints") or {}).items() if p}
    stalls = {n: v for n, v in (run.plan.get("stalls") or {}).items() if v and v[0]}
    if run.faults or armed or stalls:
        return found.result()  # an execution may have been lost: a rescue proves nothing here
    for a in run.rows("attempts"):
        if a.get("recoveries"):
            found.add(f"attempt {a['attempt_id']} of task {a['task_id']} was rescued {a['recoveries']} times, "
                      f"though no fault or failpoint could have lost its execution", a)
    return found.result()


# --- webhooks -------------------------------------------------------------------------------------------

APPLIED = "applied"  # the callback's answer to a copy it applied (aivedio.attempts.callbacks)


def check_webhooks(run: Run) -> list[Violation]:
    found = _Found("webhooks")
    for j in run.jobs():
        w = j.get("webhook") or {}
        n = sum(1 for a in w.get("answers") or [] if a == APPLIED)
        if n > 1:
            found.add(f"webhook {w.get('webhook_id')} ({w.get('type')}) of job {j['id']} was applied {n} times",
                      {"job": j["id"], "client_request_id": j.get("client_request_id"), "status": j.get("status"), **w})
    return found.result()


CHECKERS: dict[str, Callable[[Run], list[Violation]]] = {
    "admission-idempotency": check_admission_idempotency,
    "total-queue": check_total_queue,
    "one-provider-job": check_one_provider_job,
    "capacity": check_capacity,
    "fencing": check_fencing,
    "transitions": check_transitions,
    "ledger": check_ledger,
    "charged-once": check_charged_once,
    "liveness": check_liveness,
    "rescues": check_rescues,
    "webhooks": check_webhooks,
}


def check_all(run: Run, names: Iterable[str] | None = None) -> dict[str, list[Violation]]:
    """Every checker's violations (or those named), by name; a checker that raises is a violation
    of its own (malformed facts must not pass silently)."""
    out = {}
    for name in names or CHECKERS:
        try:
            out[name] = CHECKERS[name](run)
        except Exception as e:  # noqa: BLE001 - reported, with the checker's name
            out[name] = [Violation(name, f"checker failed: {e!r}")]
    return out


def verdict(run: Run) -> dict[str, Any]:
    """The run's verdict as JSON: ok when no checker fired; `violations` holds only the checkers that
    fired, each with its violations as dicts (checker, message, excerpt)."""
    found = check_all(run)
    fired = {name: [asdict(v) for v in vs] for name, vs in found.items() if vs}
    return {"ok": not fired, "seed": run.run.get("seed"), "checked": list(found), "violations": fired}


def describe_verdict(v: dict[str, Any]) -> list[str]:
    """A verdict as lines for a person: each violation with the seed, its checker and its excerpt."""
    seed = v.get("seed")
    if v["ok"]:
        return [f"seed {seed}: ok, {len(v.get('checked', CHECKERS))} checkers silent"]
    n = sum(len(x) for x in v["violations"].values())
    out = [f"seed {seed}: {n} violations of {', '.join(sorted(v['violations']))} (replay: aivedio chaos --seed {seed})"]
    for name, found in v["violations"].items():
        for x in found:
            out += (f"seed {seed} " + Violation(name, x["message"], x.get("excerpt") or []).render()).splitlines()
    return out
