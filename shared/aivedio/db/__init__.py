"""PostgreSQL access: one pool per process, a transaction helper that retries on 40001/40P01,
and the ordered SQL migrations."""
from aivedio.db.pool import Database, connect_or_fail, in_transaction

__all__ = ["Database", "connect_or_fail", "in_transaction"]
