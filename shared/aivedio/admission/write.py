"""Admission's write path in one round trip: one call of the aivedio_admit function (migration
0190, with the slots of partitioned wallets since 0195, rewritten for its cost in 0230, checking the
caller's policy version since 0240), which locks the wallet (or, for a partitioned wallet, the
admitting user's slot), checks the idempotency record, that the policy the caller decided under is
still in force, the queue limits, the cost windows, the expected wait and the credit under that
lock, and writes the COMPLETED idempotency record, the task, the RESERVE across credit lots
(reservation, allocations, ledger transaction and entries, wallet snapshot, or the slot's
allowance), the charge snapshot, the cost windows and the TaskQueued outbox row. A refusal writes
nothing: the function only reads and locks before its first write.

The call runs alone on an autocommit connection, so the statement is the whole transaction and
the wallet lock is held for the function's work and the commit only; the function refuses to run
in a transaction that has written before it (it makes the deferred constraints immediate for the
rest of its transaction). This module owns the call (ADMIT), the parameters it is given and the
answers it gives (`status`), which it maps to the admission's codes. A slot that cannot admit alone
(its allowance short of the task, or the tenant near a limit the slots could pass together) answers
SLOT_SHORT, and the call is made again on the merged path: a second round trip, for a refill or near
a tenant-wide limit only."""
from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg.types.json import Jsonb

from aivedio import outbox
from aivedio.admission.decisions import Rejected
from aivedio.admission.models import GenerationRequest
from aivedio.db.pool import MAX_TX_ATTEMPTS, RETRYABLE
from aivedio.observability import logger
from aivedio.pricing.estimates import Estimate
from aivedio.pricing.price_book import Quote
from aivedio.scheduling.queue_stats import LaneStats

MAX_RETRY_AFTER_SECONDS = 3600  # the longest Retry-After a rejection suggests
# One task per key: an admission whose key's record expired while its task keeps the key fails on it.
SPENT_KEY_CONSTRAINT = "generation_task_tenant_idempotency_key"

# The call's arguments in order, each with its SQL type where the function needs one named. The call
# uses PostgreSQL's own placeholders ($1...): psycopg converts a query with %(name)s placeholders on
# every execution when it has more than 50 parameters, and this one has 57.
ADMIT_ARGS = (
    ("tenant", ""), ("user", ""), ("task", ""), ("key", ""), ("hash", ""), ("claimed", ""), ("now", ""),
    ("now_iso", "text"), ("record_expires", ""), ("queue_class", "text"), ("band", "smallint"),
    ("resource_class", "text"), ("model", "text"), ("units", "bigint"), ("slot_units", "bigint"),
    ("cost_units", "bigint"), ("gpu_units", "bigint"), ("media_units", "bigint"), ("mode", "text"), ("prompt", "text"),
    ("duration", "integer"), ("resolution", "text"), ("with_audio", ""), ("interactive", ""), ("inputs", ""),
    ("params", ""), ("expensive", ""), ("estimate_version", "bigint"), ("project", "text"), ("policy_version", "bigint"),
    ("weight", "bigint"), ("max_user_tasks", "bigint"), ("max_user_units", "bigint"), ("max_tasks", "bigint"),
    ("max_units", "bigint"), ("max_cost_minute", "bigint"), ("max_cost_day", "bigint"), ("max_wait", "float8"),
    ("minute_start", ""), ("day_start", ""), ("lane_units", "bigint"), ("lane_weight", "bigint"), ("lane_mu", "float8"),
    ("be_allowed", ""), ("be_units", "bigint"), ("be_weight", "bigint"), ("be_mu", "float8"), ("be_max_units", "bigint"),
    ("price_version", ""), ("quoted", "bigint"), ("amount", "bigint"), ("charge_policy", "text"), ("unit", "text"),
    ("event_id", ""), ("merged", ""),
)
ADMIT = "select * from aivedio_admit(" + ", ".join(
    f"p_{name} => ${i}" + (f"::{cast}" if cast else "") for i, (name, cast) in enumerate(ADMIT_ARGS, 1)) + ")"


@dataclass(frozen=True)
class Written:
    body: str  # the response, as the idempotency record stores it
    decision: str
    queue_class: str
    path: str  # WALLET, SLOT or MERGED (migration 0195)


