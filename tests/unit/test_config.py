from datetime import datetime, timezone

import pytest

from aivedio.config import Clock, ConfigError, ManualClock, PlatformConfig, load_config, settings_from_env


def test_defaults_run_without_a_file():
    cfg = load_config(None)
    assert cfg.time_scale == 1.0
    assert set(cfg.lanes) == {"ENTERPRISE_RESERVED", "PAID_SHARED", "STANDARD", "BEST_EFFORT", "EXPENSIVE", "RECOVERY"}
    assert cfg.providers[0].name == "provider-a"
    assert cfg.lanes["ENTERPRISE_RESERVED"].borrowable_units == 200


def test_contract_example_parses(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text(
        """
time_scale = 60.0
[[providers]]
name = "provider-a"
base_url = "http://127.0.0.1:9101"
webhook_secret = "whsec_abc"
models = ["video-model-x"]
[[providers.accounts]]
account_id = "account-01"
api_key = "k"
region = "us"
max_concurrency = 200
[lanes.ENTERPRISE_RESERVED]
capacity_units = 500
borrowable_units = 200
"""
    )
    cfg = load_config(f)
    assert cfg.time_scale == 60.0
    assert cfg.providers[0].accounts[0].max_concurrency == 200
    assert cfg.lanes["PAID_SHARED"].capacity_units == 1200  # unspecified lanes keep defaults


@pytest.mark.parametrize(
    "text, key",
    [
        ("time_scale = -1", "time_scale"),
        ("time_scale = 'fast'", "time_scale"),
        ("[lanes.NOPE]\ncapacity_units = 1", "lanes"),
        ("[[providers]]\nname = 'p'\n[[providers.accounts]]\naccount_id = 'a'\nmax_concurrency = 0", "providers.0.accounts.0.max_concurrency"),
        ("surprise = 1", "surprise"),
    ],
)
def test_bad_config_fails_with_one_line_naming_the_key(tmp_path, text, key):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"'{key}" in msg


def test_malformed_toml_names_the_file(tmp_path):
    f = tmp_path / "broken.toml"
    f.write_text("time_scale = [")
    with pytest.raises(ConfigError, match="broken.toml: not valid TOML"):
        load_config(f)


def test_env_urls_are_checked():
    with pytest.raises(ConfigError, match="AIVEDIO_DATABASE_URL"):
        settings_from_env({"AIVEDIO_DATABASE_URL": "mysql://x"})
    with pytest.raises(ConfigError, match="AIVEDIO_REDIS_URL"):
        settings_from_env({"AIVEDIO_REDIS_URL": "http://x"})
    s = settings_from_env({"AIVEDIO_REDIS_URL": "none"})
    assert s.redis_disabled and s.database_url is None


def test_clock_scales_durations():
    c = Clock(time_scale=60)
    assert c.real_seconds(300) == 5
    m = ManualClock(datetime(2026, 1, 1, tzinfo=timezone.utc), time_scale=2)
    m.advance(10)
    assert m.now() == datetime(2026, 1, 1, 0, 0, 5, tzinfo=timezone.utc)
    with pytest.raises(ConfigError):
        Clock(0)


def test_price_defaults_cover_every_model():
    cfg = PlatformConfig()
    assert cfg.price_for("video-model-x").charge_policy_code == "SUCCESS_ONLY"
