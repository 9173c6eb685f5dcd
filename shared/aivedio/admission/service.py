"""Admission (ch. 18.3.1, 18.5, 18.11; ch. 20.4.1, 20.6.1-20.6.2): decide, with a reason code and an
estimated start, whether a request enters the platform; if it does, write everything in one
transaction: the completed idempotency record, wallet lock, RESERVE across credit lots, reservation,
task, charge snapshot and a TaskQueued outbox event. A rejection raises inside that transaction:
nothing is written.

Idempotency (contracts/tenant-api.md) covers the whole request: before any slow work (the input
probe) the request claims its key with an IN_PROGRESS idempotency_record, committed on its own, so
a second request with the key answers 409 IDEMPOTENCY_IN_PROGRESS while the first is still probing.
The admission transaction turns the record COMPLETED with the response; a rejection (or any error)
deletes it, so the key can be retried and a rejected request leaves nothing behind. The record's
task_id is chosen at the claim and is its owner's token: only the request that claimed a record
completes or deletes it. A request that died keeps its record IN_PROGRESS until locked_until
(Timers.idempotency_lock_seconds); then the next request with the key takes it over by CAS. A
record expires at expires_at (Timers.idempotency_ttl_seconds) and is no longer replayed;
aivedio.reconcile.idempotency_purge deletes expired records. A key stays spent after its record
expired (one task per key: the generation_task constraint), so its reuse answers
IDEMPOTENCY_KEY_REUSED rather than admitting a duplicate."""
from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

import psycopg

from aivedio import degraded, outbox
from aivedio.admission import queue_stats
from aivedio.admission.decisions import ACCEPTED, ACCEPTED_BEST_EFFORT, Rejected
from aivedio.admission.estimates import Estimate, check_capabilities, estimate
from aivedio.admission.models import GenerationRequest
from aivedio.admission.rate_limits import take
from aivedio.auth import Caller
from aivedio.billing import budgets
from aivedio.billing.ledger import lock_wallet
from aivedio.billing.lots import LotsExhausted
from aivedio.billing.reservations import InsufficientCredit, can_reserve, reserve
from aivedio.errors import Conflict, DomainError, InvalidRequest
from aivedio.media.probe import probe_inputs
from aivedio.metrics_catalog import ADMISSIONS_ACCEPTED, ADMISSION_REJECTIONS
from aivedio.observability import logger, publish
from aivedio.pricing import price_book
from aivedio.pricing.price_book import Quote

MAX_RETRY_AFTER_SECONDS = 3600  # the longest Retry-After a rejection suggests


class IdempotencyKeyReused(DomainError):
    code = "IDEMPOTENCY_KEY_REUSED"


class IdempotencyInProgress(DomainError):
    code = "IDEMPOTENCY_IN_PROGRESS"


@dataclass(frozen=True)
class Admitted:
    status: int
    body: str  # the exact bytes stored for replay
    replayed: bool = False