@dataclass(frozen=True)
class RecordAnswers:
    """The key is held by a record that is not this request's: it answers (a replay, or a refusal)."""
    record: dict


class KeyLost(Exception):
    """This request claimed its key, outlived the claim's lock, and another request took it over."""


class KeySpent(Exception):
    """The key's record expired, and its task still holds the key (one task per key)."""


class PolicyStale(Exception):
    """The tenant's policy moved on from the version the call was decided under (migration 0240)."""


def window_starts(platform, now: datetime) -> dict[str, datetime]:
    """The cost windows `now` falls in (the minute and the day, in real seconds)."""
    out = {}
    for kind, seconds in (("MINUTE", 60), ("DAY", 86400)):
        span = platform.clock.real_seconds(seconds)
        epoch = now.timestamp()
        out[kind] = datetime.fromtimestamp(epoch - (epoch % span), tz=now.tzinfo)
    return out


def params(platform, caller, req: GenerationRequest, key: str, req_hash: str, policy: dict, est: Estimate, q: Quote, *,
           task_id: uuid.UUID, claimed: bool, lane: LaneStats, best_effort: LaneStats | None) -> dict:
    """The call's parameters; `best_effort` is the BEST_EFFORT lane's figures when a downgrade into
    it is allowed (the policy allows it, the work is not expensive, the lane is open), else None."""
    now = platform.clock.now()
    windows = window_starts(platform, now)
    be_lane = platform.config.lanes["BEST_EFFORT"]
    normalized = est.normalized_params()
    return {
        "tenant": caller.tenant_id, "user": caller.user_id, "task": task_id, "key": key, "hash": req_hash,
        "claimed": claimed, "now": now, "now_iso": now.isoformat(),
        "record_expires": now + platform.clock.delta(platform.config.timers.idempotency_ttl_seconds),
        "queue_class": est.queue_class, "band": est.priority_band, "resource_class": est.resource_class, "model": est.model,
        "units": est.fairness_units, "slot_units": est.provider_slot_units, "cost_units": est.estimated_cost_units,
        "gpu_units": est.gpu_units, "media_units": est.media_units, "mode": est.mode, "prompt": req.prompt,
        "duration": est.duration_seconds, "resolution": est.resolution, "with_audio": est.with_audio,
        "interactive": est.interactive, "inputs": Jsonb([i.model_dump() for i in req.inputs]), "params": Jsonb(normalized),
        "expensive": est.is_expensive, "estimate_version": est.estimate_version, "project": caller.project,
        "policy_version": policy["policy_version"], "weight": policy["weight"],
        "max_user_tasks": policy["max_user_queued_tasks"], "max_user_units": policy["max_user_queued_units"],
        "max_tasks": policy["max_queued_tasks"], "max_units": policy["max_queued_units"],
        "max_cost_minute": policy["max_cost_per_minute"], "max_cost_day": policy["max_cost_per_day"],
        "max_wait": platform.clock.real_seconds(policy["max_wait_seconds"]),
        "minute_start": windows["MINUTE"], "day_start": windows["DAY"],
        "lane_units": lane.queued_units, "lane_weight": lane.active_weight, "lane_mu": lane.mu_units_per_second,
        "be_allowed": best_effort is not None,
        "be_units": best_effort.queued_units if best_effort else 0, "be_weight": best_effort.active_weight if best_effort else 0,
        "be_mu": best_effort.mu_units_per_second if best_effort else 0.0, "be_max_units": be_lane.max_queue_units,
        "price_version": q.price_version_id, "quoted": q.quoted_amount, "amount": q.max_reserve_amount,
        "charge_policy": q.charge_policy_code, "unit": q.unit, "event_id": uuid.uuid4(), "merged": False,
    }


def call(platform, p: dict) -> dict:
    """The one round trip, alone in its transaction; retried whole on deadlock or serialization
    failure (nothing of a failed call remains)."""
    for attempt in range(1, MAX_TX_ATTEMPTS + 1):
        try:
            with platform.db.connection() as conn:
                return psycopg.RawCursor(conn).execute(ADMIT, [p[name] for name, _ in ADMIT_ARGS]).fetchone()
        except RETRYABLE as e:
            if attempt == MAX_TX_ATTEMPTS:
                raise
            delay = min(0.2, 0.005 * (2 ** attempt)) * (0.5 + random.random())
            logger.info("admission retry", extra={"attempt": attempt, "error": type(e).__name__})
            time.sleep(delay)
    raise AssertionError("unreachable")


