"""The steps of the attempt workflow (aivedio.attempts.workflow holds the state machine that
sequences them). Each step is an idempotent function of what PostgreSQL records: it reads the
task and the attempt, checks that its attempt is still current (fencing token), may call the
provider, writes the outcome under the task's row lock, and says what comes next:

    {"next": "submit" | "check" | "resolve" | "cancel" | "wait" | "done" | "manual_review",
     "wait_seconds": N, "then": <step after the wait>, "polls": n, "errors": n, "outcome": "..."}

A step that finds the attempt somewhere else than it expects routes to the step that state needs,
so a restarted execution (after a crash, from the lease scanner) picks up where PostgreSQL says.
Nothing is ever resubmitted blindly: once a submit may have been sent, only a lookup by its
idempotency key decides (ch. 18.15)."""
from __future__ import annotations

import random
import time
from datetime import datetime
from typing import Any, Callable

from aivedio import outbox, tasks
from aivedio.attempts import aimd
from aivedio.attempts.lifecycle import (
    AttemptRef,
    Loaded,
    apply_job,
    finish,
    jitter,
    load,
    move,
    record_orphan,
    renew_lease,
    requeue,
    set_attempt,
)
from aivedio.faults import failpoints, safeguards
from aivedio.metrics_catalog import MANUAL_REVIEWS, STALE_WRITES_REFUSED, SUBMIT_UNKNOWN, SUBMIT_UNKNOWN_RESOLVED
from aivedio.observability import logger, publish
from aivedio.providers.adapter import (
    Accepted,
    Lookup,
    NotAcceptedRetryable,
    ProviderError,
    ProviderJob,
    RejectedFinal,
    SubmitRequest,
    Unknown,
)
from aivedio.providers.registry import adapter
from aivedio.scheduling.resources import release_attempt

Step = dict[str, Any]
LOST_JOB_POLLS = 10  # a job the provider accepted and then answers 404 for this many polls: review


def done(outcome: str, **kw: Any) -> Step:
    return {"next": "done", "outcome": outcome, **kw}


def wait(then: str, seconds: float, **counters: Any) -> Step:
    # Step Functions' SecondsPath takes a whole number of seconds.
    return {"next": "wait", "then": then, "wait_seconds": max(1, int(round(seconds))), **counters}


def go(step: str, **kw: Any) -> Step:
    return {"next": step, **kw}


def manual_review(outcome: str) -> Step:
    return {"next": "manual_review", "outcome": outcome}


class _Ctx:
    """One step's view: platform, clock, the attempt reference and the counters it carries."""

    def __init__(self, platform, ref: AttemptRef, step: Step | None):
        self.p, self.ref, self.step = platform, ref, step or {}
        self.timers = platform.config.timers

    @property
    def now(self) -> datetime:
        return self.p.clock.now()

    def lease_until(self) -> datetime:
        return self.now + self.p.clock.delta(self.timers.lease_seconds)

    def platform_age(self, since: datetime) -> float:
        """Platform seconds since `since` (what a provider's window is counted in)."""
        return (self.now - since).total_seconds() * self.p.clock.time_scale

    def tx(self, fn: Callable[[Any], Any]) -> Any:
        return self.p.db.transaction(fn)

    def read(self) -> Loaded | None:
        with self.p.db.connection() as conn:
            return load(conn, self.ref, lock=False)

    def count(self, name: str) -> int:
        return int(self.step.get(name) or 0)

    def heartbeat(self) -> None:
        """Renew the lease while a step only waits (backoff, lookups that cannot decide yet), so
        the lease scanner does not start a second execution beside this live one."""
        self.tx(lambda conn: renew_lease(conn, self.ref, self.now, self.lease_until()))


# --- routing ------------------------------------------------------------------------------------------

def _route(ctx: _Ctx, loaded: Loaded | None) -> Step:
    """The step the recorded state calls for."""
    if loaded is None:
        return done("missing")
    if not loaded.current:
        return done("stale")
    t, a = loaded.task, loaded.attempt
    if tasks.is_terminal(t["state"]):
        return done(t["state"].lower())
    if t["state"] == "MANUAL_REVIEW" or a["state"] == "MANUAL_REVIEW":
        return manual_review("manual_review")
    if a["state"] == "SUBMIT_UNKNOWN":
        return go("resolve")
    if a["state"] == "DISPATCHING":
        return go("submit")
    if t["state"] == "CANCEL_REQUESTED" and a["cancel_sent_at"] is None:
        return go("cancel")
    return go("check", polls=ctx.count("polls"))


