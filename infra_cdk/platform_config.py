"""The deployed platform's configuration (aivedio.cloud_config reads both at a cold start):

- `PlatformConfigParameter` (app stack): an SSM parameter holding the TOML document of
  docs/configuration.md, from `infra_cdk/platform-config/<stage>.toml`. Synthesis validates the
  file as the functions will (every provider external, no secret in it), so a bad config fails
  `cdk synth`, not a cold start. Every function may read it.
- `ProviderCredentials` (data stack, so a redeploy of the app never loses what was typed in): the
  Secrets Manager secret with each provider's webhook secret and API keys. The stack creates it
  with no credential in it (an empty `providers` object and a random filler key): until the
  platform team writes the keys, the functions that need them fail at start naming the missing key.
  Only the functions whose profile says `provider_credentials` may read it."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

from aws_cdk import RemovalPolicy
from aws_cdk import aws_secretsmanager as secretsmanager
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from aivedio.cloud_config import secrets_in
from aivedio.config import PlatformConfig
from infra_cdk.nag import suppress
from infra_cdk.stages import ROOT, StageConfig

CONFIG_DIR = ROOT / "infra_cdk" / "platform-config"
SSM_ADVANCED_LIMIT = 8192  # bytes an advanced-tier String parameter holds


def config_file(stage: StageConfig) -> Path:
    return CONFIG_DIR / f"{stage.name}.toml"


def validated_config_text(path: Path) -> str:
    """The file's text, after the checks a cold start makes (credentials are not in it)."""
    text = path.read_text()
    data = tomllib.loads(text)
    leaked = secrets_in(data)
    if leaked:
        raise SystemExit(f"{path}: {leaked[0]}: secrets go in the provider credentials secret, not here")
    if not data.get("providers"):
        raise SystemExit(f"{path}: no [[providers]] entry (the default is a built-in simulator, which runs only locally)")
    config = PlatformConfig.model_validate(data, context={"provider_credentials": "absent"})
    simulated = [p.name for p in config.providers if p.base_url is None]
    if simulated:
        raise SystemExit(f"{path}: providers.{simulated[0]} needs a base_url in AWS (built-in simulators run only locally)")
    if len(text.encode()) > SSM_ADVANCED_LIMIT:
        raise SystemExit(f"{path}: {len(text.encode())} bytes; an SSM parameter holds {SSM_ADVANCED_LIMIT}")
    return text


class PlatformConfigParameter(Construct):
    def __init__(self, scope: Construct, cid: str, *, stage: StageConfig) -> None:
        super().__init__(scope, cid)
        text = validated_config_text(config_file(stage))
        self.parameter = ssm.StringParameter(
            self, "Parameter", parameter_name=f"/{stage.prefix}/platform-config", string_value=text,
            tier=ssm.ParameterTier.ADVANCED if len(text.encode()) > 4096 else ssm.ParameterTier.STANDARD,
            description="AiVedio platform config (TOML of docs/configuration.md); no secrets")


class ProviderCredentials(Construct):
    def __init__(self, scope: Construct, cid: str, *, stage: StageConfig) -> None:
        super().__init__(scope, cid)
        self.secret = secretsmanager.Secret(
            self, "Secret",
            secret_name=f"{stage.prefix}/provider-credentials",
            description='Provider credentials: {"providers": {"<name>": {"webhook_secret": "whsec_...", '
                        '"accounts": {"<account_id>": "<api key>"}}}} (infra_cdk/README.md, first deploy)',
            # No credential is generated: the filler key only satisfies the generator.
            generate_secret_string=secretsmanager.SecretStringGenerator(
                secret_string_template=json.dumps({"providers": {}}), generate_string_key="unused_filler",
                exclude_punctuation=True, password_length=16),
            removal_policy=RemovalPolicy.RETAIN if stage.retain else stage.removal_policy,
        )
        suppress(self.secret, ("AwsSolutions-SMG4", "Provider API keys and webhook secrets are issued by each provider; "
                                                    "they are rotated with the provider and written here by the platform "
                                                    "team (infra_cdk/README.md), so no rotation Lambda can rotate them."))
