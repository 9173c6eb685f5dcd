"""Billing input that cannot be applied as it stands (an unknown task, a currency mismatch, a second
terminal event that contradicts the first, a provider cost without a charge id...): parked in
billing_parked_event for reconciliation, never dropped and never guessed at (ch. 20.5.5, 20.8.3).

Parking is idempotent: the same input parked twice is one row (dedupe_key)."""
from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg.types.json import Jsonb

from aivedio.metrics_catalog import BILLING_PARKED
from aivedio.observability import logger, publish

INSERT_PARKED = """
insert into billing_parked_event (dedupe_key, reason, event_type, event_id, task_id, tenant_id, attempt_id, payload, detail)
values (%(dedupe_key)s, %(reason)s, %(event_type)s, %(event_id)s, %(task_id)s, %(tenant_id)s, %(attempt_id)s, %(payload)s, %(detail)s)
on conflict (dedupe_key) do nothing
returning parked_id
"""


def _uuid(v: Any) -> UUID | None:
    try:
        return UUID(str(v)) if v is not None else None
    except ValueError:
        return None


def park(conn: psycopg.Connection, *, reason: str, payload: dict, event_type: str | None = None,
         event_id: UUID | str | None = None, task_id: Any = None, tenant_id: Any = None, attempt_id: Any = None,
         detail: str | None = None) -> bool:
    """Keep `payload` for reconciliation. True when it is new."""
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]
    key = f"{reason}:{event_type}:{task_id}:{attempt_id}:{digest}"
    created = conn.execute(INSERT_PARKED, {
        "dedupe_key": key, "reason": reason, "event_type": event_type, "event_id": _uuid(event_id),
        "task_id": _uuid(task_id), "tenant_id": _uuid(tenant_id), "attempt_id": _uuid(attempt_id),
        "payload": Jsonb(json.loads(json.dumps(payload, default=str))), "detail": (detail or "")[:2000] or None,
    }).fetchone() is not None  # (an answer rather than a rowcount: settlement runs in pipeline mode)
    if created:
        publish(BILLING_PARKED, reason=reason)
        logger.warning("billing input parked for reconciliation",
                       extra={"reason": reason, "event_type": event_type, "task_id": str(task_id) if task_id else None,
                              "tenant_id": str(tenant_id) if tenant_id else None, "detail": detail})
    return created


def open_items(conn: psycopg.Connection, *, reasons: tuple[str, ...] | None = None, limit: int = 100) -> list[dict]:
    return conn.execute(
        """select * from billing_parked_event where status = 'OPEN' and (%(reasons)s::text[] is null or reason = any(%(reasons)s))
            order by created_at, parked_id limit %(limit)s""",
        {"reasons": list(reasons) if reasons else None, "limit": limit},
    ).fetchall()


def resolve(conn: psycopg.Connection, parked_id: UUID, resolution: str, now: datetime) -> bool:
    return conn.execute(
        """update billing_parked_event set status = 'RESOLVED', resolution = %s, resolved_at = %s
            where parked_id = %s and status = 'OPEN'""",
        (resolution, now, parked_id),
    ).rowcount == 1
