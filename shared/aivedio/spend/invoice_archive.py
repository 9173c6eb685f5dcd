"""The invoice archive (ch. 20.10.3 step 2): the raw bytes of every provider invoice document, and the
reconciliation reports, under content-addressed keys, never overwritten.

A key ends in the SHA-256 of its bytes (`<provider>/<date>/<sha256>.json`), so the same document fetched
twice is one object and a changed document is another one beside it; nothing is ever replaced or
deleted. Where it lives:
- S3 when Settings.invoice_bucket (AIVEDIO_INVOICE_BUCKET) names a bucket: the CDK's invoice archive,
  versioned and under Object Lock. A put is conditional (If-None-Match: *) and carries its SHA-256, so
  S3 refuses a second writer and verifies the bytes (it needs s3:PutObject only);
- else, locally, a directory under Settings.home (`.aivedio/invoices/`): a file is written beside its key
  and hard-linked into place, which fails when the key exists. A deployed function without a bucket
  archives nothing, and every run says so (INCOMPLETE, ARCHIVE_FAILED).

What it never does: overwrite or delete an object, or read anything but what it wrote."""
from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Stored:
    key: str
    sha256: str
    size: int
    created: bool  # False: the object was there already (the same bytes: the key says so)
    location: str  # s3://bucket/key, or the file's path


class ArchiveError(Exception):
    """The archive could not keep a document: nothing may be reconciled from it."""


class Archive(Protocol):
    def put(self, key: str, data: bytes, content_type: str = "application/json") -> Stored: ...

    def get(self, key: str) -> bytes: ...


def content_key(prefix: str, data: bytes, suffix: str = ".json") -> str:
    """`<prefix>/<sha256 of data><suffix>`."""
    return f"{prefix.strip('/')}/{sha256_hex(data)}{suffix}"


class LocalArchive:
    def __init__(self, root: Path):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise ArchiveError(f"archive key {key!r} leaves the archive")
        return path

    def put(self, key: str, data: bytes, content_type: str = "application/json") -> Stored:
        path = self._path(key)
        digest = sha256_hex(data)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".incoming-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # atomic, and refuses an existing name: never an overwrite
                created = True
            except FileExistsError:
                created = False
        finally:
            os.unlink(tmp)
        if not created and sha256_hex(path.read_bytes()) != digest:
            raise ArchiveError(f"{path} holds other bytes than this key's digest says")
        return Stored(key, digest, len(data), created, str(path))

    def get(self, key: str) -> bytes:
        return self._path(key).read_bytes()


class S3Archive:
    def __init__(self, bucket: str, client=None):
        self.bucket = bucket
        if client is None:
            import boto3  # lazy: boto3 takes most of a second to import, and only the AWS path needs it

            client = boto3.client("s3")
        self.client = client

    def put(self, key: str, data: bytes, content_type: str = "application/json") -> Stored:
        from botocore.exceptions import ClientError  # lazy: boto3's, as above

        digest = sha256_hex(data)
        location = f"s3://{self.bucket}/{key}"
        try:
            # Put-if-absent: S3 refuses the write when the key exists (If-None-Match), so no existence check (and
            # no s3:ListBucket) is needed, and no second version is ever made. Object Lock wants a checksum
            # header; S3 checks the bytes against it.
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, ContentType=content_type,
                                   ChecksumAlgorithm="SHA256",
                                   ChecksumSHA256=base64.b64encode(hashlib.sha256(data).digest()).decode(),
                                   IfNoneMatch="*")
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                return Stored(key, digest, len(data), False, location)
            raise ArchiveError(f"{location}: {e}") from None
        return Stored(key, digest, len(data), True, location)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()


class Unconfigured:
    """A deployed function without AIVEDIO_INVOICE_BUCKET: every put fails, so each run says so (INCOMPLETE,
    ARCHIVE_FAILED) instead of writing to a Lambda's scratch disk."""

    def put(self, key: str, data: bytes, content_type: str = "application/json") -> Stored:
        raise ArchiveError("no invoice archive in this function: AIVEDIO_INVOICE_BUCKET is not set")

    def get(self, key: str) -> bytes:
        raise ArchiveError("no invoice archive in this function: AIVEDIO_INVOICE_BUCKET is not set")


def archive_for(platform) -> Archive:
    """The platform's archive (one per process): S3 when a bucket is configured, else a directory (locally)."""
    archive = platform.extras.get("invoice_archive")
    if archive is None:
        bucket = platform.settings.invoice_bucket
        if bucket:
            archive = S3Archive(bucket, platform.extras.get("s3_client"))
        elif platform.settings.in_lambda:
            archive = Unconfigured()
        else:
            archive = LocalArchive(Path(platform.settings.home) / "invoices")
        platform.extras["invoice_archive"] = archive
    return archive
