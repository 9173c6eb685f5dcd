"""The invoice archive (aivedio.spend.invoice_archive): raw documents and reports under content-addressed
keys, never overwritten, in a local directory and in S3 (moto) with Object Lock, as a reconciliation run
writes them."""
from __future__ import annotations

import base64
import hashlib
from datetime import timedelta

import boto3
import pytest
from moto import mock_aws

from aivedio.config import ManualClock
from aivedio.spend import invoices
from aivedio.spend.invoice_archive import ArchiveError, LocalArchive, S3Archive, archive_for, content_key, sha256_hex
from tests.invoice_support import ACCOUNT, D, NOW, InvoiceStub, Seeder, line, platform_config, provider_config

pytestmark = pytest.mark.xdist_group("invoices")
BUCKET = "aivedio-invoice-archive-test"


@pytest.fixture
def stub():
    s = InvoiceStub({f"key-{ACCOUNT}": ACCOUNT})
    yield s
    s.stop()


def test_local_keys_are_content_addressed_and_never_overwritten(tmp_path):
    archive = LocalArchive(tmp_path)
    data = b'{"lines": []}'
    key = content_key("p/2026-06-24", data)
    assert key == f"p/2026-06-24/{sha256_hex(data)}.json"
    first = archive.put(key, data)
    assert first.created and first.sha256 == sha256_hex(data) and archive.get(key) == data
    mtime = (tmp_path / key).stat().st_mtime_ns
    again = archive.put(key, data)
    assert not again.created and (tmp_path / key).stat().st_mtime_ns == mtime  # not rewritten
    with pytest.raises(ArchiveError):  # other bytes under a key never replace what is there
        archive.put(key, b"something else")
    assert archive.get(key) == data
    with pytest.raises(ArchiveError):
        archive.put("../outside.json", data)
    assert not list(tmp_path.rglob(".incoming-*"))


def test_a_changed_document_is_a_new_object_beside_the_old_one(make_platform, stub, tmp_path):
    p = make_platform(platform_config(provider_config("inv-arch", stub.url)), clock=ManualClock(NOW))
    p.settings = p.settings.model_copy(update={"home": tmp_path})
    a = Seeder(p, "inv-arch").attempt("a", cost="0.25")
    v1 = stub.serve(ACCOUNT, D, [line("ln-a", charge="ch-a", job=a.job_id)])
    invoices.reconcile_day(p, "inv-arch", D)
    invoices.reconcile_day(p, "inv-arch", D)
    v2 = stub.serve(ACCOUNT, D, [line("ln-a", charge="ch-a", job=a.job_id), line("ln-b", charge="ch-b", job="job-b")])
    invoices.reconcile_day(p, "inv-arch", D)
    day_dir = tmp_path / "invoices" / "inv-arch" / D.isoformat()
    docs = {f.name: f.read_bytes() for f in day_dir.glob("*.json")}
    assert docs == {f"{sha256_hex(v1)}.json": v1, f"{sha256_hex(v2)}.json": v2}
    with p.db.connection() as c:
        rows = c.execute("""select sha256, object_key from provider_invoice_document
                             where provider = 'inv-arch' and invoice_date = %s order by first_fetched_at, sha256""",
                         (D,)).fetchall()
    assert {r["sha256"] for r in rows} == {sha256_hex(v1), sha256_hex(v2)}
    assert all(r["object_key"] == f"inv-arch/{D.isoformat()}/{r['sha256']}.json" for r in rows)


def test_s3_archive_with_object_lock(make_platform, stub, monkeypatch):
    for k, v in {"AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(k, v)
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET, ObjectLockEnabledForBucket=True)
        s3.put_object_lock_configuration(Bucket=BUCKET, ObjectLockConfiguration={
            "ObjectLockEnabled": "Enabled", "Rule": {"DefaultRetention": {"Mode": "GOVERNANCE", "Days": 1}}})
        p = make_platform(platform_config(provider_config("inv-s3", stub.url)), clock=ManualClock(NOW), invoice_bucket=BUCKET)
        p.extras["s3_client"] = s3
        assert isinstance(archive_for(p), S3Archive)
        a = Seeder(p, "inv-s3").attempt("s", cost="0.25")
        body = stub.serve(ACCOUNT, D, [line("ln-s", charge="ch-s", job=a.job_id)])
        r = invoices.reconcile_day(p, "inv-s3", D)
        invoices.reconcile_day(p, "inv-s3", D)  # the same document again: the same object, no new version
        key = f"inv-s3/{D.isoformat()}/{sha256_hex(body)}.json"
        head = s3.head_object(Bucket=BUCKET, Key=key, ChecksumMode="ENABLED")
        assert head["ChecksumSHA256"] == base64.b64encode(hashlib.sha256(body).digest()).decode()
        assert head["ObjectLockMode"] == "GOVERNANCE"
        assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == body
        versions = s3.list_object_versions(Bucket=BUCKET, Prefix=key)["Versions"]
        assert len(versions) == 1
        assert r.report_key.startswith(f"inv-s3/{D.isoformat()}/reports/") and r.report_html_key.endswith(".html")
        report = s3.get_object(Bucket=BUCKET, Key=r.report_key)
        assert report["ContentType"] == "application/json" and b'"status": "COMPLETE"' in report["Body"].read()
        assert not S3Archive(BUCKET, s3).put(key, body).created
        # S3 itself refuses a second write of a key (If-None-Match), whatever the bytes: what is there stays.
        assert not S3Archive(BUCKET, s3).put(key, b"other bytes").created
        assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == body
        assert len(s3.list_object_versions(Bucket=BUCKET, Prefix=key)["Versions"]) == 1
        r2 = invoices.reconcile_day(p, "inv-s3", D - timedelta(days=1))
        assert r2.document["status"] == "COMPLETE"


def test_a_function_without_a_bucket_archives_nothing_and_uses_nothing(make_platform, stub, conn):
    p = make_platform(platform_config(provider_config("inv-noarch", stub.url)), clock=ManualClock(NOW))
    p.settings = p.settings.model_copy(update={"in_lambda": True})
    a = Seeder(p, "inv-noarch").attempt("n", cost="0.25")
    stub.serve(ACCOUNT, D, [line("ln-n", charge="ch-n", job=a.job_id)])
    r = invoices.reconcile_day(p, "inv-noarch", D)
    assert r.document["status"] == "INCOMPLETE" and r.report_key is None
    codes = {x["code"] for x in r.document["incomplete_reasons"]}
    assert codes == {"ARCHIVE_FAILED"}
    assert "AIVEDIO_INVOICE_BUCKET" in r.document["incomplete_reasons"][0]["evidence"]["error"]
    assert conn.execute("select count(*) as n from provider_invoice_line where provider = 'inv-noarch'").fetchone()["n"] == 0