def begin(platform, ref: AttemptRef, step: Step | None = None) -> Step:
    ctx = _Ctx(platform, ref, step)
    return _route(ctx, ctx.read())


# --- submit -------------------------------------------------------------------------------------------

def _mark_unknown(conn, loaded: Loaded, now: datetime, reason: str) -> None:
    ref = AttemptRef(loaded.task["tenant_id"], loaded.task["task_id"], loaded.attempt["attempt_id"],
                     loaded.attempt["fencing_token"])
    set_attempt(conn, ref, now, state="SUBMIT_UNKNOWN", error_class="UNKNOWN", error_code=reason)
    if loaded.task["state"] == "DISPATCHING":  # a cancel request keeps its state; resolution decides
        tasks.cas_transition(conn, tenant_id=loaded.task["tenant_id"], task_id=loaded.task["task_id"],
                             from_state="DISPATCHING", version=loaded.task["version"], to_state="SUBMIT_UNKNOWN", now=now)
    publish(SUBMIT_UNKNOWN)


def _request(platform, task: dict, attempt: dict) -> SubmitRequest:
    # Locally the server may listen on a port chosen at start; it records its own address.
    # In AWS it is the API's own URL, from the stack; without one, polling alone follows the job.
    base = platform.extras.get("callback_base_url") or platform.settings.api_base_url
    return SubmitRequest(model=attempt["model_code"], prompt=task["prompt"] or "", duration_seconds=task["duration_seconds"],
                         resolution=task["resolution"], with_audio=task["with_audio"], inputs=list(task["inputs"] or []),
                         client_request_id=str(task["task_id"]),
                         callback_url=f"{base.rstrip('/')}/v1/providers/{attempt['provider']}/callbacks" if base else None)


def _requeue_delay(ctx: _Ctx, attempt: dict, retry_after: float | None) -> float:
    t = ctx.timers
    backoff = min(t.requeue_backoff_max_seconds, t.requeue_backoff_base_seconds * 2 ** (attempt["attempt_no"] - 1))
    return max(retry_after or 0.0, jitter(backoff))


