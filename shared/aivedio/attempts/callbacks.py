"""Provider webhooks (POST /v1/providers/{provider}/callbacks). A webhook is verified (Standard
Webhooks signature and timestamp tolerance), deduplicated on its webhook-id, and then applied by
the same transition function as polling (lifecycle.apply_job).

Answers, so a provider's retries do the right thing:
- applied, or already known: 200 (a repeated webhook-id is acknowledged and changes nothing);
- a job the platform has no attempt for (yet: a webhook can overtake the submit's answer, and the
  job of an attempt in review whose submit stayed unknown is unmapped until a lookup or an operator
  adopts it): 202 {"status": "parked"}. The verified body is kept whole in parked_webhook (one row
  per webhook-id, so a repeated delivery parks nothing more) and the job is recorded as an
  UNMAPPED orphan; the parked-webhooks service (aivedio.reconcile.parked_webhooks) applies it once
  the job is mapped, and matches it through lookups by key of the attempts in review. A parked
  webhook is never dropped: unmapped for good, it stays an orphan for invoice reconciliation;
- a job whose attempt was replaced (stale fencing token): refused with 409, logged, and the job
  recorded as an orphan for reconciliation (the orphan-jobs service cancels or costs it);
- a bad signature or a stale timestamp: 401; an unknown provider: 404; a malformed body: 422."""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping

import psycopg
from psycopg.types.json import Jsonb

from aivedio.attempts.lifecycle import AttemptRef, apply_job, lock_job, record_orphan
from aivedio.config import ConfigError
from aivedio.errors import DomainError, InvalidRequest, NotFound, Unauthenticated
from aivedio.faults import failpoints, safeguards
from aivedio.metrics_catalog import WEBHOOKS_RECEIVED, WEBHOOKS_REFUSED
from aivedio.observability import logger, publish
from aivedio.providers.adapter import MalformedDocument, parse_job
from aivedio.providers.webhooks import verify_webhook

EVENT_TYPES = ("job.succeeded", "job.failed", "job.cancelled", "job.running", "job.queued")


MAPPED = """select tenant_id, task_id, attempt_id, fencing_token, provider_account from task_attempt
             where provider = %s and provider_job_id = %s"""
# Two copies of one webhook-id arriving together: the second waits for the first's transaction,
# then finds its receipt (without the lock both pass the check, and both answer "applied").
RECEIVING = "select pg_advisory_xact_lock(hashtextextended(%s, 0))"
RECEIVED = "select 1 from webhook_receipt where provider = %s and webhook_id = %s"
RECORD_RECEIPT = """insert into webhook_receipt (provider, webhook_id, received_at) values (%s, %s, %s)
                    on conflict do nothing"""
PARK = """insert into parked_webhook (provider, webhook_id, provider_job_id, event_type, body, received_at)
          values (%(provider)s, %(webhook_id)s, %(job_id)s, %(type)s, %(body)s, %(now)s)
          on conflict (provider, webhook_id) do nothing"""


class CallbackRefused(DomainError):
    code = "CALLBACK_REFUSED"


@dataclass(frozen=True)
class CallbackResult:
    status: str  # applied | duplicate | parked (answered 202)
    task_state: str | None = None

    def body(self) -> dict[str, Any]:
        return {"status": self.status, "task_state": self.task_state}


def receive(platform, provider: str, headers: Mapping[str, str], body: bytes | str) -> CallbackResult:
    cfg = platform.config.provider(provider)
    if cfg is None:
        raise NotFound(f"no provider {provider!r}")
    now = platform.clock.now()
    if cfg.webhook_secret is None:  # the API function always has the provider secret; never accept unsigned
        raise ConfigError(f"providers.{provider}.webhook_secret: not loaded in this process")
    if not verify_webhook(cfg.webhook_secret, headers, body, now):
        publish(WEBHOOKS_REFUSED, provider=provider, reason="signature")
        raise Unauthenticated("webhook signature or timestamp is not valid")
    h = {k.lower(): v for k, v in headers.items()}
    webhook_id = h["webhook-id"]
    try:
        doc = json.loads(body)
        if not isinstance(doc, dict) or doc.get("type") not in EVENT_TYPES:
            raise MalformedDocument(f"type: expected one of {', '.join(EVENT_TYPES)}")
        job = parse_job(doc.get("data"))
    except (ValueError, MalformedDocument) as e:
        raise InvalidRequest("malformed webhook body", {"body": str(e)}) from None
    except RecursionError:
        raise InvalidRequest("malformed webhook body", {"body": "JSON nested too deeply"}) from None

    def tx(conn) -> CallbackResult | tuple[str, dict | None]:
        if not safeguards.broken("webhook-dedupe"):
            conn.execute(RECEIVING, (f"webhook:{provider}:{webhook_id}",))
            if conn.execute(RECEIVED, (provider, webhook_id)).fetchone():
                return CallbackResult("duplicate")
        row = conn.execute(MAPPED, (provider, job.id)).fetchone()
        if row is None:
            # An adoption of this job may be committing right now: wait for it (it holds the same
            # lock), then look again; only a job still unmapped is parked.
            lock_job(conn, provider, job.id)
            row = conn.execute(MAPPED, (provider, job.id)).fetchone()
        if row is None:
            park(conn, provider, webhook_id, doc, job.id, now)
            return CallbackResult("parked")
        ref = AttemptRef(row["tenant_id"], row["task_id"], row["attempt_id"], row["fencing_token"])
        applied = apply_job(conn, ref, job, source="callback", now=platform.clock.now(), media=platform.config.media)
        if applied.outcome == "STALE":
            return "STALE_ATTEMPT", ref.log()
        conn.execute(RECORD_RECEIPT, (provider, webhook_id, now))
        return CallbackResult("applied", applied.task_state)

    failpoints.hit("after-verify-before-apply")  # verified and parsed; nothing of it written yet
    result = platform.db.transaction(tx)
    if isinstance(result, CallbackResult):
        publish(WEBHOOKS_RECEIVED, provider=provider, result=result.status)
        if result.status == "parked":
            logger.info("webhook for an unmapped job parked", extra={"provider": provider, "job_id": job.id,
                                                                     "webhook_id": webhook_id, "type": doc["type"]})
        return result
    reason, where = result
    publish(WEBHOOKS_REFUSED, provider=provider, reason=reason)
    logger.warning("webhook refused", extra={"provider": provider, "job_id": job.id, "webhook_id": webhook_id,
                                             "reason": reason, **(where or {})})
    raise CallbackRefused(f"job {job.id}: its attempt was replaced", code=reason, details={"job_id": job.id})


def park(conn: psycopg.Connection, provider: str, webhook_id: str, doc: dict, job_id: str, now: datetime) -> bool:
    """Keep a verified webhook for a job no attempt knows yet, whole, and record the job as an
    UNMAPPED orphan (the first webhook's job document with it). The caller holds the job's lock.
    True when this webhook-id is new."""
    new = conn.execute(PARK, {"provider": provider, "webhook_id": webhook_id, "job_id": job_id, "type": doc["type"],
                              "body": Jsonb(doc), "now": now}).rowcount == 1
    record_orphan(conn, provider, job_id, None, None, "UNMAPPED",
                  {"status": doc["data"].get("status"), "webhook_id": webhook_id, "job": doc["data"]})
    return new
