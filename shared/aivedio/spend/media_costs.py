"""Media cost ingestion (ch. 20.9.1, 20.9.5; issue: "media costs (transcode, storage, egress)
attributed by tenant and task tags"): the lines of an AWS Cost and Usage Report export (the CSV of
the legacy CUR, gzipped or not) become media_cost_event rows, aggregated hourly or daily as AWS
aggregates them, never one per playback ("媒体成本不应在每次播放请求上同步写主账本").

- A line's kind comes from USAGE_KINDS (its product code and usage type). A line no rule maps and
  that carries no aivedio tag is not a media cost: counted as NOT_MEDIA, nothing more.
- It is attributed by the resource tags the platform puts on its resources and jobs: the tenant
  (required), the task and the project (optional).
- The media bucket's storage is the exception: AWS allocates it by the bucket's tags, never an
  object's, so its lines carry the bucket's `aivedio:cost-scope = media-storage` and no tenant. They
  are kept apart in bucket_storage_cost (each task's storage is booked by the platform itself,
  aivedio.media.storage_cost, so recording them as media costs would count the bucket twice), and
  the months they fall in are returned for the monthly check (`aivedio admin media-costs
  check-storage`, which the import command runs for them).
- It is recorded once, under its line item id and usage start (the id repeats across the hours of
  one report), so a re-import adds nothing. AWS does not keep line item ids across restated reports
  of the same period: import each period's final report once.
- A line that cannot be attributed as it stands (see REASONS) is never dropped and never guessed
  at: the result counts it by reason and lists it, and it is parked for reconciliation as
  MEDIA_COST_UNATTRIBUTED, once however often it is imported.
- Amounts are Decimal in the line's own currency; totals are per currency, never summed across."""
from __future__ import annotations

import csv
import gzip
import hashlib
import io
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from decimal import Decimal, InvalidOperation
from itertools import islice
from pathlib import Path
from typing import Iterable, TextIO
from uuid import UUID

import psycopg
from psycopg.types.json import Jsonb

from aivedio import audit
from aivedio.errors import InvalidRequest
from aivedio.spend import parked
from aivedio.spend.costs import QUANTUM, MediaCost, record_media_costs

SOURCE = "aws-cur"
LINE_ITEM_ID = "identity/LineItemId"
USAGE_START = "lineItem/UsageStartDate"
PRODUCT_CODE = "lineItem/ProductCode"
USAGE_TYPE = "lineItem/UsageType"
COST = "lineItem/UnblendedCost"
CURRENCY = "lineItem/CurrencyCode"
TAG_PREFIX = "resourceTags/user:aivedio:"
TAG_TENANT, TAG_TASK, TAG_PROJECT = f"{TAG_PREFIX}tenant_id", f"{TAG_PREFIX}task_id", f"{TAG_PREFIX}project"
COST_SCOPE_TAG = "aivedio:cost-scope"  # on the media bucket (infra_cdk/data.py), as a cost allocation tag
TAG_SCOPE = f"resourceTags/user:{COST_SCOPE_TAG}"
BUCKET_SCOPE = "media-storage"
REQUIRED_COLUMNS = (LINE_ITEM_ID, USAGE_START, PRODUCT_CODE, USAGE_TYPE, COST, CURRENCY, TAG_TENANT)

# How a cost line becomes a media cost kind, in one place: the first rule whose product code is the
# line's and one of whose fragments its usage type contains (no fragments: any usage type) wins.
# Usage types carry a region prefix (USE1-TimedStorage-ByteHrs), hence fragments.
USAGE_KINDS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("AWSElementalMediaConvert", (), "TRANSCODE"),
    ("AmazonS3", ("TimedStorage", "EarlyDelete", "Requests-Tier", "Retrieval"), "STORAGE"),
    ("AmazonS3", ("DataTransfer-Out-Bytes", "-AWS-Out-Bytes"), "EGRESS"),  # to the internet, across regions
    ("AmazonCloudFront", (), "EGRESS"),  # delivery: bytes out, origin fetches and requests alike
)