def submit(platform, ref: AttemptRef, step: Step | None = None) -> Step:
    ctx = _Ctx(platform, ref, step)

    marked = 0.0

    def claim_send(conn) -> tuple[str, Loaded | None]:
        nonlocal marked
        loaded = load(conn, ref, lock=True)
        now = ctx.now  # after the lock: submit_started_at must not predate a wait for it
        marked = time.monotonic()  # with it: the send deadline below counts from where the absence proof does
        if loaded is None or not loaded.current or loaded.attempt["state"] != "DISPATCHING" or tasks.is_terminal(loaded.task["state"]):
            return "route", loaded
        if loaded.task["state"] == "CANCEL_REQUESTED" and loaded.attempt["submit_started_at"] is None:
            finish(conn, loaded, "CANCELLED", stage="BEFORE_SUBMIT", now=now)
            return "cancelled", loaded
        if loaded.attempt["submit_started_at"] is not None:
            # An earlier execution may have sent it and died: only a lookup by key can tell.
            _mark_unknown(conn, loaded, now, "RESTARTED_AFTER_SEND")
            return "unknown", loaded
        set_attempt(conn, ref, now, submit_started_at=now)
        renew_lease(conn, ref, now, ctx.lease_until())
        return "send", loaded

    verdict, loaded = ctx.tx(claim_send)
    if verdict == "route":
        return _route(ctx, loaded)
    if verdict == "cancelled":
        return done("cancelled_before_submit")
    if verdict == "unknown":
        return wait("resolve", ctx.timers.unknown_first_check_seconds)
    assert loaded is not None
    attempt = loaded.attempt
    request = _request(platform, loaded.task, attempt)
    if not _still_sending(ctx):
        # This worker stalled after marking the send (a pause, a long GC) and another execution took
        # the attempt over: it must not send now, or an absence proven meanwhile would be wrong.
        logger.warning("submit not sent: the attempt was taken over while this worker stalled", extra=ref.log())
        return done("superseded")
    prov = adapter(platform, attempt["provider"])
    if time.monotonic() - marked >= prov.timeout_seconds:
        # This worker stalled since its marker for as long as a submit may take: a restarted
        # execution may be about to prove absence from that marker (absence_proven), and a request
        # sent now could arrive after the proof. Unsent, the proof holds; the lookup decides.
        return _send_too_late(ctx)
    # The last instant before the send: a worker paused here sends late whatever it checked, and the
    # protocol has no deadline on a submit; fencing refuses its answer and contains the job.
    failpoints.hit("before-submit-send")
    outcome = prov.submit(attempt["provider_account"], attempt["provider_request_key"], request)
    if isinstance(outcome, Accepted):
        failpoints.hit("after-accept-before-record")  # the job exists; only the lookup by key can find it now
    log = {**ref.log(), "provider": attempt["provider"], "outcome": outcome.kind}

    def record(conn) -> Step:
        now = ctx.now
        cur = load(conn, ref, lock=True)
        if cur is None or not cur.current:
            if isinstance(outcome, Accepted):
                record_orphan(conn, attempt["provider"], outcome.job_id, attempt["provider_account"], attempt["attempt_id"],
                              "STALE_SUBMIT", {"status": outcome.status})
            return done("stale")
        set_attempt(conn, ref, now, submit_finished_at=now, raw_last_response=outcome.raw.as_dict())
        t = cur.task
        if isinstance(outcome, Accepted):
            applied = apply_job(conn, ref, ProviderJob(id=outcome.job_id, status=outcome.status, created_at=None),
                                source="submit", now=now, media=platform.config.media)
            renew_lease(conn, ref, now, ctx.lease_until())
            if applied.outcome == "TERMINAL":
                return done(applied.task_state.lower() if applied.task_state else "terminal")
            if t["state"] == "CANCEL_REQUESTED":
                return go("cancel")
            return wait("check", ctx.timers.poll_first_seconds, polls=0)
        if tasks.is_terminal(t["state"]):
            return done(t["state"].lower())
        if isinstance(outcome, NotAcceptedRetryable):
            if t["state"] == "CANCEL_REQUESTED":
                finish(conn, cur, "CANCELLED", stage="BEFORE_SUBMIT", now=now, attempt_state="NOT_ACCEPTED")
                return done("cancelled_before_submit")
            delay = _requeue_delay(ctx, attempt, outcome.retry_after_seconds)
            requeue(conn, cur, attempt_state="NOT_ACCEPTED", reason=f"PROVIDER_{outcome.reason.upper()}", now=now,
                    eligible_at=now + platform.clock.delta(delay))
            return done("requeued", retry_after_seconds=round(delay, 1))
        if isinstance(outcome, RejectedFinal):
            finish(conn, cur, "FAILED", stage="SUBMIT_REJECTED", now=now, attempt_state="REJECTED",
                   error_code=f"PROVIDER_REJECTED_{outcome.code}".upper()[:100], error_message=outcome.raw.body[:500])
            return done("rejected")
        assert isinstance(outcome, Unknown)
        _mark_unknown(conn, cur, now, outcome.reason.upper())
        renew_lease(conn, ref, now, ctx.lease_until())
        return wait("resolve", ctx.timers.unknown_first_check_seconds)

    result = ctx.tx(record)
    if result.get("outcome") == "stale":
        logger.warning("submit answer for a replaced attempt refused", extra=log)
        publish(STALE_WRITES_REFUSED, source="submit")
        if isinstance(outcome, Accepted):
            _cancel_orphan(platform, attempt, outcome.job_id)
        elif isinstance(outcome, Unknown):
            _find_stale_job(platform, attempt)
        return result
    if isinstance(outcome, Accepted):
        aimd.increase(platform, attempt["provider"], attempt["provider_account"])
    elif isinstance(outcome, NotAcceptedRetryable) and outcome.reason == "rate_limited":
        aimd.decrease(platform, attempt["provider"], attempt["provider_account"])
    logger.info("submitted", extra={**log, "next": result["next"]})
    return result


