"""Read models for the tenant API. Every query carries the tenant boundary: another tenant's id
reads exactly like an id that does not exist."""
from __future__ import annotations

import base64
from datetime import datetime
from uuid import UUID

from aivedio.errors import InvalidRequest, NotFound
from aivedio.media.urls import output_url
from aivedio.observability import logger
from aivedio.scheduling.why_waiting import for_tenant
from aivedio.tasks import STATES
from aivedio.tenant_errors import tenant_error


def _iso(ts: datetime | None) -> str | None:
    return ts.strftime("%Y-%m-%dT%H:%M:%S.%fZ") if ts else None


def encode_cursor(ts: datetime, ident: UUID) -> str:
    return base64.urlsafe_b64encode(f"{ts.isoformat()}|{ident}".encode()).decode()


def decode_cursor(cursor: str) -> tuple[datetime, UUID]:
    try:
        ts, ident = base64.urlsafe_b64decode(cursor.encode()).decode().split("|")
        return datetime.fromisoformat(ts), UUID(ident)
    except Exception:
        raise InvalidRequest("bad cursor", {"query.cursor": "not a cursor this API returned"}) from None


# The outputs of the task's latest output version (a media retry keeps its version, so there is one
# set), in asset order. The URL is made at read time from the platform's own key (aivedio.media.urls).
OUTPUTS = """
select asset_type, object_key, url from task_output
 where task_id = %s and output_version = (select max(output_version) from task_output where task_id = %s)
 order by case asset_type when 'delivery' then 0 when 'video' then 0 when 'proxy' then 1 when 'thumbnail' then 2 else 3 end,
          created_at, asset_type
"""


def _outputs(conn, task_id: UUID, platform) -> list[dict]:
    return [{"asset_type": o["asset_type"], "url": output_url(platform, o)}
            for o in conn.execute(OUTPUTS, (task_id, task_id)).fetchall()]


def _task_doc(conn, t: dict, *, full: bool, platform=None) -> dict:
    doc = {"task_id": str(t["task_id"]), "state": t["state"], "queue_class": t["queue_class"],
           "created_at": _iso(t["created_at"]), "started_at": _iso(t["started_at"]), "finished_at": _iso(t["finished_at"]),
           "model": t["model_code"], "mode": t["mode"], "duration_seconds": t["duration_seconds"], "resolution": t["resolution"]}
    error = tenant_error(t["state"], t["error_code"])  # mapped: never the provider's own text
    if error is not None:
        doc["error"] = error
    if not full:
        return doc
    attempts = conn.execute(
        "select attempt_no, provider, state from task_attempt where task_id = %s order by attempt_no", (t["task_id"],)
    ).fetchall()
    charge = conn.execute(
        """select c.quoted_amount, c.final_charge_amount, r.reserved_amount from generation_charge c
             left join credit_reservation r on r.task_id = c.task_id where c.task_id = %s and c.tenant_id = %s""",
        (t["task_id"], t["tenant_id"]),
    ).fetchone()
    doc["attempts"] = [dict(a) for a in attempts]
    doc["charge"] = {"quoted_amount": charge["quoted_amount"], "reserved_amount": charge["reserved_amount"],
                     "final_charge_amount": charge["final_charge_amount"]} if charge else None
    doc["outputs"] = _outputs(conn, t["task_id"], platform)
    return doc


def get_task(conn, tenant_id: UUID, task_id: UUID, *, platform=None) -> dict:
    """One task of the tenant. With `platform`, a QUEUED task also says why it waits (`waiting`,
    aivedio.scheduling.why_waiting); any other state has none. Its outputs' URLs are the
    platform's own, signed (or presigned) at this read: without `platform` they are left out (None)."""
    t = conn.execute("select * from generation_task where tenant_id = %s and task_id = %s", (tenant_id, task_id)).fetchone()
    if t is None:
        raise NotFound("no such task")
    doc = _task_doc(conn, t, full=True, platform=platform)
    if platform is not None and t["state"] == "QUEUED":
        doc["waiting"] = _waiting(platform, conn, t)
    return doc


def _waiting(platform, conn, t: dict) -> dict | None:
    """The task's `waiting` object, computed from the row read inside the tenant boundary. A
    diagnostic that fails leaves it out (logged) rather than failing the tenant's GET."""
    try:
        with conn.transaction():  # its reads roll back together should one fail
            return for_tenant(platform, conn, t)
    except Exception as e:  # noqa: BLE001
        logger.warning("why-waiting failed", extra={"tenant_id": str(t["tenant_id"]), "task_id": str(t["task_id"]),
                                                    "error": repr(e)})
        return None