# Why a line is not recorded. Every reason but NOT_MEDIA parks the line.
REASONS = {
    "NOT_MEDIA": "no rule of USAGE_KINDS maps it and it carries no aivedio tag",
    "UNKNOWN_USAGE_TYPE": "it carries aivedio tags but no rule of USAGE_KINDS maps its usage type",
    "NO_LINE_ITEM_ID": "it has no line item id, so it could not be recorded once",
    "BAD_USAGE_START": "its usage start is not a timestamp with a timezone",
    "BAD_AMOUNT": "its unblended cost is not a finite decimal that numeric(20, 8) holds",
    "UNKNOWN_CURRENCY": "its currency is not one media costs are accounted in (billing.media_cost_currencies)",
    "NO_TENANT_TAG": "it has no tenant tag",
    "UNKNOWN_TENANT": "its tenant tag names no tenant",
    "UNKNOWN_TASK": "its task tag names no task",
    "TASK_OF_ANOTHER_TENANT": "its task tag names a task of another tenant",
}
PARKED_REASON = "MEDIA_COST_UNATTRIBUTED"
MAX_AMOUNT = Decimal(10) ** 12  # numeric(20, 8)
BATCH = 1000  # lines per statement
LISTED = 100  # unattributed lines listed in the result (all of them are counted and parked)


@dataclass
class ImportResult:
    file: str
    sha256: str
    lines: int = 0
    recorded: int = 0
    already_recorded: int = 0
    not_media: int = 0
    parked_new: int = 0
    bucket_storage_recorded: int = 0
    bucket_storage_already_recorded: int = 0
    bucket_storage_months: set = field(default_factory=set)
    recorded_cost: dict[str, dict[str, Decimal]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(Decimal)))
    unattributed_by_reason: Counter = field(default_factory=Counter)
    unattributed_lines: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"file": self.file, "sha256": self.sha256, "lines": self.lines, "recorded": self.recorded,
                "already_recorded": self.already_recorded, "not_media": self.not_media,
                "recorded_cost": {cur: {k: str(v) for k, v in sorted(kinds.items())}
                                  for cur, kinds in sorted(self.recorded_cost.items())},
                "unattributed": sum(self.unattributed_by_reason.values()),
                "unattributed_by_reason": dict(sorted(self.unattributed_by_reason.items())),
                "unattributed_lines": self.unattributed_lines, "parked_new": self.parked_new,
                "bucket_storage": {"recorded": self.bucket_storage_recorded,
                                   "already_recorded": self.bucket_storage_already_recorded,
                                   "months": sorted(m.isoformat() for m in self.bucket_storage_months)}}


def kind_of(product_code: str, usage_type: str) -> str | None:
    for product, fragments, kind in USAGE_KINDS:
        if product == product_code and (not fragments or any(f in usage_type for f in fragments)):
            return kind
    return None


@dataclass
class _Line:
    row: int  # 1-based, among the data rows
    raw: dict[str, str]
    cost: MediaCost | None = None
    bucket: dict | None = None  # a line of the media bucket's storage as a whole (bucket_storage_cost)
    reason: str | None = None
    detail: str = ""


def import_cur(conn: psycopg.Connection, *, operator: str, path: str, currencies: Iterable[str]) -> dict:
    """Import one CUR export in the caller's transaction, audited. A file that is not a CUR export
    with the aivedio tenant tag column is refused whole, having written nothing."""
    try:
        result = ImportResult(file=path, sha256=_sha256(path))
        with _open_text(path) as f:
            reader = csv.DictReader(f)
            missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or ())]
            if missing:
                raise InvalidRequest("not a Cost and Usage Report export with the aivedio tags",
                                     {c: "missing column" for c in missing})
            rows = enumerate(reader, start=1)
            while chunk := [_Line(n, _trimmed(raw)) for n, raw in islice(rows, BATCH)]:
                _import_chunk(conn, chunk, frozenset(currencies), result)
    except (OSError, UnicodeDecodeError, csv.Error) as e:  # unreadable, a broken gzip, not CSV: nothing of it is kept
        raise InvalidRequest(f"cannot read {path}: {e}", {"file": "a readable CUR export (.csv or .csv.gz)"}) from None
    doc = result.as_dict()
    audit.append(conn, operator=operator, action="media_costs.import", target=f"file:{result.sha256}",
                 new={k: v for k, v in doc.items() if k != "unattributed_lines"})
    return doc