STILL_SENDING = """select 1 from generation_task t join task_attempt a on a.attempt_id = t.current_attempt_id
                    where t.tenant_id = %s and t.task_id = %s and t.current_attempt_id = %s and t.current_fencing_token = %s
                      and a.state = 'DISPATCHING' and a.submit_started_at is not null"""


def _send_too_late(ctx: _Ctx) -> Step:
    """The send was not made (this worker stalled past the submit timeout since its marker). Under
    the task's lock, an attempt still DISPATCHING was sent by no one (a restarted execution marks it
    SUBMIT_UNKNOWN before anything), so the task is requeued at once as not accepted."""
    logger.warning("submit not sent: this worker stalled past the submit timeout since its send marker", extra=ctx.ref.log())
    return _requeue_unsent(ctx, "DISPATCHING", attempt_state="NOT_ACCEPTED", reason="SEND_STALLED", outcome="requeued")


def _still_sending(ctx: _Ctx) -> bool:
    """The last check before the send: the attempt is current and still this execution's to send
    (a restarted execution marks it SUBMIT_UNKNOWN first). The window left is the few microseconds
    between this read and the request."""
    r = ctx.ref
    with ctx.p.db.connection() as conn:
        return conn.execute(STILL_SENDING, (r.tenant_id, r.task_id, r.attempt_id, r.fencing_token)).fetchone() is not None


def _find_stale_job(platform, attempt: dict) -> None:
    """A replaced attempt's send ended unknown: the job may exist. Look it up by its key, so it is
    recorded and stopped like any orphan rather than left running unseen."""
    try:
        lookup = adapter(platform, attempt["provider"]).find_by_key(attempt["provider_account"],
                                                                    idempotency_key=attempt["provider_request_key"])
    except ProviderError as e:
        logger.warning("lookup of a stale unknown submit failed; invoice reconciliation will see the job if any",
                       extra={"attempt_id": str(attempt["attempt_id"]), "error": e.message})
        return
    for job in lookup.items:
        with platform.db.connection() as conn:
            record_orphan(conn, attempt["provider"], job.id, attempt["provider_account"], attempt["attempt_id"],
                          "STALE_SUBMIT", {"status": job.status})
        _cancel_orphan(platform, attempt, job.id)


def _cancel_orphan(platform, attempt: dict, job_id: str) -> None:
    """A job created for an attempt that was replaced: nobody will collect it, so stop it."""
    if not platform.config.limits.orphan_cancel:
        return
    try:
        adapter(platform, attempt["provider"]).cancel(attempt["provider_account"], job_id)
    except ProviderError as e:
        logger.warning("orphan cancel failed; reconciliation keeps the record", extra={"job_id": job_id, "error": e.message})


# --- SUBMIT_UNKNOWN resolution ------------------------------------------------------------------------

def _safe_window(ctx: _Ctx, provider_window: int | None) -> float:
    """How long a lookup may keep failing to decide before a person must: inside the provider's
    idempotency window, where its empty answer still means something."""
    safe = ctx.timers.unknown_safe_window_seconds
    return safe if provider_window is None else min(safe, provider_window * 0.9)


def to_manual_review(platform, ref: AttemptRef, reason: str, message: str) -> Step:
    """Hand the attempt to a person: the task goes to MANUAL_REVIEW with its reservations kept."""
    return _to_manual_review(_Ctx(platform, ref, None), reason, message)


def _to_manual_review(ctx: _Ctx, reason: str, message: str) -> Step:
    def tx(conn) -> Step:
        now = ctx.now
        cur = load(conn, ctx.ref, lock=True)
        if cur is None or not cur.current or tasks.is_terminal(cur.task["state"]):
            return _route(ctx, cur)
        if cur.task["state"] != "MANUAL_REVIEW":
            move(conn, cur, "MANUAL_REVIEW", now, error_code=reason, error_message=message)
        # The reservations stay: the job may be live at the provider.
        set_attempt(conn, ctx.ref, now, state="MANUAL_REVIEW", final_reason=reason, lease_until=None)
        outbox.write_event(conn, "TaskNeedsReview", aggregate_type="generation_task", aggregate_id=ctx.ref.task_id,
                           tenant_id=ctx.ref.tenant_id, payload={**ctx.ref.as_dict(), "reason": reason, "message": message})
        return manual_review(reason.lower())

    result = ctx.tx(tx)
    if result["next"] == "manual_review":
        publish(MANUAL_REVIEWS, reason=reason)
        logger.error("ALERT attempt needs manual review", extra={**ctx.ref.log(), "reason": reason, "detail": message})
    return result


