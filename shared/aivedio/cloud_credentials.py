"""Credentials the deployed platform obtains at start instead of carrying them in its environment.

- PostgreSQL: every Lambda connects to the RDS Proxy with IAM authentication. The URL in the
  environment names the proxy, the database user and sslmode=require; each new connection gets a
  token signed locally by boto3 (no network call), valid for 15 minutes, so a pool that opens a
  connection hours later still authenticates. The proxy itself reads the database secret from
  Secrets Manager, so the secret can rotate without any function noticing.
- Redis: ElastiCache (TLS, RBAC user) has its user name and password in a Secrets Manager secret
  ({"username": ..., "password": ...}); it is read once per cold start and put in the URL.

Only the code paths with AWS settings import this module; locally nothing here runs."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from aivedio.config import ConfigError

TOKEN_REUSE_SECONDS = 600.0  # a token lives 15 minutes; sign a new one well before that


def rds_iam_password(url: str, *, client=None, clock: Callable[[], float] = time.monotonic) -> Callable[[], str]:
    """A password provider for `url`: a cached RDS IAM auth token, re-signed every 10 minutes."""
    parts = urlsplit(url)
    if not parts.hostname or not parts.username:
        raise ConfigError("AIVEDIO_DATABASE_URL: IAM authentication needs a host and a user in the URL")
    host, port, user = parts.hostname, parts.port or 5432, unquote(parts.username)
    lock = threading.Lock()
    cached: dict[str, object] = {}

    def password() -> str:
        nonlocal client
        with lock:
            now = clock()
            if "token" not in cached or now >= cached["expires"]:  # type: ignore[operator]
                if client is None:
                    import boto3  # lazy: boto3 takes most of a second to import; only a deployed function asks AWS for credentials

                    client = boto3.client("rds")
                cached["token"] = client.generate_db_auth_token(DBHostname=host, Port=port, DBUsername=user)
                cached["expires"] = now + TOKEN_REUSE_SECONDS
            return str(cached["token"])

    return password


def redis_url_with_secret(url: str, secret_arn: str, *, client=None) -> str:
    """`url` (rediss://host:port[/db]) with the user name and password of the secret."""
    if client is None:
        import boto3  # lazy: boto3 takes most of a second to import; only a deployed function asks AWS for credentials

        client = boto3.client("secretsmanager")
    try:
        secret = json.loads(client.get_secret_value(SecretId=secret_arn)["SecretString"])
        username, password = secret["username"], secret["password"]
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"AIVEDIO_REDIS_SECRET_ARN: the secret must be JSON with username and password ({e!r})") from None
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{quote(username, safe='')}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
