from __future__ import annotations

import logging
import random
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import psycopg
from psycopg import errors
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from aivedio.config import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRYABLE = (errors.SerializationFailure, errors.DeadlockDetected)
# What PostgreSQL being down (or unreachable) raises: no connection in time (psycopg_pool.PoolTimeout
# is one), a connection lost mid-statement, the server shutting down. The API maps these to 503.
UNAVAILABLE = (psycopg.OperationalError,)
MAX_TX_ATTEMPTS = 8


def redact(url: str) -> str:
    """A URL safe to print: the password hidden."""
    try:
        parts = urlsplit(url)
        if parts.password:
            netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
            return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        pass
    return url


def with_password(url: str, password: str) -> str:
    """The URL with this password (percent-encoded) in its user info."""
    parts = urlsplit(url)
    user = unquote(parts.username or "")
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


PasswordProvider = Callable[[], str]  # called for each new connection (IAM tokens expire)


def connect_or_fail(url: str, timeout: float = 5.0, password: PasswordProvider | None = None) -> None:
    """Fail at start with one clear line when the database cannot be reached."""
    extra = {"password": password()} if password is not None else {}
    try:
        with psycopg.connect(url, connect_timeout=max(1, int(timeout)), **extra) as c:
            c.execute("select 1")
    except psycopg.Error as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"database {redact(url)}: unreachable: {first}") from None


class Database:
    """A pool of connections that yield dict rows. Each writer takes a connection from here or
    is handed one by its caller, so several writes compose into one commit."""

    def __init__(self, url: str, min_size: int = 1, max_size: int = 10, name: str = "aivedio",
                 password: PasswordProvider | None = None):
        self.url = url
        base = {"row_factory": dict_row, "autocommit": True}
        self.pool = ConnectionPool(
            url,
            min_size=min_size,
            max_size=max_size,
            # A password provider is asked again for every new connection (psycopg_pool >= 3.3).
            kwargs=base if password is None else (lambda: {**base, "password": password()}),
            name=name,
            open=True,
            timeout=30,
        )

    def close(self) -> None:
        self.pool.close()

    @contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[psycopg.Connection]:
        """A pooled connection; `timeout` (real seconds) bounds the wait for one, else the pool's 30 s.
        A wait that runs out raises psycopg_pool.PoolTimeout, one of UNAVAILABLE."""
        with self.pool.connection(timeout=timeout) as conn:
            yield conn

    def transaction(self, fn: Callable[[psycopg.Connection], T], *, attempts: int = MAX_TX_ATTEMPTS) -> T:
        """Run fn inside one transaction; retry the whole of it on serialization failure or deadlock."""
        with self.pool.connection() as conn:
            return in_transaction(conn, fn, attempts=attempts)

    def fetchone(self, sql: str, params: object = None) -> dict | None:
        with self.pool.connection() as conn:
            return conn.execute(sql, params).fetchone()

    def fetchall(self, sql: str, params: object = None) -> list[dict]:
        with self.pool.connection() as conn:
            return conn.execute(sql, params).fetchall()

    def healthy(self, timeout: float = 30.0) -> bool:
        try:
            with self.pool.connection(timeout=timeout) as conn:
                conn.execute("select 1 as ok")
            return True
        except Exception:
            return False


def in_transaction(conn: psycopg.Connection, fn: Callable[[psycopg.Connection], T], *, attempts: int = MAX_TX_ATTEMPTS) -> T:
    for attempt in range(1, attempts + 1):
        try:
            with conn.transaction():
                return fn(conn)
        except RETRYABLE as e:
            if attempt == attempts:
                raise
            delay = min(0.2, 0.005 * (2 ** attempt)) * (0.5 + random.random())
            log.info("transaction retry %d after %s", attempt, type(e).__name__)
            time.sleep(delay)
    raise AssertionError("unreachable")