def resolve(platform, ref: AttemptRef, step: Step | None = None) -> Step:
    ctx = _Ctx(platform, ref, step)
    loaded = ctx.read()
    if loaded is None or not loaded.current or loaded.attempt["state"] != "SUBMIT_UNKNOWN" or tasks.is_terminal(loaded.task["state"]):
        return _route(ctx, loaded)
    if safeguards.broken("lookup-before-retry"):
        return _retry_unlooked(ctx)
    attempt = loaded.attempt
    sent_at = attempt["submit_started_at"] or attempt["created_at"]
    age = ctx.platform_age(sent_at)
    errors = ctx.count("errors")
    prov = adapter(platform, attempt["provider"])
    try:
        lookup = prov.find_by_key(attempt["provider_account"], idempotency_key=attempt["provider_request_key"])
    except ProviderError as e:
        if age > _safe_window(ctx, None):
            return _to_manual_review(ctx, "SUBMIT_UNKNOWN_UNRESOLVED", f"lookups failing for {age:.0f}s: {e.message}")
        ctx.heartbeat()
        return wait("resolve", _backoff(ctx, errors + 1, ctx.timers.unknown_backoff_max_seconds), errors=errors + 1)
    if lookup.items:
        job = lookup.items[0]

        def adopt(conn) -> Step:
            now = ctx.now
            applied = apply_job(conn, ref, job, source="lookup", now=now, media=platform.config.media)
            if applied.outcome in ("STALE", "MISSING"):
                return done(applied.outcome.lower())
            renew_lease(conn, ref, now, ctx.lease_until())
            if applied.outcome == "TERMINAL":
                return done((applied.task_state or "terminal").lower())
            if applied.task_state == "CANCEL_REQUESTED":
                return go("cancel")
            return wait("check", ctx.timers.poll_first_seconds, polls=0)

        result = ctx.tx(adopt)
        logger.info("SUBMIT_UNKNOWN resolved: the job exists", extra={**ref.log(), "job_id": job.id, "next": result["next"]})
        publish(SUBMIT_UNKNOWN_RESOLVED, how="found")
        return result
    # Empty. It proves absence only inside the provider's window, and only once a request that was
    # still on its way can no longer arrive (twice the submit timeout after it was sent).
    settled = (ctx.now - sent_at).total_seconds() >= 2 * prov.timeout_seconds
    if absence_proven(platform, attempt, lookup, prov.timeout_seconds):
        result = _requeue_unsent(ctx, "SUBMIT_UNKNOWN", attempt_state="ABSENT_CONFIRMED", reason="SUBMIT_ABSENT_CONFIRMED",
                                 outcome="absent_confirmed")
        logger.info("SUBMIT_UNKNOWN resolved: no job exists", extra={**ref.log(), "outcome": result.get("outcome")})
        publish(SUBMIT_UNKNOWN_RESOLVED, how="absent")
        return result
    if age > _safe_window(ctx, lookup.idempotency_window_seconds):
        return _to_manual_review(ctx, "SUBMIT_UNKNOWN_UNRESOLVED",
                                 f"no job found and absence not provable after {age:.0f}s")
    ctx.heartbeat()
    if not settled:
        remaining = 2 * prov.timeout_seconds - (ctx.now - sent_at).total_seconds()
        return wait("resolve", max(1.0, remaining * platform.clock.time_scale), errors=errors)
    return wait("resolve", _backoff(ctx, errors + 1, ctx.timers.unknown_backoff_max_seconds), errors=errors + 1)