def list_tasks(conn, tenant_id: UUID, *, state: str | None, limit: int, cursor: str | None) -> dict:
    if state is not None and state not in STATES:
        raise InvalidRequest("unknown state", {"query.state": f"one of {', '.join(STATES)}"})
    params: dict = {"t": tenant_id, "state": state, "limit": limit + 1}
    where = "tenant_id = %(t)s" + (" and state = %(state)s" if state else "")
    if cursor:
        params["cts"], params["cid"] = decode_cursor(cursor)
        where += " and (created_at, task_id) < (%(cts)s, %(cid)s)"
    rows = conn.execute(f"select * from generation_task where {where} order by created_at desc, task_id desc limit %(limit)s",
                        params).fetchall()
    more = len(rows) > limit
    rows = rows[:limit]
    return {"items": [_task_doc(conn, r, full=False) for r in rows],
            "next_cursor": encode_cursor(rows[-1]["created_at"], rows[-1]["task_id"]) if more and rows else None}


def wallet_view(conn, tenant_id: UUID, now: datetime) -> dict:
    w = conn.execute("select * from wallet_account where tenant_id = %s order by wallet_id limit 1", (tenant_id,)).fetchone()
    if w is None:
        raise NotFound("no wallet")
    lots = conn.execute(
        """select lot_id, kind, remaining_amount, reserved_amount, expires_at from credit_lot
            where wallet_id = %s and (remaining_amount > 0 or reserved_amount > 0)
            order by expires_at asc nulls last, priority, created_at""",
        (w["wallet_id"],),
    ).fetchall()
    return {"wallet_id": str(w["wallet_id"]), "account_type": w["account_type"], "unit": w["unit_code"],
            "available_amount": w["available_amount"], "reserved_amount": w["reserved_amount"],
            "consumed_amount": w["consumed_amount"], "credit_limit_amount": w["credit_limit_amount"],
            "frozen": w["frozen"],
            "lots": [{"lot_id": str(l["lot_id"]), "kind": l["kind"], "remaining_amount": l["remaining_amount"],
                      "reserved_amount": l["reserved_amount"], "expires_at": _iso(l["expires_at"]),
                      "expired": bool(l["expires_at"] and l["expires_at"] <= now)} for l in lots]}


def ledger_view(conn, tenant_id: UUID, *, limit: int, cursor: str | None) -> dict:
    params: dict = {"t": tenant_id, "limit": limit + 1}
    where = "tenant_id = %(t)s"
    if cursor:
        params["cts"], params["cid"] = decode_cursor(cursor)
        where += " and (created_at, ledger_txn_id) < (%(cts)s, %(cid)s)"
    txns = conn.execute(
        f"""select ledger_txn_id, business_key, event_type, task_id, reservation_id, reversal_of, reason_code, created_at
              from ledger_transaction where {where} order by created_at desc, ledger_txn_id desc limit %(limit)s""",
        params,
    ).fetchall()
    more = len(txns) > limit
    txns = txns[:limit]
    entries: dict = {}
    if txns:
        for e in conn.execute(
            """select ledger_txn_id, bucket, amount_delta, unit_code, lot_id from ledger_entry
                where tenant_id = %s and ledger_txn_id = any(%s) order by entry_id""",
            (tenant_id, [t["ledger_txn_id"] for t in txns]),
        ).fetchall():
            entries.setdefault(e["ledger_txn_id"], []).append(
                {"bucket": e["bucket"], "amount_delta": e["amount_delta"], "unit": e["unit_code"],
                 "lot_id": str(e["lot_id"]) if e["lot_id"] else None})
    items = [{"ledger_txn_id": str(t["ledger_txn_id"]), "business_key": t["business_key"], "event_type": t["event_type"],
              "task_id": str(t["task_id"]) if t["task_id"] else None, "reason_code": t["reason_code"],
              "reversal_of": str(t["reversal_of"]) if t["reversal_of"] else None, "created_at": _iso(t["created_at"]),
              "entries": entries.get(t["ledger_txn_id"], [])} for t in txns]
    return {"items": items, "next_cursor": encode_cursor(txns[-1]["created_at"], txns[-1]["ledger_txn_id"]) if more and txns else None}
