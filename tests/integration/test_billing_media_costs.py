"""Media cost ingestion from an AWS Cost and Usage Report export (issue 6: "media costs (transcode,
storage, egress) attributed by tenant and task tags"; ch. 20.9.5) on the real PostgreSQL.

One export holds five attributable media lines (transcode, storage and egress of tenant A, one of
them a second hour of the same line item id; egress of tenant B in EUR), a line that is not a media
cost, and eight lines that cannot be attributed, one per reason. Then:
- the import records the five, counts the rest by reason, lists them and parks the eight;
- a re-import, of the same file or of its gzipped copy, adds nothing: no cost, no parked row;
- the cost report shows the media costs by tenant and kind, each currency apart;
- an operator without the role, a file without the tenant tag column, a broken gzip and a missing
  file are refused with a domain error, having written nothing."""
from __future__ import annotations

import csv
import gzip
import json
import shutil
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest

from aivedio.spend import media_costs
from aivedio.spend.costs import cost_report
from tests.billing_support import ADMIN, T0, Cli, make_task, new_wallet

pytestmark = pytest.mark.timeout(120)
HEADER = ["identity/LineItemId", "identity/TimeInterval", "lineItem/UsageStartDate", "lineItem/ProductCode",
          "lineItem/UsageType", "lineItem/UnblendedCost", "lineItem/CurrencyCode", "resourceTags/user:aivedio:tenant_id",
          "resourceTags/user:aivedio:task_id", "resourceTags/user:aivedio:project", "resourceTags/user:aivedio:asset_type"]
HOUR_1, HOUR_2 = T0, T0 + timedelta(hours=1)
EXPECTED_REASONS = {"NO_TENANT_TAG": 1, "UNKNOWN_TENANT": 2, "TASK_OF_ANOTHER_TENANT": 1, "UNKNOWN_TASK": 1, "BAD_AMOUNT": 1,
                    "UNKNOWN_CURRENCY": 1, "UNKNOWN_USAGE_TYPE": 1}


def line(item, start, product, usage_type, cost, currency="USD", tenant="", task="", project="", asset=""):
    return [item, f"{start:%Y-%m-%dT%H:%M:%SZ}/{start + timedelta(hours=1):%Y-%m-%dT%H:%M:%SZ}", f"{start:%Y-%m-%dT%H:%M:%SZ}",
            product, usage_type, cost, currency, str(tenant), str(task), project, asset]


@pytest.fixture(scope="module")
def world(db_url, tmp_path_factory):
    from aivedio.config import PlatformConfig, Settings
    from aivedio.context import build_platform
    from tests.conftest import TEST_HOME

    p = build_platform(Settings(database_url=db_url, redis_url="none", home=TEST_HOME), PlatformConfig(), pool_size=3)
    a, b = new_wallet(p), new_wallet(p)
    task_a = p.db.transaction(lambda c: make_task(c, a))
    task_b = p.db.transaction(lambda c: make_task(c, b))
    rows = [
        line("li-transcode", HOUR_1, "AWSElementalMediaConvert", "USE1-MediaConvert-HD", "0.0150", tenant=a.tenant_id, task=task_a),
        line("li-transcode", HOUR_2, "AWSElementalMediaConvert", "USE1-MediaConvert-HD", "0.0150", tenant=a.tenant_id, task=task_a),
        line("li-storage", HOUR_1, "AmazonS3", "USE1-TimedStorage-ByteHrs", "0.0020", tenant=a.tenant_id, project="trailers",
             asset="final"),
        line("li-cdn", HOUR_1, "AmazonCloudFront", "US-DataTransfer-Out-Bytes", "0.0300", tenant=a.tenant_id, task=task_a),
        line("li-eu-egress", HOUR_1, "AmazonS3", "EUC1-DataTransfer-Out-Bytes", "0.0100", "EUR", tenant=b.tenant_id),
        line("li-ec2", HOUR_1, "AmazonEC2", "USE1-BoxUsage:m7g.large", "0.0816"),  # not a media cost
        line("li-untagged", HOUR_1, "AmazonS3", "USE1-TimedStorage-ByteHrs", "0.0040"),
        line("li-stranger", HOUR_1, "AmazonS3", "USE1-TimedStorage-ByteHrs", "0.0040", tenant=uuid.uuid4()),
        line("li-not-uuid", HOUR_1, "AmazonS3", "USE1-TimedStorage-ByteHrs", "0.0040", tenant="acme"),
        line("li-their-task", HOUR_1, "AWSElementalMediaConvert", "USE1-MediaConvert-HD", "0.0150", tenant=a.tenant_id,
             task=task_b),
        line("li-ghost-task", HOUR_1, "AWSElementalMediaConvert", "USE1-MediaConvert-HD", "0.0150", tenant=a.tenant_id,
             task=uuid.uuid4()),
        line("li-bad-amount", HOUR_1, "AmazonS3", "USE1-TimedStorage-ByteHrs", "12,5", tenant=a.tenant_id),
        line("li-bad-currency", HOUR_1, "AmazonS3", "USE1-TimedStorage-ByteHrs", "0.0040", "XTS", tenant=a.tenant_id),
        line("li-lambda", HOUR_1, "AWSLambda", "USE1-Lambda-GB-Second", "0.0001", tenant=a.tenant_id, task=task_a),
    ]
    path = tmp_path_factory.mktemp("cur") / "aivedio-cur-00001.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([HEADER, *rows])
    first = p.db.transaction(lambda c: media_costs.import_cur(c, operator=ADMIN, path=str(path),
                                                               currencies=p.config.billing.media_cost_currencies))
    yield p, a, b, task_a, path, first
    p.close()


