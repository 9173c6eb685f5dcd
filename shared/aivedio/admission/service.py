"""Admission (ch. 18.3.1, 18.5, 18.11; ch. 20.4.1, 20.6.1-20.6.2): decide, with a reason code and an
estimated start, whether a request enters the platform; if it does, write everything in one
transaction: idempotency record, wallet lock, RESERVE across credit lots, reservation, task, charge
snapshot and a TaskQueued outbox event. A rejection raises inside that transaction: nothing is written."""
from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

import psycopg

from aivedio import outbox
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
from aivedio.metrics_catalog import ADMISSION_REJECTIONS
from aivedio.observability import logger, metrics, publish
from aivedio.pricing import price_book
from aivedio.pricing.price_book import Quote

IDEMPOTENCY_LOCK_NS = "idem"
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
    probed = probe_inputs(req.inputs, max_bytes=limits.max_input_bytes, max_duration_seconds=limits.max_input_duration_seconds)
    est = estimate(req, probed, policy["tenant_service_class"], platform.config)
    return est, price_book.quote(price_book.current_version(platform), est)


def quote_only(platform, caller: Caller, req: GenerationRequest) -> dict:
    with platform.db.connection() as conn:
        policy = load_policy(conn, caller.tenant_id)
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
    metrics.add("admission_accepted")
    return result


def _admit(platform, caller: Caller, req: GenerationRequest, raw_body: dict, idempotency_key: str) -> Admitted:
    key = validate_idempotency_key(idempotency_key)
    req_hash = request_hash(raw_body)
    with platform.db.connection() as conn:
        record = conn.execute(
            "select * from idempotency_record where tenant_id = %s and idempotency_key = %s", (caller.tenant_id, key)
        ).fetchone()
    if record is not None:
        return _replay(record, req_hash)

    with platform.db.connection() as conn:
        policy = load_policy(conn, caller.tenant_id)
    _check_rates(platform, caller, policy)
    est, q = prepare(platform, policy, req)
    _check_lane(platform, policy, est)
    _check_budgets(platform, caller, est)

    def tx(conn: psycopg.Connection) -> Admitted:
        got = conn.execute("select pg_try_advisory_xact_lock(hashtextextended(%s, 0)) as ok",
                           (f"{IDEMPOTENCY_LOCK_NS}:{caller.tenant_id}:{key}",)).fetchone()["ok"]
        if not got:
            raise IdempotencyInProgress("a request with this Idempotency-Key is still being processed")
        rec = conn.execute(
            "select * from idempotency_record where tenant_id = %s and idempotency_key = %s", (caller.tenant_id, key)
        ).fetchone()
        if rec is not None:
            return _replay(rec, req_hash)
        return _admit_locked(platform, conn, caller, req, key, req_hash, policy, est, q)

    return platform.db.transaction(tx)


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
    if queue_stats.outbox_backlog(platform) > platform.config.limits.outbox_backlog_reject_threshold:
        raise Rejected("REJECT_PLATFORM_OVERLOADED", "the platform is overloaded; retry later", 30)
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


def _admit_locked(platform, conn, caller: Caller, req: GenerationRequest, key: str, req_hash: str,
                  policy: dict, est: Estimate, q: Quote) -> Admitted:
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
        task_id = uuid.uuid4()
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
        conn.execute(
            """insert into idempotency_record (tenant_id, idempotency_key, request_hash, status, response_status, response_body,
                                               task_id, created_at, expires_at)
               values (%s, %s, %s, 'COMPLETED', 202, %s, %s, %s, %s)""",
            (caller.tenant_id, key, req_hash, body, task_id, now, now + timedelta(seconds=platform.config.timers.idempotency_ttl_seconds)),
        )
    logger.info("task admitted", extra={"tenant_id": str(caller.tenant_id), "task_id": str(task_id), "decision": decision,
                                        "queue_class": lane, "fairness_units": u, "reserved": q.max_reserve_amount})
    return Admitted(202, body)


__all__ = ["admit", "quote_only", "Admitted", "IdempotencyKeyReused", "IdempotencyInProgress", "Conflict"]