def _requeue_unsent(ctx: _Ctx, from_state: str, *, attempt_state: str, reason: str, outcome: str) -> Step:
    """End an attempt that has no provider job (still `from_state`) as `attempt_state` under the
    task's row lock: the task is requeued, or CANCELLED when a cancel was asked for meanwhile."""
    def tx(conn) -> Step:
        now = ctx.now
        cur = load(conn, ctx.ref, lock=True)
        if cur is None or not cur.current or cur.attempt["state"] != from_state or tasks.is_terminal(cur.task["state"]):
            return _route(ctx, cur)
        if cur.task["state"] == "CANCEL_REQUESTED":
            finish(conn, cur, "CANCELLED", stage="BEFORE_SUBMIT", now=now, attempt_state=attempt_state)
            return done("cancelled_before_submit")
        requeue(conn, cur, attempt_state=attempt_state, reason=reason, now=now, eligible_at=now)
        return done(outcome)

    return ctx.tx(tx)


def _retry_unlooked(ctx: _Ctx) -> Step:
    """Chaos only (the lookup-before-retry switch): the unknown submit is taken as not accepted and
    the task requeued without asking the provider, so a job it did accept runs beside the next
    attempt's (a new attempt sends a new key)."""
    return _requeue_unsent(ctx, "SUBMIT_UNKNOWN", attempt_state="NOT_ACCEPTED", reason="SUBMIT_UNKNOWN_NOT_LOOKED_UP",
                           outcome="requeued")


def absence_proven(platform, attempt: dict, lookup: Lookup, timeout_seconds: float) -> bool:
    """The one rule by which an empty lookup by key proves that no job exists (ch. 18.15; the
    provider protocol's "Find by key"): the answer is empty, the key is younger than the provider's
    idempotency window (counted from the first send, in platform seconds, the window's unit), and a
    request that was still on its way can no longer arrive (twice the submit timeout has passed
    since the send). The workflow's resolve step, `aivedio admin review resolve --action requeue`
    and the stuck-submits service all decide by it."""
    sent_at = attempt["submit_started_at"] or attempt["created_at"]
    elapsed = (platform.clock.now() - sent_at).total_seconds()
    return elapsed >= 2 * timeout_seconds and lookup.proves_absent(elapsed * platform.clock.time_scale)


def _backoff(ctx: _Ctx, n: int, cap: float) -> float:
    return min(cap, jitter(ctx.timers.unknown_first_check_seconds * 2 ** (n - 1)))


# --- polling ------------------------------------------------------------------------------------------

def poll_interval(ctx: _Ctx, task: dict, polls: int) -> float:
    """First check after poll_first_seconds, then 15 to 30 s with jitter, denser near the deadline."""
    t = ctx.timers
    if polls <= 0:
        return t.poll_first_seconds
    interval = random.uniform(t.poll_min_seconds, t.poll_max_seconds)
    if task.get("deadline_at") is not None:
        left = ctx.platform_age(task["deadline_at"]) * -1
        if 0 < left < 2 * t.poll_max_seconds:
            interval = max(1.0, min(interval, left / 3))
    return interval


def check(platform, ref: AttemptRef, step: Step | None = None) -> Step:
    ctx = _Ctx(platform, ref, step)
    loaded = ctx.read()
    routed = _route(ctx, loaded)
    if routed["next"] != "check":
        return routed
    assert loaded is not None
    attempt, polls, errors = loaded.attempt, ctx.count("polls"), ctx.count("errors")
    if attempt["provider_job_id"] is None:  # accepted without an id cannot happen; treat as unknown
        return go("resolve")
    try:
        job = adapter(platform, attempt["provider"]).get(attempt["provider_account"], attempt["provider_job_id"])
    except ProviderError:
        ctx.heartbeat()
        delay = min(ctx.timers.poll_error_backoff_max_seconds, ctx.timers.poll_first_seconds * 2 ** errors)
        return wait("check", jitter(delay), polls=polls, errors=errors + 1)
    if job is None:
        ctx.heartbeat()
        if errors + 1 >= LOST_JOB_POLLS:
            return _to_manual_review(ctx, "PROVIDER_LOST_JOB", f"the provider answers 404 for job {attempt['provider_job_id']}")
        return wait("check", ctx.timers.poll_min_seconds, polls=polls, errors=errors + 1)

    def apply(conn) -> Step:
        now = ctx.now
        applied = apply_job(conn, ref, job, source="poll", now=now, media=platform.config.media)
        if applied.outcome in ("STALE", "MISSING"):
            return done(applied.outcome.lower())
        if applied.outcome == "TERMINAL":
            return done((applied.task_state or "terminal").lower())
        renew_lease(conn, ref, now, ctx.lease_until())
        cur = load(conn, ref, lock=False)
        nxt = _route(ctx, cur)
        if nxt["next"] != "check":
            return nxt
        return wait("check", poll_interval(ctx, cur.task, polls + 1), polls=polls + 1)

    return ctx.tx(apply)