def _import_chunk(conn: psycopg.Connection, chunk: list[_Line], currencies: frozenset[str], result: ImportResult) -> None:
    result.lines += len(chunk)
    for line in chunk:
        _parse(line, currencies)
    _check_owners(conn, [line for line in chunk if line.cost is not None])
    _record_bucket_lines(conn, [line.bucket for line in chunk if line.bucket is not None], result)
    costs = [line.cost for line in chunk if line.cost is not None]
    new = record_media_costs(conn, costs)
    for m in costs:
        if m.source_key in new:
            result.recorded += 1
            result.recorded_cost[m.currency][m.kind] += m.amount
        else:
            result.already_recorded += 1
    for line in chunk:
        if line.reason == "NOT_MEDIA":
            result.not_media += 1
        elif line.reason is not None:
            _unattributed(conn, line, result)


def _parse(line: _Line, currencies: frozenset[str]) -> None:
    """Sets line.cost, or line.reason: everything a line alone can tell."""
    raw = line.raw
    tags = {k[len(TAG_PREFIX):]: v for k, v in raw.items() if k.startswith(TAG_PREFIX) and v}
    kind = kind_of(raw[PRODUCT_CODE], raw[USAGE_TYPE])
    if kind is None:
        return _refuse(line, "UNKNOWN_USAGE_TYPE" if tags else "NOT_MEDIA", f"{raw[PRODUCT_CODE]} {raw[USAGE_TYPE]}")
    if not raw[LINE_ITEM_ID]:
        return _refuse(line, "NO_LINE_ITEM_ID")
    try:
        start = datetime.fromisoformat(raw[USAGE_START].replace("Z", "+00:00"))
    except ValueError:
        start = None
    if start is None or start.tzinfo is None:
        return _refuse(line, "BAD_USAGE_START", raw[USAGE_START])
    try:
        amount = Decimal(raw[COST])
    except InvalidOperation:
        amount = None
    if amount is None or not amount.is_finite() or abs(amount) >= MAX_AMOUNT:
        return _refuse(line, "BAD_AMOUNT", repr(raw[COST]))
    if raw[CURRENCY] not in currencies:
        return _refuse(line, "UNKNOWN_CURRENCY", repr(raw[CURRENCY]))
    if kind == "STORAGE" and raw.get(TAG_SCOPE) == BUCKET_SCOPE and not raw[TAG_TENANT]:
        line.bucket = {"source_key": f"{SOURCE}:{raw[LINE_ITEM_ID]}:{start.isoformat()}",
                       "month": start.astimezone(timezone.utc).date().replace(day=1), "usage_type": raw[USAGE_TYPE],
                       "amount": amount.quantize(QUANTUM), "currency": raw[CURRENCY], "line": Jsonb(raw)}
        return None
    if not raw[TAG_TENANT]:
        return _refuse(line, "NO_TENANT_TAG")
    tenant_id, task_id = _uuid(raw[TAG_TENANT]), _uuid(raw.get(TAG_TASK, ""))
    if tenant_id is None:
        return _refuse(line, "UNKNOWN_TENANT", repr(raw[TAG_TENANT]))
    if raw.get(TAG_TASK) and task_id is None:
        return _refuse(line, "UNKNOWN_TASK", repr(raw[TAG_TASK]))
    line.cost = MediaCost(
        source_key=f"{SOURCE}:{raw[LINE_ITEM_ID]}:{start.isoformat()}", kind=kind, amount=amount.quantize(QUANTUM),
        currency=raw[CURRENCY], occurred_at=start, tenant_id=tenant_id, task_id=task_id, project_id=raw.get(TAG_PROJECT) or None,
        tags={**tags, "product_code": raw[PRODUCT_CODE], "usage_type": raw[USAGE_TYPE], "line_item_id": raw[LINE_ITEM_ID]})


