"""The platform config in AWS (aivedio.cloud_config), against moto's SSM and Secrets Manager, and
the rule that no secret has a default (aivedio.config)."""
from __future__ import annotations

import json

import boto3
import pytest
from moto import mock_aws

from aivedio.cloud_config import load_platform_config
from aivedio.config import ConfigError, PlatformConfig, ProviderConfig, Settings, parse_config, settings_from_env

REGION = "eu-west-1"
CONFIG_TOML = """
time_scale = 1.0

[[providers]]
name = "provider-a"
base_url = "https://api.provider-a.example"
models = ["video-model-x"]
[[providers.accounts]]
account_id = "account-01"
max_concurrency = 40
[[providers.accounts]]
account_id = "account-02"
max_concurrency = 8

[lanes.PAID_SHARED]
capacity_units = 900
"""
CREDENTIALS = {"providers": {"provider-a": {"webhook_secret": "whsec_cHJvdmlkZXItYS1zZWNyZXQ=",
                                            "accounts": {"account-01": "key-one", "account-02": "key-two"}}}}


@pytest.fixture
def aws(monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(k, "testing")
    with mock_aws():
        ssm = boto3.client("ssm", region_name=REGION)
        sm = boto3.client("secretsmanager", region_name=REGION)
        yield ssm, sm


def _put(ssm, sm, text=CONFIG_TOML, credentials=CREDENTIALS):
    ssm.put_parameter(Name="/aivedio/dev/platform-config", Value=text, Type="String", Tier="Advanced", Overwrite=True)
    arn = sm.create_secret(Name="aivedio/dev/provider-credentials", SecretString=json.dumps(credentials))["ARN"]
    return "/aivedio/dev/platform-config", arn


def _lambda_settings(**kw) -> Settings:
    return Settings(database_url="postgresql://x/y", redis_url="none", in_lambda=True, **kw)


def test_a_function_with_the_grant_gets_the_config_and_every_credential(aws):
    name, arn = _put(*aws)
    config = load_platform_config(_lambda_settings(config_parameter=name, provider_secret_arn=arn))
    p = config.provider("provider-a")
    assert p.base_url == "https://api.provider-a.example" and p.webhook_secret == CREDENTIALS["providers"]["provider-a"]["webhook_secret"]
    assert {a.account_id: (a.api_key, a.max_concurrency) for a in p.accounts} == {"account-01": ("key-one", 40),
                                                                                   "account-02": ("key-two", 8)}
    assert config.lanes["PAID_SHARED"].capacity_units == 900


def test_a_function_without_the_grant_loads_the_config_without_credentials(aws):
    name, _ = _put(*aws)
    config = load_platform_config(_lambda_settings(config_parameter=name))
    p = config.provider("provider-a")
    assert p.webhook_secret is None and not p.has_credentials
    from aivedio.providers.adapter import HttpProviderAdapter

    with pytest.raises(ConfigError, match="no credentials in this process"):
        HttpProviderAdapter(p)


def test_a_missing_credential_fails_at_start_naming_the_key(aws):
    creds = {"providers": {"provider-a": {"webhook_secret": "whsec_cHJvdmlkZXItYS1zZWNyZXQ=",
                                          "accounts": {"account-01": "key-one"}}}}
    name, arn = _put(*aws, credentials=creds)
    with pytest.raises(ConfigError) as e:
        load_platform_config(_lambda_settings(config_parameter=name, provider_secret_arn=arn))
    assert "providers.0.accounts" in str(e.value) and "1.api_key" in str(e.value) and "account-02" in str(e.value)
    assert "\n" not in str(e.value)
    no_webhook = {"providers": {"provider-a": {"accounts": {"account-01": "k1", "account-02": "k2"}}}}
    ssm, sm = aws
    arn2 = sm.create_secret(Name="other", SecretString=json.dumps(no_webhook))["ARN"]
    with pytest.raises(ConfigError, match=r"key 'providers.0.webhook_secret'"):
        load_platform_config(_lambda_settings(config_parameter=name, provider_secret_arn=arn2))


def test_a_secret_pasted_into_the_parameter_is_refused(aws):
    leaked = CONFIG_TOML.replace('max_concurrency = 8', 'max_concurrency = 8\napi_key = "sk-live-oops"')
    name, arn = _put(*aws, text=leaked)
    with pytest.raises(ConfigError, match=r"providers.0.accounts.1.api_key': secrets belong in the provider secret"):
        load_platform_config(_lambda_settings(config_parameter=name, provider_secret_arn=arn))


@pytest.mark.parametrize("secret", ["not json", json.dumps({"providers": []}),
                                    json.dumps({"providers": {"provider-a": {"accounts": ["k"]}}})])
def test_a_malformed_secret_is_one_line_naming_the_variable(aws, secret):
    ssm, sm = aws
    name, _ = _put(ssm, sm)
    arn = sm.create_secret(Name="bad", SecretString=secret)["ARN"]
    with pytest.raises(ConfigError, match="^AIVEDIO_PROVIDER_SECRET_ARN: "):
        load_platform_config(_lambda_settings(config_parameter=name, provider_secret_arn=arn))


def test_a_deployed_function_needs_the_parameter_and_refuses_a_built_in_simulator(aws):
    with pytest.raises(ConfigError, match="^AIVEDIO_CONFIG_PARAMETER: not set"):
        load_platform_config(_lambda_settings())
    ssm, sm = aws
    name, arn = _put(ssm, sm, text='[[providers]]\nname = "provider-a"\n')
    with pytest.raises(ConfigError, match=r"providers.provider-a.base_url': required in AWS"):
        load_platform_config(_lambda_settings(config_parameter=name, provider_secret_arn=arn))


def test_in_lambda_the_environment_gives_no_local_defaults():
    env = {"AWS_LAMBDA_FUNCTION_NAME": "aivedio-dev-attempt-step", "AIVEDIO_CONFIG_PARAMETER": "/p",
           "AIVEDIO_PROVIDER_SECRET_ARN": "arn:aws:secretsmanager:eu-west-1:1:secret:x"}
    s = settings_from_env(env)
    assert s.in_lambda and s.api_base_url is None and s.config_parameter == "/p" and s.provider_secret_arn.endswith(":x")
    assert settings_from_env({}).api_base_url == "http://127.0.0.1:8080" and not settings_from_env({}).in_lambda
    url = "https://abc.execute-api.eu-west-1.amazonaws.com/dev/"
    assert settings_from_env({**env, "AIVEDIO_API_BASE_URL": url}).api_base_url == url


def test_no_secret_has_a_default():
    for field in (ProviderConfig.model_fields["webhook_secret"], ):
        assert field.default is None
    from aivedio.config import ProviderAccount

    assert ProviderAccount.model_fields["api_key"].default is None
    with pytest.raises(ConfigError, match=r"key 'providers.0.webhook_secret'"):
        parse_config({"providers": [{"name": "p", "base_url": "https://p.example", "accounts": [{"account_id": "a", "api_key": "k"}]}]})


def test_a_built_in_simulator_gets_random_credentials_per_process():
    a, b = PlatformConfig().providers[0], PlatformConfig().providers[0]
    assert a.webhook_secret.startswith("whsec_") and a.webhook_secret != b.webhook_secret
    assert a.accounts[0].api_key != b.accounts[0].api_key
    two = ProviderConfig(name="p", accounts=[{"account_id": "x"}, {"account_id": "y"}])
    assert len({acc.api_key for acc in two.accounts}) == 2
    # What a process hands its children (model_dump) keeps the same secret.
    assert PlatformConfig.model_validate(PlatformConfig().model_dump(mode="json")).providers[0].webhook_secret.startswith("whsec_")
    c = PlatformConfig()
    assert PlatformConfig.model_validate(c.model_dump(mode="json")) == c
