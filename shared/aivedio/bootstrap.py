"""What a deployment derives from its config once the schema exists: the resource pools of every
lane, provider account, model and worker pool, and the active price version. Idempotent; run on
deploy (the migration Lambda) and when the local runtime starts."""
from __future__ import annotations

import psycopg

from aivedio.config import Clock, PlatformConfig
from aivedio.db.pool import in_transaction
from aivedio.pricing.price_book import ensure_price_book
from aivedio.scheduling.resources import ensure_platform_pools


def apply_config(conn: psycopg.Connection, config: PlatformConfig, clock: Clock) -> dict:
    in_transaction(conn, lambda c: ensure_platform_pools(c, config))  # retried on deadlock, like every writer
    version = ensure_price_book(conn, config, clock.now())
    return {"price_version_id": str(version)}