RECORD_BUCKET_LINE = """
insert into bucket_storage_cost (source_key, usage_month, usage_type, amount, currency, line)
values (%(source_key)s, %(month)s, %(usage_type)s, %(amount)s, %(currency)s, %(line)s)
on conflict (source_key) do nothing returning source_key"""


def _record_bucket_lines(conn: psycopg.Connection, lines: list[dict], result: ImportResult) -> None:
    with conn.cursor() as cur:
        for line in lines:
            cur.execute(RECORD_BUCKET_LINE, line)
            if cur.fetchone() is None:
                result.bucket_storage_already_recorded += 1
            else:
                result.bucket_storage_recorded += 1
            result.bucket_storage_months.add(line["month"])


def _check_owners(conn: psycopg.Connection, lines: list[_Line]) -> None:
    """Refuse the lines whose tenant or task is unknown, or whose task is another tenant's."""
    tenants = list({line.cost.tenant_id for line in lines})
    tasks = list({line.cost.task_id for line in lines if line.cost.task_id is not None})
    known = {r["tenant_id"] for r in conn.execute("select tenant_id from tenant where tenant_id = any(%s::uuid[])", (tenants,))}
    owner = {r["task_id"]: r["tenant_id"] for r in conn.execute(
        "select task_id, tenant_id from generation_task where task_id = any(%s::uuid[])", (tasks,))}
    for line in lines:
        m = line.cost
        if m.tenant_id not in known:
            _refuse(line, "UNKNOWN_TENANT", str(m.tenant_id))
        elif m.task_id is not None and m.task_id not in owner:
            _refuse(line, "UNKNOWN_TASK", str(m.task_id))
        elif m.task_id is not None and owner[m.task_id] != m.tenant_id:
            _refuse(line, "TASK_OF_ANOTHER_TENANT", f"task {m.task_id} belongs to tenant {owner[m.task_id]}")


def _refuse(line: _Line, reason: str, detail: str = "") -> None:
    line.cost, line.reason, line.detail = None, reason, detail


def _unattributed(conn: psycopg.Connection, line: _Line, result: ImportResult) -> None:
    """Count, list and park one line (the parked row is keyed by the line's content, not its place)."""
    result.unattributed_by_reason[line.reason] += 1
    if len(result.unattributed_lines) < LISTED:
        result.unattributed_lines.append({"row": line.row, "line_item_id": line.raw[LINE_ITEM_ID] or None,
                                          "reason": line.reason, "detail": line.detail})
    result.parked_new += parked.park(
        conn, reason=PARKED_REASON, event_type="MediaCostLine", payload={"source": SOURCE, "why": line.reason, "line": line.raw},
        tenant_id=line.raw.get(TAG_TENANT), task_id=line.raw.get(TAG_TASK),
        detail=f"{line.reason}: {REASONS[line.reason]}" + (f" ({line.detail})" if line.detail else ""))


def _trimmed(raw: dict) -> dict[str, str]:
    """The row's cells, trimmed; a short row's missing cells are empty, a long row's extra ones dropped."""
    return {k: (v or "").strip() for k, v in raw.items() if k is not None}


def _uuid(s: str) -> UUID | None:
    try:
        return UUID(s) if s else None
    except ValueError:
        return None


def _sha256(path: str) -> str:
    """Of the file as delivered (ch. 20.10: keep the raw file's checksum), which the audit row names."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _open_text(path: str) -> TextIO:
    if Path(path).suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")