def admit_once(platform, p: dict) -> Written | RecordAnswers:
    """Call aivedio_admit; map a refusal to its Rejected (raised), the idempotency answers to
    RecordAnswers, KeyLost or KeySpent, and a policy that changed since the caller read it to
    PolicyStale."""
    try:
        row = call(platform, p)
        if row["status"] == "SLOT_SHORT":
            # A partitioned wallet's slot could not admit alone (its allowance ran short, or the
            # tenant is near a limit the slots could pass together): the merged path decides.
            row = call(platform, {**p, "merged": True})
    except psycopg.errors.UniqueViolation as e:
        if e.diag.constraint_name == SPENT_KEY_CONSTRAINT:  # the call wrote nothing: it failed whole
            raise KeySpent() from None
        raise
    status = row["status"]
    if status == "ADMITTED":
        outbox._count_written(1)  # the function wrote a TaskQueued row: outbox.waking_relay() wakes the relay
        return Written(row["body"], row["decision"], row["queue_class"], row["path"])
    if status == "RECORD":
        return RecordAnswers({"request_hash": row["rec_hash"], "status": row["rec_status"],
                              "response_status": row["rec_response_status"], "response_body": row["rec_body"]})
    if status == "IN_PROGRESS":
        raise KeyLost()
    if status == "KEY_SPENT":
        raise KeySpent()
    if status == "POLICY_STALE":
        raise PolicyStale()
    raise rejection(platform, row, p)


def rejection(platform, row: dict, p: dict) -> Rejected:
    """The Rejected of a refusal the function answered, with today's messages and Retry-After."""
    status = row["status"]
    if status == "NO_WALLET":
        return Rejected("REJECT_INSUFFICIENT_CREDIT", "the tenant has no wallet")
    if status == "WALLET_FROZEN":
        return Rejected("REJECT_WALLET_FROZEN", f"wallet frozen: {row['detail'] or 'under review'}")
    if status == "USER_QUEUE_FULL":
        return Rejected("REJECT_USER_QUEUE_FULL", "this user's queue is full", 60)
    if status == "TENANT_QUEUE_FULL":
        return Rejected("REJECT_TENANT_QUEUE_FULL", "this tenant's queue is full", 60)
    if status == "COST_MINUTE":
        return Rejected("REJECT_COST_BUDGET", "tenant cost budget per minute reached", int(platform.clock.real_seconds(60)) or 1)
    if status == "COST_DAY":
        return Rejected("REJECT_COST_BUDGET", "tenant cost budget per day reached", 3600)
    if status == "WAIT_TOO_LONG":
        wait, max_wait = row["wait_seconds"], p["max_wait"]
        # The wait is infinite when the lane has no capacity and no completions: cap the hint.
        return Rejected("REJECT_EXPECTED_WAIT_TOO_LONG", f"expected wait {wait:.0f}s exceeds {max_wait:.0f}s",
                        max(1, int(min(wait - max_wait, MAX_RETRY_AFTER_SECONDS))))
    if status == "INSUFFICIENT_CREDIT":
        return Rejected("REJECT_INSUFFICIENT_CREDIT", f"needs {p['amount']} {p['unit']}; {max(0, row['amount'])} available")
    if status == "CONTRACT_BUDGET":
        return Rejected("REJECT_INSUFFICIENT_CREDIT", f"the contract budget of this billing period has {max(0, row['amount'])} "
                                                      f"left, {p['amount']} needed")
    if status == "LOTS_EXHAUSTED":
        # The snapshot still counts lots that expired and await their EXPIRE: not spendable credit.
        logger.warning("wallet available exceeds its live lots", extra={"tenant_id": str(p["tenant"]), "error": row["detail"]})
        return Rejected("REJECT_INSUFFICIENT_CREDIT", "not enough unexpired credit")
    raise RuntimeError(f"aivedio_admit answered an unknown status {status!r}")


__all__ = ["ADMIT", "Written", "RecordAnswers", "KeyLost", "KeySpent", "PolicyStale", "admit_once", "params",
           "window_starts"]