def counts(conn):
    return {t: conn.execute(f"select count(*) as n from {t}").fetchone()["n"]
            for t in ("media_cost_event", "billing_parked_event", "audit_log")}


def test_the_import_records_attributable_lines_and_reports_and_parks_the_rest(world, conn):
    p, a, b, task_a, path, doc = world
    assert (doc["lines"], doc["recorded"], doc["already_recorded"], doc["not_media"]) == (14, 5, 0, 1)
    assert doc["unattributed"] == 8 and doc["unattributed_by_reason"] == EXPECTED_REASONS and doc["parked_new"] == 8
    assert {(r["line_item_id"], r["reason"]) for r in doc["unattributed_lines"]} == {
        ("li-untagged", "NO_TENANT_TAG"), ("li-stranger", "UNKNOWN_TENANT"), ("li-not-uuid", "UNKNOWN_TENANT"),
        ("li-their-task", "TASK_OF_ANOTHER_TENANT"), ("li-ghost-task", "UNKNOWN_TASK"), ("li-bad-amount", "BAD_AMOUNT"),
        ("li-bad-currency", "UNKNOWN_CURRENCY"), ("li-lambda", "UNKNOWN_USAGE_TYPE")}
    assert {cur: {k: Decimal(v) for k, v in kinds.items()} for cur, kinds in doc["recorded_cost"].items()} == {
        "USD": {"TRANSCODE": Decimal("0.03"), "STORAGE": Decimal("0.002"), "EGRESS": Decimal("0.03")},
        "EUR": {"EGRESS": Decimal("0.01")}}
    rows = conn.execute("select * from media_cost_event where tenant_id = %s order by source_key", (a.tenant_id,)).fetchall()
    assert [(r["kind"], r["task_id"], r["project_id"]) for r in rows] == [
        ("EGRESS", task_a, None), ("STORAGE", None, "trailers"), ("TRANSCODE", task_a, None), ("TRANSCODE", task_a, None)]
    assert rows[1]["tags"]["asset_type"] == "final" and rows[1]["occurred_at"] == HOUR_1
    parked = conn.execute("""select detail, payload, tenant_id, task_id from billing_parked_event
                              where reason = 'MEDIA_COST_UNATTRIBUTED' order by detail""").fetchall()
    assert len(parked) == 8 and all(r["payload"]["source"] == "aws-cur" for r in parked)
    their = next(r for r in parked if r["payload"]["line"]["identity/LineItemId"] == "li-their-task")
    assert their["detail"].startswith("TASK_OF_ANOTHER_TENANT") and their["tenant_id"] == a.tenant_id
    audit = conn.execute(
        "select operator, target, new_value from audit_log where action = 'media_costs.import' order by audit_id").fetchone()
    assert audit["operator"] == ADMIN and audit["target"] == f"file:{doc['sha256']}" and audit["new_value"]["recorded"] == 5


