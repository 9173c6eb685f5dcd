"""Admission (ch. 18.3.1, 18.5, 18.11; ch. 20.4.1, 20.6.1-20.6.2): decide, with a reason code and an
estimated start, whether a request enters the platform; if it does, write everything in one
transaction: the completed idempotency record, wallet lock, RESERVE across credit lots, reservation,
task, charge snapshot and a TaskQueued outbox event. A rejection writes nothing.

The Python side authenticates (the API's gate), validates, takes the tenant's policy from its
per-process cache (tenant_policy), takes the user's and the tenant's submit rates in one Redis call,
estimates and quotes, and pre-checks the lane and the provider budgets; the write path is then one
call of the aivedio_admit function (aivedio.admission.write, migrations 0190 to 0240), which answers
a key's record first, refuses a call decided under a policy no longer in force (the caller decides
again), and makes every check that must hold under the wallet lock (queue limits, cost windows,
expected wait, credit) and every write: one PostgreSQL round trip. A key's record answers whatever
came before the call: a replay gives back the rate tokens it took, and a request refused before the
call asks the record (a round trip on that path only) before it answers with its refusal.

Idempotency (docs/tenant-api.md) covers the whole request: before any slow work (the input
probe) a request with inputs claims its key with an IN_PROGRESS idempotency_record, committed on
its own, so a second request with the key answers 409 IDEMPOTENCY_IN_PROGRESS while the first is
still probing. The admission call turns the record COMPLETED with the response; a rejection (or any
error) deletes it, so the key can be retried and a rejected request leaves nothing behind. The
record's task_id is chosen at the claim and is its owner's token: only the request that claimed a
record completes or deletes it. A request without inputs does no slow work: its one call claims the
key and completes it at once (a concurrent request with the key waits for the wallet lock, then
replays the answer). A request that died keeps its record IN_PROGRESS until locked_until
(Timers.idempotency_lock_seconds); then the next request with the key takes it over by CAS. A
record expires at expires_at (Timers.idempotency_ttl_seconds) and is no longer replayed;
aivedio.reconcile.idempotency_purge deletes expired records. A key stays spent after its record
expired (one task per key: the generation_task constraint), so its reuse answers
IDEMPOTENCY_KEY_REUSED rather than admitting a duplicate."""
from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from datetime import datetime

import psycopg

from aivedio import degraded, outbox
from aivedio.admission import write
from aivedio.admission.decisions import Rejected
from aivedio.admission.models import GenerationRequest
from aivedio.admission.rate_limits import give_back, take_all
from aivedio.auth import Caller
from aivedio.errors import Conflict, DomainError, InvalidRequest
from aivedio.faults import safeguards
from aivedio.media.probe import probe_inputs
from aivedio.metrics_catalog import ADMISSION_REJECTIONS, ADMISSIONS_ACCEPTED
from aivedio.observability import logger, publish
from aivedio.policy import capacity
from aivedio.pricing import price_book
from aivedio.pricing.estimates import Estimate, check_capabilities, estimate
from aivedio.pricing.price_book import Quote
from aivedio.scheduling import queue_stats
from aivedio.spend import budgets

MAX_RETRY_AFTER_SECONDS = write.MAX_RETRY_AFTER_SECONDS  # the longest Retry-After a rejection suggests


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
# Completing a record is aivedio_admit's, in the admission's one call (aivedio.admission.write).


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
    return _estimate(platform, policy, req, _probe(platform, policy["tenant_id"], req))


def _probe(platform, tenant_id, req: GenerationRequest) -> list:
    check_capabilities(req, platform.config)  # an unknown model, or a duration or resolution it lacks, fails before any fetch
    return probe_inputs(req.inputs, tenant_id=tenant_id, limits=platform.config.limits,
                        media_bucket=platform.settings.media_bucket)


def _estimate(platform, policy: dict, req: GenerationRequest, probed: list) -> tuple[Estimate, Quote]:
    est = estimate(req, probed, policy["tenant_service_class"], platform.config)
    try:
        return est, price_book.admission_quote(platform, est)
    except price_book.PricesUnavailable as e:
        raise Rejected("REJECT_PRICING_UNAVAILABLE", e.message, e.retry_after_seconds) from None


def quote_only(platform, caller: Caller, req: GenerationRequest) -> dict:
    """A quote probes inputs and prices like an admission, so it spends the same submit rate limits."""
    with platform.db.connection() as conn:
        policy = load_policy(conn, caller.tenant_id)
    try:
        _Rates(platform, caller).take(policy)
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


