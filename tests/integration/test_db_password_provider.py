"""A password provider (RDS IAM tokens in AWS) is asked again for every new pooled connection."""
from __future__ import annotations

from urllib.parse import unquote, urlsplit

from aivedio.db.pool import Database, connect_or_fail


def test_every_new_connection_asks_the_provider(db_url):
    calls = []
    real = unquote(urlsplit(db_url).password or "")  # what the test server expects, if anything

    def password() -> str:
        calls.append(1)
        return real

    connect_or_fail(db_url, password=password)
    assert len(calls) == 1
    db = Database(db_url, min_size=1, max_size=2, password=password)
    try:
        db.pool.wait(timeout=10)
        with db.connection() as a, db.connection() as b:  # the second forces a new connection
            assert a.execute("select 1 as ok").fetchone()["ok"] == 1
            assert b.execute("select 1 as ok").fetchone()["ok"] == 1
        assert len(calls) >= 3
    finally:
        db.close()