def test_a_re_import_adds_nothing(world, conn, db_url, monkeypatch, capsys, tmp_path):
    p, a, b, task_a, path, first = world
    monkeypatch.setenv("AIVEDIO_DATABASE_URL", db_url)
    monkeypatch.setenv("AIVEDIO_REDIS_URL", "none")
    cli = Cli(monkeypatch)
    gz = tmp_path / "aivedio-cur-00001.csv.gz"
    with open(path, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    before = counts(conn)
    for f in (path, gz):
        assert cli.main(["admin", "media-costs", "import", "--file", str(f), "--json", "--operator", ADMIN]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert (doc["recorded"], doc["already_recorded"], doc["parked_new"], doc["recorded_cost"]) == (0, 5, 0, {})
        assert doc["unattributed_by_reason"] == EXPECTED_REASONS  # still reported, parked once
    after = counts(conn)
    assert (after["media_cost_event"], after["billing_parked_event"]) == (before["media_cost_event"], before["billing_parked_event"])
    assert after["audit_log"] == before["audit_log"] + 2  # each import is audited


def test_the_cost_report_shows_media_costs_by_tenant_and_kind(world, conn):
    p, a, b, task_a, path, first = world
    r = cost_report(conn, start=T0 - timedelta(hours=1), end=T0 + timedelta(hours=3))
    usd, eur = r["currencies"]["USD"], r["currencies"]["EUR"]
    assert Decimal(usd["media_cost"]) == Decimal("0.062")
    assert {k: Decimal(v) for k, v in usd["media_by_tenant"][str(a.tenant_id)].items()} == {
        "TRANSCODE": Decimal("0.03"), "STORAGE": Decimal("0.002"), "EGRESS": Decimal("0.03")}
    assert set(usd["media_by_tenant"]) == {str(a.tenant_id)}
    assert (Decimal(eur["media_cost"]), eur["media_by_tenant"]) == (Decimal("0.01"), {str(b.tenant_id): {"EGRESS": "0.01000000"}})
    # Only the first hour: the second hour of the transcode line is outside.
    r1 = cost_report(conn, start=HOUR_1, end=HOUR_2)
    assert Decimal(r1["currencies"]["USD"]["media_by_tenant"][str(a.tenant_id)]["TRANSCODE"]) == Decimal("0.015")


def test_refusals_write_nothing(world, conn, db_url, monkeypatch, capsys, tmp_path):
    p, a, b, task_a, path, first = world
    monkeypatch.setenv("AIVEDIO_DATABASE_URL", db_url)
    monkeypatch.setenv("AIVEDIO_REDIS_URL", "none")
    cli = Cli(monkeypatch)
    untagged = tmp_path / "no-tags.csv"
    with open(path) as src, open(untagged, "w", newline="") as dst:  # the tenant tag was never activated
        w = csv.writer(dst)
        for row in csv.reader(src):
            w.writerow(row[:7])
    broken = tmp_path / "broken.csv.gz"
    broken.write_bytes(b"\x1f\x8b not really gzip")
    before = counts(conn)
    cases = [(str(untagged), ADMIN, "VALIDATION_ERROR"), (str(broken), ADMIN, "VALIDATION_ERROR"),
             (str(tmp_path / "missing.csv"), ADMIN, "VALIDATION_ERROR")]
    for f, operator, code in cases:
        assert cli.main(["admin", "media-costs", "import", "--file", f, "--json", "--operator", operator]) == 1
        doc = json.loads(capsys.readouterr().out)
        assert doc["error"] == code, (f, operator, doc)
    assert doc["details"]["fields"] == {"file": "a readable CUR export (.csv or .csv.gz)"}
    assert counts(conn) == before


def test_usage_types_map_to_kinds():
    cases = {("AWSElementalMediaConvert", "USW2-MediaConvert-UHD"): "TRANSCODE",
             ("AmazonS3", "USE1-TimedStorage-ByteHrs"): "STORAGE", ("AmazonS3", "Requests-Tier1"): "STORAGE",
             ("AmazonS3", "USE1-USW2-AWS-Out-Bytes"): "EGRESS", ("AmazonS3", "DataTransfer-Out-Bytes"): "EGRESS",
             ("AmazonCloudFront", "EU-Requests-Tier2-HTTPS"): "EGRESS",
             ("AmazonS3", "USE1-DataTransfer-In-Bytes"): None, ("AmazonEC2", "USE1-DataTransfer-Out-Bytes"): None}
    assert {k: media_costs.kind_of(*k) for k in cases} == cases
