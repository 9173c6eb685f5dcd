"""The facts of a chaos run: every table the checkers read, dumped from PostgreSQL once the run has
settled, one JSON file per table under facts/ (a list of row dicts, `select *`, so the columns are
the migrations'). All tables are read in one REPEATABLE READ snapshot, so the files agree with each
other. Values are made JSON-safe: UUIDs, Decimals, timestamps and bytes as strings; jsonb columns
stay objects."""
from __future__ import annotations

import base64
import json
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row

# facts/<name>.json <- table. The checkers name the files, never the tables.
FACT_FILES: dict[str, str] = {
    "tasks": "generation_task",
    "attempts": "task_attempt",
    "outbox": "outbox_event",
    "ledger_transactions": "ledger_transaction",
    "ledger_entries": "ledger_entry",
    "wallets": "wallet_account",
    "lots": "credit_lot",
    "credit_reservations": "credit_reservation",
    "charges": "generation_charge",
    "resource_reservations": "resource_reservation",
    "shards": "resource_pool_shard",
    "idempotency": "idempotency_record",
    "orphans": "orphan_provider_job",
    "processed_events": "processed_event",
    "webhook_receipts": "webhook_receipt",
    # What a wallet holds reserved besides its reservations (billing.wallet_checks.OPEN_RESERVED),
    # and the reservations' parts per lot. Optional when loading: older run directories lack them.
    "allowances": "wallet_allowance",
    "allocations": "reservation_allocation",
}
OPTIONAL_FACTS = frozenset({"allowances", "allocations"})

SNAPSHOT = "set transaction isolation level repeatable read, read only"


def json_safe(v: Any) -> Any:
    """A column value as JSON: strings for what JSON has no type for; jsonb (dicts, lists) as is."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (UUID, Decimal)):
        return str(v)
    if isinstance(v, (datetime, date, time)):
        return v.isoformat()
    if isinstance(v, timedelta):
        return v.total_seconds()
    if isinstance(v, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(v)).decode()
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return str(v)  # ranges, inet and the like: their text form


def read(conn: psycopg.Connection) -> dict[str, list[dict[str, Any]]]:
    """Every facts table's rows, JSON-safe, from one snapshot (a fresh transaction when the
    connection has none open; otherwise the caller's)."""
    fresh = conn.info.transaction_status == TransactionStatus.IDLE
    out: dict[str, list[dict[str, Any]]] = {}
    with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
        if fresh:
            cur.execute(SNAPSHOT)
        for name, table in FACT_FILES.items():
            cur.execute(sql.SQL("select * from {}").format(sql.Identifier(table)))
            out[name] = [{k: json_safe(x) for k, x in row.items()} for row in cur.fetchall()]
    return out


def dump(conn: psycopg.Connection, out_dir: Path) -> dict[str, int]:
    """Write facts/<name>.json for every table of FACT_FILES under out_dir (out_dir/facts is
    created); returns the row count of each."""
    facts_dir = Path(out_dir) / "facts"
    facts_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, rows in read(conn).items():
        # One row per line: a reader can grep and diff a facts file.
        text = "[\n" + ",\n".join(json.dumps(r, sort_keys=True) for r in rows) + "\n]\n" if rows else "[]\n"
        (facts_dir / f"{name}.json").write_text(text)
        counts[name] = len(rows)
    return counts