def request_hash(raw_body: dict) -> str:
    return hashlib.sha256(json.dumps(raw_body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def validate_idempotency_key(key: str | None) -> str:
    if key is None or len(key) == 0:
        raise InvalidRequest("Idempotency-Key header is required", {"header.Idempotency-Key": "required, 1 to 255 characters"})
    if len(key) > 255:
        raise InvalidRequest("Idempotency-Key is too long", {"header.Idempotency-Key": f"{len(key)} characters; at most 255"})
    if any(c < " " or c == "\x7f" for c in key):  # NUL cannot even be stored in a text column
        raise InvalidRequest("Idempotency-Key has a control character", {"header.Idempotency-Key": "no control characters"})
    return key


def load_policy(conn: psycopg.Connection, tenant_id) -> dict:
    return conn.execute(
        """select p.*, t.service_class as tenant_service_class from tenant_scheduling_policy p
             join tenant t using (tenant_id) where p.tenant_id = %s""",
        (tenant_id,),
    ).fetchone()


# --- the idempotency record ---------------------------------------------------------------------------

SELECT_KEY = "select * from idempotency_record where tenant_id = %s and idempotency_key = %s"
LOCK_KEY = SELECT_KEY + " for update"
# A new record, or the takeover of one that no longer holds the key: expired, or IN_PROGRESS past its
# lock (its request died). A record that still holds the key is left alone and nothing is returned.
CLAIM_KEY = """insert into idempotency_record (tenant_id, idempotency_key, request_hash, status, task_id, created_at,
                                              expires_at, locked_until)
               values (%(t)s, %(k)s, %(h)s, 'IN_PROGRESS', %(token)s, %(now)s, %(expires)s, %(locked_until)s)
               on conflict (tenant_id, idempotency_key) do update
                  set request_hash = excluded.request_hash, status = 'IN_PROGRESS', response_status = null,
                      response_body = null, task_id = excluded.task_id, created_at = excluded.created_at,
                      expires_at = excluded.expires_at, locked_until = excluded.locked_until
                where idempotency_record.expires_at <= %(now)s
                   or (idempotency_record.status = 'IN_PROGRESS'
                       and coalesce(idempotency_record.locked_until, '-infinity') <= %(now)s)
               returning task_id"""
KEY_SPENT = "select 1 from generation_task where tenant_id = %s and idempotency_key = %s"
RELEASE_KEY = """delete from idempotency_record
                  where tenant_id = %s and idempotency_key = %s and status = 'IN_PROGRESS' and task_id = %s"""
COMPLETE_KEY = """update idempotency_record
                     set status = 'COMPLETED', response_status = %(status)s, response_body = %(body)s,
                         expires_at = %(expires)s, locked_until = null
                   where tenant_id = %(t)s and idempotency_key = %(k)s and status = 'IN_PROGRESS' and task_id = %(token)s"""


def holds_key(record: dict, now: datetime) -> bool:
    """Whether a record still answers for its key: unexpired, and completed or within its lock."""
    if record["expires_at"] <= now:
        return False
    return record["status"] == "COMPLETED" or (record["locked_until"] is not None and record["locked_until"] > now)


def _claim(platform, tenant_id, key: str, req_hash: str) -> uuid.UUID | Admitted:
    """Take the key for this request (committed before the caller does any slow work): the token
    (the task id the admission will use) when taken, else the answer the holding record gives."""
    token = uuid.uuid4()
    timers = platform.config.timers

    def tx(conn: psycopg.Connection) -> uuid.UUID | Admitted:
        now = platform.clock.now()
        got = conn.execute(CLAIM_KEY, {"t": tenant_id, "k": key, "h": req_hash, "token": token, "now": now,
                                       "expires": now + platform.clock.delta(timers.idempotency_ttl_seconds),
                                       "locked_until": now + platform.clock.delta(timers.idempotency_lock_seconds)}).fetchone()
        if got is None:
            rec = conn.execute(SELECT_KEY, (tenant_id, key)).fetchone()
            if rec is None:  # completed-and-purged or released between the two statements: the client retries
                raise IdempotencyInProgress("a request with this Idempotency-Key is still being processed")
            return _replay(rec, req_hash)
        if conn.execute(KEY_SPENT, (tenant_id, key)).fetchone() is not None:
            raise IdempotencyKeyReused(  # rolls the claim back: the expired record stays as it was
                "this Idempotency-Key was already used, and its record has expired: send a new key",
                details={"fields": {"header.Idempotency-Key": "already used; its idempotency window has passed"}})
        return token

    return platform.db.transaction(tx)


def _release(platform, tenant_id, key: str, token: uuid.UUID) -> None:
    """A request that ends without a task gives its key back (a rejection writes nothing)."""
    try:
        with platform.db.connection() as conn:
            conn.execute(RELEASE_KEY, (tenant_id, key, token))
    except Exception as e:  # the record's lock runs out instead, and the key is taken over then
        logger.warning("idempotency record not released", extra={"tenant_id": str(tenant_id), "error": str(e)})


def _replay(record: dict, req_hash: str) -> Admitted:
    if record["request_hash"] != req_hash:
        raise IdempotencyKeyReused("this Idempotency-Key was used with a different request body",
                                   details={"fields": {"header.Idempotency-Key": "already used with a different request body"}})
    if record["status"] != "COMPLETED":
        raise IdempotencyInProgress("a request with this Idempotency-Key is still being processed")
    return Admitted(record["response_status"], record["response_body"], replayed=True)


def prepare(platform, policy: dict, req: GenerationRequest) -> tuple[Estimate, Quote]:
    """Everything decided outside the transaction: probed inputs, estimate, quote."""
    limits = platform.config.limits
    check_capabilities(req, platform.config)  # an unknown model, or a duration or resolution it lacks, fails before any fetch
    probed = probe_inputs(req.inputs, tenant_id=policy["tenant_id"], limits=limits,
                          media_bucket=platform.settings.media_bucket)
    est = estimate(req, probed, policy["tenant_service_class"], platform.config)
    return est, price_book.admission_quote(platform, est)


def quote_only(platform, caller: Caller, req: GenerationRequest) -> dict:
    """A quote probes inputs and prices like an admission, so it spends the same submit rate limits."""
    with platform.db.connection() as conn:
        policy = load_policy(conn, caller.tenant_id)
    try:
        _check_rates(platform, caller, policy)
    except Rejected as r:
        publish(ADMISSION_REJECTIONS, code=r.decision)
        raise
    est, q = prepare(platform, policy, req)
    return {**q.as_dict(), "queue_class": est.queue_class, "resource_class": est.resource_class,
            "fairness_units": est.fairness_units, "estimate_version": est.estimate_version}


def admit(platform, caller: Caller, req: GenerationRequest, raw_body: dict, idempotency_key: str) -> Admitted:
    """Admit or reject one request; every rejection, wherever it is decided, is counted by code."""
    try:
        result = _admit(platform, caller, req, raw_body, idempotency_key)
    except Rejected as r:
        publish(ADMISSION_REJECTIONS, code=r.decision)
        logger.info("admission rejected", extra={"tenant_id": str(caller.tenant_id), "decision": r.decision, "reason": r.message})
        raise
    publish(ADMISSIONS_ACCEPTED)
    return result


def _admit(platform, caller: Caller, req: GenerationRequest, raw_body: dict, idempotency_key: str) -> Admitted:
    key = validate_idempotency_key(idempotency_key)
    req_hash = request_hash(raw_body)
    with platform.db.connection() as conn:
        record = conn.execute(SELECT_KEY, (caller.tenant_id, key)).fetchone()
        if record is not None and holds_key(record, platform.clock.now()):
            return _replay(record, req_hash)  # a replay, a key reused or still in progress: no rate spent
        policy = load_policy(conn, caller.tenant_id)
    _check_rates(platform, caller, policy)
    token = _claim(platform, caller.tenant_id, key, req_hash)
    if isinstance(token, Admitted):
        return token
    try:
        est, q = prepare(platform, policy, req)
        _check_lane(platform, policy, est)
        _check_budgets(platform, caller, est)

        def tx(conn: psycopg.Connection) -> Admitted:
            rec = conn.execute(LOCK_KEY, (caller.tenant_id, key)).fetchone()
            if rec is None or rec["status"] != "IN_PROGRESS" or rec["task_id"] != token:
                # This request outlived its lock and another took the key over: that one answers.
                if rec is not None and rec["status"] == "COMPLETED":
                    return _replay(rec, req_hash)
                raise IdempotencyInProgress("a request with this Idempotency-Key is still being processed")
            return _admit_locked(platform, conn, caller, req, key, policy, est, q, task_id=token)

        return platform.db.transaction(tx)
    except BaseException:
        _release(platform, caller.tenant_id, key, token)  # only our own IN_PROGRESS record: the key is free again
        raise


def _check_rates(platform, caller: Caller, policy: dict) -> None:
    u = take(platform, f"user:{caller.user_id}:submit", policy["user_submit_rate_per_minute"])
    if not u.allowed:
        raise Rejected("REJECT_USER_RATE_LIMIT", "user submit rate exceeded", u.retry_after_seconds)
    t = take(platform, f"tenant:{caller.tenant_id}:submit", policy["tenant_submit_rate_per_minute"])
    if not t.allowed:
        raise Rejected("REJECT_TENANT_RATE_LIMIT", "tenant submit rate exceeded", t.retry_after_seconds)


def _check_lane(platform, policy: dict, est: Estimate) -> None:
    if est.is_expensive and not policy["expensive_allowed"]:
        raise Rejected("REJECT_RESOURCE_CLASS_DISABLED", f"{est.resource_class} work ({est.queue_class}) is not in this tenant's contract")
    lane = platform.config.lanes[est.queue_class]
    if not lane.admission_open:
        raise Rejected("REJECT_RESOURCE_CLASS_DISABLED", f"admission to {est.queue_class} is closed", 60)
    overload = queue_stats.outbox_overload(platform)
    if overload is not None:  # the bus is down or the relay stalled (ch. 18.18): stop new work until it drains
        degraded.enter(platform, degraded.OUTBOX_BACKLOG, overload)
        raise Rejected("REJECT_PLATFORM_OVERLOADED", f"the platform is overloaded ({overload}); retry later", 30)
    stats = queue_stats.lane_stats(platform, est.queue_class)
    if stats.queued_units + est.fairness_units > lane.max_queue_units:
        raise Rejected("REJECT_LANE_QUEUE_FULL", f"{est.queue_class} queue is full", 60)


def _check_budgets(platform, caller: Caller, est: Estimate) -> None:
    if not budgets.in_force(platform):
        return
    why = budgets.check_admission(platform, tenant_id=caller.tenant_id, project=caller.project, costly=est.is_expensive,
                                  low_priority=est.priority_band >= budgets.LOW_PRIORITY_BAND)
    if why is not None:
        raise Rejected("REJECT_COST_BUDGET", why, 60)


def _window_starts(platform, now: datetime) -> dict[str, datetime]:
    out = {}
    for kind, seconds in (("MINUTE", 60), ("DAY", 86400)):
        span = platform.clock.real_seconds(seconds)
        epoch = now.timestamp()
        out[kind] = datetime.fromtimestamp(epoch - (epoch % span), tz=now.tzinfo)
    return out


def _admit_locked(platform, conn, caller: Caller, req: GenerationRequest, key: str, policy: dict, est: Estimate,
                  q: Quote, *, task_id: uuid.UUID) -> Admitted:
    now = platform.clock.now()
    wallet = lock_wallet(conn, caller.tenant_id)
    if wallet is None:
        raise Rejected("REJECT_INSUFFICIENT_CREDIT", "the tenant has no wallet")
    if wallet["frozen"]:
        raise Rejected("REJECT_WALLET_FROZEN", f"wallet frozen: {wallet['freeze_reason'] or 'under review'}")

    # Queue limits are counted under the wallet lock, which serialises this tenant's admissions.
    qc = conn.execute(
        """select count(*) filter (where user_id = %(u)s) as user_tasks,
                  coalesce(sum(fairness_units) filter (where user_id = %(u)s), 0)::bigint as user_units,
                  count(*) as tenant_tasks, coalesce(sum(fairness_units), 0)::bigint as tenant_units,
                  coalesce(sum(fairness_units) filter (where queue_class = %(lane)s), 0)::bigint as lane_units
             from generation_task where tenant_id = %(t)s and state = 'QUEUED'""",
        {"u": caller.user_id, "t": caller.tenant_id, "lane": est.queue_class},
    ).fetchone()
    u = est.fairness_units
    if qc["user_tasks"] + 1 > policy["max_user_queued_tasks"] or qc["user_units"] + u > policy["max_user_queued_units"]:
        raise Rejected("REJECT_USER_QUEUE_FULL", "this user's queue is full", 60)
    if qc["tenant_tasks"] + 1 > policy["max_queued_tasks"] or qc["tenant_units"] + u > policy["max_queued_units"]:
        raise Rejected("REJECT_TENANT_QUEUE_FULL", "this tenant's queue is full", 60)

    windows = _window_starts(platform, now)
    spent = {r["window_kind"]: r["cost_units"] for r in conn.execute(
        """select window_kind, cost_units from tenant_cost_window
            where tenant_id = %s and ((window_kind = 'MINUTE' and window_start = %s) or (window_kind = 'DAY' and window_start = %s))""",
        (caller.tenant_id, windows["MINUTE"], windows["DAY"]),
    ).fetchall()}
    if spent.get("MINUTE", 0) + est.estimated_cost_units > policy["max_cost_per_minute"]:
        raise Rejected("REJECT_COST_BUDGET", "tenant cost budget per minute reached", int(platform.clock.real_seconds(60)) or 1)
    if spent.get("DAY", 0) + est.estimated_cost_units > policy["max_cost_per_day"]:
        raise Rejected("REJECT_COST_BUDGET", "tenant cost budget per day reached", 3600)

    decision, lane, band = ACCEPTED, est.queue_class, est.priority_band
    stats = queue_stats.lane_stats(platform, lane, conn=conn)  # this transaction's connection: it holds the wallet lock
    wait = queue_stats.expected_wait_seconds(stats, tenant_weight=policy["weight"], tenant_queued_units=qc["lane_units"],
                                             tenant_active=qc["lane_units"] > 0, units=u)
    max_wait = platform.clock.real_seconds(policy["max_wait_seconds"])
    if wait > max_wait:
        be_lane = platform.config.lanes["BEST_EFFORT"]
        be = queue_stats.lane_stats(platform, "BEST_EFFORT", conn=conn) if be_lane.admission_open else None
        # Downgrade only into a BEST_EFFORT lane that is open to admission and has room.
        if (policy["allow_best_effort_downgrade"] and not est.is_expensive and be is not None
                and be.queued_units + u <= be_lane.max_queue_units):
            decision, lane, band = ACCEPTED_BEST_EFFORT, "BEST_EFFORT", 4
            wait = queue_stats.expected_wait_seconds(be, tenant_weight=policy["weight"], tenant_queued_units=0, tenant_active=False, units=u)
        else:
            # The wait is infinite when the lane has no capacity and no completions: cap the hint.
            raise Rejected("REJECT_EXPECTED_WAIT_TOO_LONG", f"expected wait {wait:.0f}s exceeds {max_wait:.0f}s",
                           max(1, int(min(wait - max_wait, MAX_RETRY_AFTER_SECONDS))))

    if not can_reserve(wallet, q.max_reserve_amount):
        raise Rejected("REJECT_INSUFFICIENT_CREDIT", f"needs {q.max_reserve_amount} {q.unit}; {max(0, wallet['available_amount'])} available")

    # The writes below mostly need no answer, so they travel together in pipeline mode.
    with conn.pipeline():
        start_at = now + timedelta(seconds=min(wait, 10 * 365 * 86400))
        conn.execute(
            """insert into generation_task
                  (task_id, tenant_id, user_id, queue_class, priority_band, base_priority_band, resource_class, state, model_code,
                   fairness_units, provider_slot_units, estimated_cost_units, enqueue_at, next_eligible_at, policy_version,
                   estimate_version, idempotency_key, created_at, updated_at, mode, prompt, duration_seconds, resolution,
                   with_audio, interactive, inputs, normalized_params, gpu_units, media_units, admission_decision, project_id)
               values (%s, %s, %s, %s, %s, %s, %s, 'QUEUED', %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,
                       %s)""",
            (task_id, caller.tenant_id, caller.user_id, lane, band, band, est.resource_class, est.model, u,
             est.provider_slot_units, est.estimated_cost_units, now, now, policy["policy_version"], est.estimate_version, key,
             now, now, est.mode, req.prompt, est.duration_seconds, est.resolution, est.with_audio, est.interactive,
             json.dumps([i.model_dump() for i in req.inputs]), json.dumps(est.normalized_params()), est.gpu_units,
             est.media_units, decision, caller.project),
        )
        try:
            reserve(conn, wallet=wallet, task_id=task_id, quoted_amount=q.quoted_amount, amount=q.max_reserve_amount,
                    price_version_id=q.price_version_id, charge_policy_code=q.charge_policy_code, now=now)
        except InsufficientCredit as e:
            raise Rejected("REJECT_INSUFFICIENT_CREDIT", str(e)) from None
        except LotsExhausted as e:
            # The snapshot still counts lots that expired and await their EXPIRE: not spendable credit.
            logger.warning("wallet available exceeds its live lots", extra={"tenant_id": str(caller.tenant_id), "error": str(e)})
            raise Rejected("REJECT_INSUFFICIENT_CREDIT", "not enough unexpired credit") from None
        conn.execute(
            """insert into generation_charge (task_id, tenant_id, price_version_id, normalized_params, quoted_amount,
                                              max_reserve_amount, charge_policy_code)
               values (%s, %s, %s, %s, %s, %s, %s)""",
            (task_id, caller.tenant_id, q.price_version_id, json.dumps(est.normalized_params()), q.quoted_amount,
             q.max_reserve_amount, q.charge_policy_code),
        )
        with conn.cursor() as cur:
            cur.executemany(
                """insert into tenant_cost_window (tenant_id, window_kind, window_start, cost_units) values (%s, %s, %s, %s)
                   on conflict (tenant_id, window_kind, window_start) do update set cost_units = tenant_cost_window.cost_units + excluded.cost_units""",
                [(caller.tenant_id, kind, start, est.estimated_cost_units) for kind, start in windows.items()],
            )
        outbox.write_event(conn, "TaskQueued", aggregate_type="generation_task", aggregate_id=task_id, tenant_id=caller.tenant_id,
                           payload={"task_id": str(task_id), "tenant_id": str(caller.tenant_id), "queue_class": lane,
                                    "priority_band": band, "fairness_units": u, "enqueue_at": now.isoformat()})
        body = json.dumps({
            "task_id": str(task_id),
            "state": "QUEUED",
            "decision": decision,
            "queue_class": lane,
            "estimated_start_at": start_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "queue_position_level": queue_stats.position_level(wait, max_wait),
            "quote": {"price_version_id": str(q.price_version_id), "quoted_amount": q.quoted_amount,
                      "max_reserve_amount": q.max_reserve_amount, "unit": q.unit},
        })
        # The record this request claimed (locked at the start of the transaction) answers from now on.
        conn.execute(COMPLETE_KEY, {"status": 202, "body": body, "t": caller.tenant_id, "k": key, "token": task_id,
                                    "expires": now + platform.clock.delta(platform.config.timers.idempotency_ttl_seconds)})
    logger.info("task admitted", extra={"tenant_id": str(caller.tenant_id), "task_id": str(task_id), "decision": decision,
                                        "queue_class": lane, "fairness_units": u, "reserved": q.max_reserve_amount})
    return Admitted(202, body)


__all__ = ["admit", "quote_only", "Admitted", "IdempotencyKeyReused", "IdempotencyInProgress", "Conflict"]
