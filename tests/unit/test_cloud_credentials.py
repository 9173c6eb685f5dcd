"""Credentials in AWS: an RDS IAM token per new connection (cached, re-signed before it expires),
the Redis user's password from Secrets Manager, and the settings that turn them on."""
from __future__ import annotations

import json

import pytest

from aivedio.cloud_credentials import TOKEN_REUSE_SECONDS, rds_iam_password, redis_url_with_secret
from aivedio.config import ConfigError, settings_from_env
from aivedio.db.pool import with_password


class FakeRds:
    def __init__(self):
        self.calls = []

    def generate_db_auth_token(self, **kw):
        self.calls.append(kw)
        return f"token-{len(self.calls)}"


class FakeSecrets:
    def __init__(self, value):
        self.value = value

    def get_secret_value(self, SecretId):  # noqa: N803 - boto3's spelling
        return {"SecretString": self.value}


def test_iam_token_is_signed_for_the_url_and_reused_until_it_nears_expiry():
    now = [1000.0]
    rds = FakeRds()
    password = rds_iam_password("postgresql://aivedio_admin@proxy.example:5432/aivedio?sslmode=require",
                                client=rds, clock=lambda: now[0])
    assert password() == "token-1"
    assert rds.calls == [{"DBHostname": "proxy.example", "Port": 5432, "DBUsername": "aivedio_admin"}]
    now[0] += TOKEN_REUSE_SECONDS - 1
    assert password() == "token-1"
    now[0] += 2
    assert password() == "token-2"


def test_iam_auth_needs_a_user_in_the_url():
    with pytest.raises(ConfigError, match="needs a host and a user"):
        rds_iam_password("postgresql://proxy.example/aivedio", client=FakeRds())


def test_redis_url_gets_the_secrets_credentials_quoted():
    secret = FakeSecrets(json.dumps({"username": "aivedio", "password": "p@ss/w:rd"}))
    url = redis_url_with_secret("rediss://cache.example:6379/0", "arn:secret", client=secret)
    assert url == "rediss://aivedio:p%40ss%2Fw%3Ard@cache.example:6379/0"


def test_a_malformed_redis_secret_is_one_clear_error():
    with pytest.raises(ConfigError, match="AIVEDIO_REDIS_SECRET_ARN"):
        redis_url_with_secret("rediss://cache.example:6379/0", "arn", client=FakeSecrets("not json"))


def test_with_password_keeps_the_rest_of_the_url():
    url = with_password("postgresql://aivedio_admin@proxy.example:5432/aivedio?sslmode=require", "a/b@c")
    assert url == "postgresql://aivedio_admin:a%2Fb%40c@proxy.example:5432/aivedio?sslmode=require"


def test_settings_read_the_aws_credential_switches():
    s = settings_from_env({"AIVEDIO_DATABASE_IAM_AUTH": "1", "AIVEDIO_REDIS_SECRET_ARN": "arn:aws:secretsmanager:x"})
    assert s.database_iam_auth is True and s.redis_secret_arn == "arn:aws:secretsmanager:x"
    assert settings_from_env({}).database_iam_auth is False
    with pytest.raises(ConfigError, match="AIVEDIO_DATABASE_IAM_AUTH"):
        settings_from_env({"AIVEDIO_DATABASE_IAM_AUTH": "maybe"})
