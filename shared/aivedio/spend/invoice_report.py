"""The invoice reconciliation's reports: the day's JSON document of docs/operations.md
(`aivedio reconcile invoices --json`), the same as a self-contained HTML page, and the month close's
summary as JSON and HTML. Amounts are decimal strings. Pure functions: nothing here reads or writes
anything."""
from __future__ import annotations

import html
import json
from typing import Any

from aivedio.spend.invoice_matching import money

ITEM_FIELDS = ("item_id", "discrepancy_type", "status", "external_line_id", "provider_job_id", "task_id", "attempt_id",
               "internal_amount", "external_amount", "currency", "resolution_code", "evidence")


def item_doc(row: dict) -> dict[str, Any]:
    """One item as the contract shows it."""
    doc = {k: row.get(k) for k in ITEM_FIELDS}
    for k in ("item_id", "task_id", "attempt_id"):
        doc[k] = str(doc[k]) if doc[k] is not None else None
    doc["internal_amount"], doc["external_amount"] = money(row.get("internal_amount")), money(row.get("external_amount"))
    doc["evidence"] = doc["evidence"] or {}
    return doc


def day_document(*, run_id, provider: str, day, status: str, incomplete_reasons: list[dict], figures: dict, currency: str,
                 previous_open: int, new: int, resolved: int, open_now: int, auto_fixed: int, items: list[dict]) -> dict:
    """The contract's document, key for key."""
    return {"run_id": str(run_id), "provider": provider, "date": day.isoformat(), "status": status,
            "incomplete_reasons": incomplete_reasons,
            "lines_total": figures["lines_total"], "lines_matched": figures["lines_matched"], "currency": currency,
            "external_amount": money(figures["external_amount"]), "internal_amount": money(figures["internal_amount"]),
            "gross_drift": money(figures["gross_drift"]), "net_drift": money(figures["net_drift"]),
            "previous_open_items": previous_open, "new_items": new, "resolved_items": resolved, "open_items": open_now,
            "auto_fixed": auto_fixed, "items": [item_doc(r) for r in items]}


def to_bytes(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, indent=2, default=str).encode() + b"\n"


_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top;font-size:13px}
th{background:#f3f3f3}.COMPLETE{color:#176c2e}.INCOMPLETE{color:#b00020}pre{margin:0;white-space:pre-wrap;max-width:60em}"""


def _e(v: Any) -> str:
    return html.escape("" if v is None else str(v))


def _table(rows: list[tuple[str, Any]]) -> str:
    return "<table>" + "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows) + "</table>"


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{_e(title)}</title><style>{_STYLE}</style></head>"
            f"<body><h1>{_e(title)}</h1>{body}</body></html>\n")


def day_html(doc: dict) -> str:
    figures = [(k, doc[k]) for k in ("run_id", "provider", "date", "currency", "lines_total", "lines_matched", "external_amount",
                                     "internal_amount", "gross_drift", "net_drift", "previous_open_items", "new_items",
                                     "resolved_items", "open_items", "auto_fixed")]
    body = f"<p>Status: <strong class=\"{_e(doc['status'])}\">{_e(doc['status'])}</strong></p>" + _table(figures)
    if doc["incomplete_reasons"]:
        body += "<h2>Why it is incomplete</h2><table><tr><th>code</th><th>message</th><th>evidence</th></tr>" + "".join(
            f"<tr><td>{_e(r.get('code'))}</td><td>{_e(r.get('message'))}</td>"
            f"<td><pre>{_e(json.dumps(r.get('evidence'), indent=1, default=str))}</pre></td></tr>"
            for r in doc["incomplete_reasons"]) + "</table>"
    cols = ("discrepancy_type", "status", "resolution_code", "external_line_id", "provider_job_id", "attempt_id",
            "internal_amount", "external_amount", "currency")
    body += f"<h2>Items ({len(doc['items'])})</h2><table><tr>" + "".join(f"<th>{_e(c)}</th>" for c in cols) + "<th>evidence</th></tr>"
    body += "".join("<tr>" + "".join(f"<td>{_e(i[c])}</td>" for c in cols)
                    + f"<td><details><summary>show</summary><pre>{_e(json.dumps(i['evidence'], indent=1, default=str))}</pre>"
                      "</details></td></tr>" for i in doc["items"]) + "</table>"
    return _page(f"Invoice reconciliation: {doc['provider']} {doc['date']}", body)


def month_html(summary: dict) -> str:
    top = [(k, summary.get(k)) for k in ("provider", "month", "closed_at", "closed_by", "currency", "external_amount",
                                          "internal_amount", "gross_drift", "net_drift", "open_items_carried")]
    body = _table(top)
    body += "<h2>Days</h2><table><tr><th>date</th><th>status</th><th>run</th></tr>" + "".join(
        f"<tr><td>{_e(d['date'])}</td><td class=\"{_e(d['status'])}\">{_e(d['status'])}</td><td>{_e(d.get('run_id'))}</td></tr>"
        for d in summary["days"]) + "</table>"
    body += "<h2>Items booked in the period</h2><table><tr><th>type</th><th>open</th><th>resolved</th></tr>" + "".join(
        f"<tr><td>{_e(t)}</td><td>{_e(c.get('OPEN', 0))}</td><td>{_e(c.get('RESOLVED', 0))}</td></tr>"
        for t, c in sorted(summary["items_by_type"].items())) + "</table>"
    return _page(f"Invoice month close: {summary['provider']} {summary['month']}", body)