# The policy's columns admission reads (each column more is a value decoded on every load).
SELECT_POLICY = """select p.tenant_id, t.service_class as tenant_service_class, p.policy_version, p.weight,
                          p.user_submit_rate_per_minute, p.tenant_submit_rate_per_minute, p.expensive_allowed,
                          p.allow_best_effort_downgrade, p.max_user_queued_tasks, p.max_user_queued_units,
                          p.max_queued_tasks, p.max_queued_units, p.max_cost_per_minute, p.max_cost_per_day,
                          p.max_wait_seconds
                     from tenant_scheduling_policy p join tenant t using (tenant_id)
                    where p.tenant_id = %(t)s"""
POLICY_CACHE_SECONDS = 1.0  # as admission's other per-process caches (aivedio.caching.CACHE_SECONDS)
POLICY_CACHE_MAX_TENANTS = 10_000  # a flood of tenants clears the cache rather than growing it
POLICY_TRIES = 3  # calls decided under a policy that changed meanwhile, before giving up


def tenant_policy(platform, tenant_id, *, fresh: bool = False) -> dict:
    """The tenant's policy as admission reads it, cached per process for POLICY_CACHE_SECONDS. A
    cached policy never decides alone: aivedio_admit refuses a call decided under a version that is
    no longer in force (POLICY_STALE, migration 0240), and the caller asks again with fresh=True.
    Every policy change moves policy_version (aivedio.policy.tenant_policy)."""
    cache = platform.extras.setdefault("admission_policies", {})
    now = time.monotonic()
    hit = None if fresh else cache.get(tenant_id)
    if hit is not None and now - hit[1] < POLICY_CACHE_SECONDS:
        return hit[0]
    policy = platform.db.fetchone(SELECT_POLICY, {"t": tenant_id})
    if policy is None:
        raise RuntimeError(f"tenant {tenant_id} has no scheduling policy")
    if len(cache) >= POLICY_CACHE_MAX_TENANTS:
        cache.clear()
    cache[tenant_id] = (policy, now)
    return policy


def _record_holding_key(platform, tenant_id, key: str) -> dict | None:
    """The key's record if it holds the key. Asked when a request is refused before the call, so
    that a replay answers whatever the rates, the lanes or the config say now, as the call answers
    it before any check of its own."""
    record = platform.db.fetchone(SELECT_KEY, (tenant_id, key))
    return record if record is not None and holds_key(record, platform.clock.now()) else None


def _admit(platform, caller: Caller, req: GenerationRequest, raw_body: dict, idempotency_key: str) -> Admitted:
    """One round trip to PostgreSQL for an admission without inputs: the policy comes from the
    process's cache and the key's record is read by the call, so the rates are taken before the
    record is known: a request its key answers (a replay, a key in progress, reused or spent) gives
    its tokens back, so it spends no rate. A refusal decided here before the call may come from a
    cached policy up to POLICY_CACHE_SECONDS old in a process other than the one that changed it;
    nothing is ever written under a policy that has changed."""
    key = validate_idempotency_key(idempotency_key)
    if safeguards.broken("idempotency-lock"):
        # A chaos run only: a key of its own per request, so no record or task ever shares it and a
        # duplicate submit makes a second task (the record's lock and the task's unique key both pass).
        key = f"{key[:222]}#{uuid.uuid4().hex}"
    req_hash = request_hash(raw_body)
    rates = _Rates(platform, caller)
    policy = tenant_policy(platform, caller.tenant_id)
    claimed = bool(req.inputs)
    token = None
    refused_before_call = True
    try:
        rates.take(policy)
        # A request with inputs fetches them (slow): it claims its key first, committed, so a second
        # request with the key answers 409 meanwhile. One without inputs claims it in the one call.
        if claimed:
            token = _claim(platform, caller.tenant_id, key, req_hash)
            if isinstance(token, Admitted):
                rates.give_back()
                return token
        else:
            token = uuid.uuid4()
        probed = _probe(platform, caller.tenant_id, req)  # once: a fetch of the inputs is slow
        for attempt in range(POLICY_TRIES):
            refused_before_call = True
            if attempt:  # the call answered POLICY_STALE: decide again under the policy in force
                fresh = tenant_policy(platform, caller.tenant_id, fresh=True)
                if _submit_buckets(caller, fresh) != _submit_buckets(caller, policy):  # its rates too
                    rates.give_back()
                    rates.take(fresh)
                policy = fresh
            est, q = _estimate(platform, policy, req, probed)
            _check_lane(platform, policy, est)
            _check_budgets(platform, caller, est)
            refused_before_call = False
            try:
                got = write.admit_once(platform, write.params(
                    platform, caller, req, key, req_hash, policy, est, q, task_id=token, claimed=claimed,
                    lane=queue_stats.lane_stats(platform, est.queue_class),
                    best_effort=_best_effort_stats(platform, policy, est)))
                break
            except write.PolicyStale:
                continue
        else:
            raise RuntimeError(f"the policy of tenant {caller.tenant_id} changed during each of {POLICY_TRIES} admission calls")
    except write.KeyLost:
        rates.give_back()  # answered by its key, as every answer of the idempotency record's
        raise IdempotencyInProgress("a request with this Idempotency-Key is still being processed") from None
    except write.KeySpent:
        rates.give_back()
        raise IdempotencyKeyReused(
            "this Idempotency-Key was already used, and its record has expired: send a new key",
            details={"fields": {"header.Idempotency-Key": "already used; its idempotency window has passed"}}) from None
    except (IdempotencyKeyReused, IdempotencyInProgress):  # the claim's answers: the key's record's
        rates.give_back()
        raise
    except (Rejected, InvalidRequest):
        if claimed and token is not None:
            _release(platform, caller.tenant_id, key, token)  # only our own IN_PROGRESS record: the key is free again
            raise
        # Refused before the call: the key's record, if it holds the key, answers instead.
        record = _record_holding_key(platform, caller.tenant_id, key) if refused_before_call else None
        if record is None:
            raise
        rates.give_back()
        return _replay(record, req_hash)
    except BaseException:
        if claimed and isinstance(token, uuid.UUID):
            _release(platform, caller.tenant_id, key, token)
        raise
    if isinstance(got, write.RecordAnswers):  # the key's record answers: a replay, or another request's meanwhile
        rates.give_back()
        return _replay(got.record, req_hash)
    logger.info("task admitted", extra={"tenant_id": str(caller.tenant_id), "task_id": str(token), "decision": got.decision,
                                        "queue_class": got.queue_class, "fairness_units": est.fairness_units,
                                        "reserved": q.max_reserve_amount, "path": got.path})
    return Admitted(202, got.body)


