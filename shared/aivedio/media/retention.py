"""Retention classes of media objects (ch. 20.9.5): every object the platform writes to the media
bucket carries the tag `retention_class` with one of these names, and the bucket's lifecycle rules
(infra_cdk/data.py reads this table) expire or tier it accordingly. Days count from creation."""
from __future__ import annotations

from dataclasses import dataclass

TAG = "retention_class"


@dataclass(frozen=True)
class RetentionClass:
    name: str
    description: str
    expire_after_days: int | None = None  # None: kept until the product or contract says otherwise
    infrequent_access_after_days: int | None = None  # S3 requires >= 30
    glacier_ir_after_days: int | None = None


RETENTION_CLASSES: tuple[RetentionClass, ...] = (
    RetentionClass("provider-temp", "provider results fetched back, and download caches", expire_after_days=2),
    RetentionClass("render-intermediate", "render intermediates; dead once the task is terminal", expire_after_days=3),
    RetentionClass("proxy", "proxy videos, HLS/CMAF segments, thumbnails, waveforms", expire_after_days=90,
                   infrequent_access_after_days=30),
    RetentionClass("final", "final outputs and exports", infrequent_access_after_days=30, glacier_ir_after_days=180),
    RetentionClass("source", "tenant-supplied source material", infrequent_access_after_days=30, glacier_ir_after_days=180),
)


def by_name(name: str) -> RetentionClass:
    for c in RETENTION_CLASSES:
        if c.name == name:
            return c
    raise KeyError(name)
