"""Where a process gets its platform config: the TOML file of docs/configuration.md locally, and
in AWS the stack's SSM parameter plus the provider secret.

- `AIVEDIO_CONFIG_PARAMETER` names an SSM parameter that holds the same TOML document (providers,
  accounts, lanes, prices, timers). It is no place for secrets: a document with a `webhook_secret`
  or an `api_key` in it is refused, so a key pasted there fails the deploy instead of leaking.
- `AIVEDIO_PROVIDER_SECRET_ARN` names the Secrets Manager secret with every provider credential,
  granted only to the functions that call providers or verify their webhooks:

      {"providers": {"provider-a": {"webhook_secret": "whsec_...",
                                    "accounts": {"account-01": "<api key>"}}}}

  A function without the grant loads the config without credentials (it never talks to a
  provider); one with the grant fails at start, naming the key, when a credential is missing.
- A deployed function refuses a built-in simulator (a provider without `base_url`): nothing would
  answer it in AWS.

Both documents are read once per cold start (the Platform holds the result)."""
from __future__ import annotations

import json
import tomllib
from typing import Any

from pydantic import ValidationError

from aivedio.config import ConfigError, PlatformConfig, Settings, _error_line, load_config

SECRET_KEYS = ("webhook_secret", "api_key")


def load_platform_config(settings: Settings, *, ssm=None, secretsmanager=None) -> PlatformConfig:
    if settings.config_parameter is None:
        if settings.in_lambda:
            raise ConfigError("AIVEDIO_CONFIG_PARAMETER: not set; a deployed function reads the platform config from "
                              "the SSM parameter its stack creates")
        return load_config(settings.config_file)
    data = _parameter_document(settings.config_parameter, ssm)
    source = f"SSM parameter {settings.config_parameter}"
    credentials = None
    if settings.provider_secret_arn is not None:
        credentials = _secret_document(settings.provider_secret_arn, secretsmanager)
        data = merge_credentials(data, credentials)
    try:
        config = PlatformConfig.model_validate(
            data, context=None if credentials is not None else {"provider_credentials": "absent"})
    except ValidationError as e:
        raise ConfigError(_error_line(source, e)) from None
    simulated = [p.name for p in config.providers if p.base_url is None]
    if settings.in_lambda and simulated:
        raise ConfigError(f"{source}: key 'providers.{simulated[0]}.base_url': required in AWS (a built-in simulator "
                          "runs only locally)")
    return config


def _parameter_document(name: str, client) -> dict[str, Any]:
    if client is None:
        import boto3  # lazy: boto3 takes most of a second to import; only a deployed function reads its config from AWS

        client = boto3.client("ssm")
    text = client.get_parameter(Name=name, WithDecryption=True)["Parameter"]["Value"]
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"SSM parameter {name}: not valid TOML: {e}") from None
    found = secrets_in(data)
    if found:
        raise ConfigError(f"SSM parameter {name}: key '{found[0]}': secrets belong in the provider secret "
                          "(AIVEDIO_PROVIDER_SECRET_ARN), not in the config")
    return data


def secrets_in(data: dict[str, Any]) -> list[str]:
    """The keys of a config document that hold credentials (none may, outside the provider secret)."""
    found = []
    for i, p in enumerate(data.get("providers") or []):
        if isinstance(p, dict):
            found += [f"providers.{i}.{k}" for k in SECRET_KEYS if k in p]
            found += [f"providers.{i}.accounts.{j}.{k}" for j, a in enumerate(p.get("accounts") or [])
                      if isinstance(a, dict) for k in SECRET_KEYS if k in a]
    return found


def _secret_document(arn: str, client) -> dict[str, Any]:
    if client is None:
        import boto3  # lazy: boto3 takes most of a second to import; only a deployed function reads its config from AWS

        client = boto3.client("secretsmanager")
    try:
        doc = json.loads(client.get_secret_value(SecretId=arn)["SecretString"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"AIVEDIO_PROVIDER_SECRET_ARN: the secret must be a JSON document ({type(e).__name__})") from None
    providers = doc.get("providers") if isinstance(doc, dict) else None
    if not isinstance(providers, dict):
        raise ConfigError("AIVEDIO_PROVIDER_SECRET_ARN: the secret must be JSON of the form "
                          '{"providers": {"<name>": {"webhook_secret": "...", "accounts": {"<account_id>": "<api key>"}}}}')
    for name, entry in providers.items():
        accounts = entry.get("accounts", {}) if isinstance(entry, dict) else None
        if not isinstance(accounts, dict) or not all(isinstance(v, str) for v in accounts.values()) \
                or not isinstance(entry.get("webhook_secret", ""), str):
            raise ConfigError(f"AIVEDIO_PROVIDER_SECRET_ARN: key 'providers.{name}': expected webhook_secret (a string) "
                              "and accounts (account_id to API key)")
    return providers


def merge_credentials(data: dict[str, Any], credentials: dict[str, Any]) -> dict[str, Any]:
    """The config document with each provider's webhook secret and account keys from the secret."""
    providers = []
    for p in data.get("providers") or []:
        entry = credentials.get(p.get("name")) if isinstance(p, dict) else None
        if not entry:
            providers.append(p)
            continue
        keys = entry.get("accounts", {})
        accounts = [{**a, "api_key": keys[a["account_id"]]} if isinstance(a, dict) and a.get("account_id") in keys else a
                    for a in p.get("accounts") or []]
        merged = {**p, "accounts": accounts} if "accounts" in p else dict(p)
        if entry.get("webhook_secret"):
            merged["webhook_secret"] = entry["webhook_secret"]
        providers.append(merged)
    return {**data, "providers": providers} if "providers" in data else data
