"""aivedio_tools.chaos.facts against a real PostgreSQL: a tenant admits two tasks and cancels one (settled
as settlement would), the facts are dumped, read back as JSON, and the checkers that read only facts
find the real columns consistent; the checkers that read the history see the task left QUEUED."""
from __future__ import annotations

import json
from datetime import datetime

import psycopg
from psycopg.rows import dict_row
from psycopg.sql import SQL, Identifier

from aivedio.admission.cancel import cancel
from aivedio.billing import settlement
from aivedio_tools.chaos import checkers, facts
from aivedio_tools.chaos.records import Run
from tests.admission_support import new_tenant
from tests.scheduler_support import OPEN, submit


def _admit_and_cancel(platform):
    t = new_tenant(platform, credits=10_000, **OPEN)
    kept, cancelled = submit(platform, t.tenant_id, t.user_id, n=2)
    cancel(platform, t.caller, cancelled)
    with platform.db.connection() as c:
        ev = c.execute("select payload from outbox_event where event_type = 'TaskCancelled' and aggregate_id = %s",
                       (cancelled,)).fetchone()
        assert settlement.settle(c, ev["payload"], platform.clock.now(), event_type="TaskCancelled").outcome == "SETTLED"
    return t, str(kept), str(cancelled)


def test_dump_writes_every_table_as_json_and_the_checkers_read_it(platform, conn, tmp_path):
    t, kept, cancelled = _admit_and_cancel(platform)
    counts = facts.dump(conn, tmp_path)

    assert set(counts) == set(facts.FACT_FILES)
    for name, table in facts.FACT_FILES.items():
        rows = json.loads((tmp_path / "facts" / f"{name}.json").read_text())
        n = conn.execute(SQL("select count(*) as n from {}").format(Identifier(table))).fetchone()["n"]
        assert len(rows) == counts[name] == n, name
    tasks = {r["task_id"]: r for r in json.loads((tmp_path / "facts" / "tasks.json").read_text())}
    assert tasks[kept]["state"] == "QUEUED" and tasks[cancelled]["state"] == "CANCELLED"
    row = tasks[kept]
    assert row["tenant_id"] == str(t.tenant_id)
    assert datetime.fromisoformat(row["created_at"]).tzinfo is not None
    assert isinstance(row["normalized_params"], dict)  # jsonb stays an object
    entries = json.loads((tmp_path / "facts" / "ledger_entries.json").read_text())
    assert entries and all(isinstance(e["amount_delta"], int) for e in entries)

    # The run directory around the facts: the two admissions, as the chaos client records them.
    history = []
    for key_task in (kept, cancelled):
        key = tasks[key_task]["idempotency_key"]
        for kind, t_ in (("invoke", 0.0), ("ok", 0.1)):
            history.append({"i": len(history), "process": f"client-{key_task[:4]}", "type": kind, "f": "submit", "t": t_,
                            "tenant": "t1", "key": key, "body": "b", "task_id": None,
                            "value": None if kind == "invoke" else {"status": 202, "task_id": key_task, "response": key_task}})
    files = {"plan.json": {"params": {"tenants": {"t1": {"tenant_id": str(t.tenant_id)}}, "accounts": {}}},
             "truth.json": {"jobs": [], "accounts": {}}, "run.json": {"seed": 1, "started_at": None, "settled_t": None}}
    for name, doc in files.items():
        (tmp_path / name).write_text(json.dumps(doc))
    (tmp_path / "history.jsonl").write_text("".join(json.dumps(x) + "\n" for x in history))
    run = Run.load(tmp_path)

    found = checkers.check_all(run)
    messages = {k: [v.message for v in vs] for k, vs in found.items() if vs}
    assert messages == {"total-queue": [f"task {kept} never ended: QUEUED"],
                        "liveness": ["the run never settled: some task was not terminal (or in MANUAL_REVIEW) at the deadline"]}


def test_dump_reads_inside_the_callers_transaction(platform, db_url, tmp_path):
    _, kept, _ = _admit_and_cancel(platform)
    with psycopg.connect(db_url, row_factory=dict_row) as c:  # not autocommit: a transaction is open
        c.execute("select 1")
        counts = facts.dump(c, tmp_path)
        c.rollback()
    assert counts["tasks"] >= 2
    assert kept in {r["task_id"] for r in json.loads((tmp_path / "facts" / "tasks.json").read_text())}