# --- cancel after dispatch ----------------------------------------------------------------------------

def cancel(platform, ref: AttemptRef, step: Step | None = None) -> Step:
    """CANCEL_REQUESTED: ask the provider to cancel, then read the job: cancelled (free or with a
    fee), or already finished, whichever the provider says; apply_job makes it one terminal state."""
    ctx = _Ctx(platform, ref, step)
    loaded = ctx.read()
    routed = _route(ctx, loaded)
    if routed["next"] != "cancel":
        return routed
    assert loaded is not None
    attempt, errors = loaded.attempt, ctx.count("errors")
    prov = adapter(platform, attempt["provider"])
    try:
        prov.cancel(attempt["provider_account"], attempt["provider_job_id"])
        job = prov.get(attempt["provider_account"], attempt["provider_job_id"])
    except ProviderError:
        ctx.heartbeat()
        return wait("cancel", jitter(min(ctx.timers.poll_error_backoff_max_seconds, 2.0 * 2 ** errors)), errors=errors + 1)

    def apply(conn) -> Step:
        now = ctx.now
        cur = load(conn, ref, lock=True)
        if cur is None or not cur.current:
            return done("stale")
        set_attempt(conn, ref, now, cancel_sent_at=now)
        renew_lease(conn, ref, now, ctx.lease_until())
        if job is None:
            return wait("check", ctx.timers.poll_min_seconds, polls=1, errors=1)
        applied = apply_job(conn, ref, job, source="cancel", now=now, media=platform.config.media)
        if applied.outcome == "TERMINAL":
            return done((applied.task_state or "terminal").lower())
        # A cancel is a request: the job may still finish. Keep watching it.
        return wait("check", ctx.timers.poll_min_seconds, polls=1)

    result = ctx.tx(apply)
    logger.info("provider cancel sent", extra={**ref.log(), "job_id": attempt["provider_job_id"], "next": result["next"]})
    return result


# --- finalize -----------------------------------------------------------------------------------------

def finalize(platform, ref: AttemptRef, step: Step | None = None) -> Step:
    """The workflow's last state: reports where the task ended. A terminal task with reservations
    still ACTIVE would be a bug of this module; it is repaired here and logged loudly."""
    ctx = _Ctx(platform, ref, step)

    def tx(conn) -> Step:
        cur = load(conn, ref, lock=False)
        if cur is None:
            return done("missing")
        if tasks.is_terminal(cur.task["state"]) and cur.task["current_attempt_id"] == ref.attempt_id:
            leaked = release_attempt(conn, ref.attempt_id, ctx.now)
            if leaked:
                logger.error("terminal task held reservations; released", extra={**ref.log(), "released": len(leaked)})
        return done((step or {}).get("outcome") or cur.task["state"].lower(), task_state=cur.task["state"])

    return ctx.tx(tx)


ACTIONS: dict[str, Callable[..., Step]] = {
    "begin": begin, "submit": submit, "check": check, "resolve": resolve, "cancel": cancel, "finalize": finalize,
}


def run_action(platform, action: str, attempt: dict, step: Step | None = None) -> Step:
    """The attempt_step Lambda's core: one named step for one attempt."""
    try:
        fn = ACTIONS[action]
    except KeyError:
        raise ValueError(f"unknown attempt step {action!r}; steps are {', '.join(ACTIONS)}") from None
    return fn(platform, AttemptRef.of(attempt), step)
