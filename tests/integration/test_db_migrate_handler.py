"""The db_migrate Lambda, as the schema-migration custom resource invokes it on deploy."""
from __future__ import annotations

import json
from pathlib import Path

from aivedio.db.migrate import schema_fingerprint
from aivedio_tools.local.lambda_context import FakeLambdaContext
from aivedio_tools.local.handlers import load_handler

EVENT = json.loads((Path(__file__).resolve().parents[2] / "events" / "db_migrate.json").read_text())


def test_update_migrates_and_reports_the_fingerprint(db_url, monkeypatch):
    monkeypatch.setenv("AIVEDIO_DATABASE_URL", db_url)
    handler = load_handler("functions.db_migrate.handler")
    out = handler(EVENT, FakeLambdaContext("aivedio-db-migrate"))
    assert out["PhysicalResourceId"] == "aivedio-schema"
    assert out["Data"]["Fingerprint"] == schema_fingerprint()
    assert out["Data"]["Applied"] == ""  # the test database is cloned from a migrated template
    again = handler({**EVENT, "RequestType": "Create"}, FakeLambdaContext("aivedio-db-migrate"))
    assert again["Data"]["Applied"] == ""


def test_delete_leaves_the_database_alone(monkeypatch):
    monkeypatch.delenv("AIVEDIO_DATABASE_URL", raising=False)
    handler = load_handler("functions.db_migrate.handler")
    out = handler({**EVENT, "RequestType": "Delete"}, FakeLambdaContext("aivedio-db-migrate"))
    assert out == {"PhysicalResourceId": "aivedio-schema"}