def _best_effort_stats(platform, policy: dict, est: Estimate) -> queue_stats.LaneStats | None:
    """The BEST_EFFORT lane's figures when a too-long wait may be downgraded into it: the policy
    allows it, the work is not expensive and the lane is open to admission."""
    if not policy["allow_best_effort_downgrade"] or est.is_expensive or not platform.config.lanes["BEST_EFFORT"].admission_open:
        return None
    return queue_stats.lane_stats(platform, "BEST_EFFORT")


def _submit_buckets(caller: Caller, policy: dict) -> list[tuple[str, int]]:
    return [(f"user:{caller.user_id}:submit", policy["user_submit_rate_per_minute"]),
            (f"tenant:{caller.tenant_id}:submit", policy["tenant_submit_rate_per_minute"])]


class _Rates:
    """A request's submit tokens: the user's bucket, then the tenant's, in one Redis call, and what
    it holds of them, so that a request the key's record answers gives back exactly those."""

    def __init__(self, platform, caller: Caller):
        self.platform, self.caller = platform, caller
        self.held: list[tuple[str, int]] = []

    def take(self, policy: dict) -> None:
        buckets = _submit_buckets(self.caller, policy)
        refused = take_all(self.platform, buckets, slot=str(self.caller.tenant_id))
        if refused is None:
            self.held = buckets
            return
        index, d = refused
        self.held = buckets[:index]  # the buckets before the one that refused gave
        if index == 0:
            raise Rejected("REJECT_USER_RATE_LIMIT", "user submit rate exceeded", d.retry_after_seconds)
        raise Rejected("REJECT_TENANT_RATE_LIMIT", "tenant submit rate exceeded", d.retry_after_seconds)

    def give_back(self) -> None:
        """Each bucket refills to its capacity, no further."""
        held, self.held = self.held, []
        if not held:
            return
        try:
            give_back(self.platform, held, slot=str(self.caller.tenant_id))
        except Exception as e:  # noqa: BLE001 - the record's answer stands; the bucket refills on its own
            logger.warning("submit rate tokens not given back", extra={"tenant_id": str(self.caller.tenant_id), "error": str(e)})


def _check_lane(platform, policy: dict, est: Estimate) -> None:
    if est.is_expensive and not policy["expensive_allowed"]:
        raise Rejected("REJECT_RESOURCE_CLASS_DISABLED", f"{est.resource_class} work ({est.queue_class}) is not in this tenant's contract")
    lane = capacity.effective_config(platform).lanes[est.queue_class]  # the config with an operator's overrides
    if not lane.admission_open:
        raise Rejected("REJECT_RESOURCE_CLASS_DISABLED", f"admission to {est.queue_class} is closed", 60)
    if not capacity.resource_class_open(platform, est.resource_class):
        raise Rejected("REJECT_RESOURCE_CLASS_DISABLED", f"admission of {est.resource_class} work is closed", 60)
    overload = outbox.outbox_overload(platform)
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


__all__ = ["admit", "quote_only", "Admitted", "IdempotencyKeyReused", "IdempotencyInProgress", "Conflict"]
