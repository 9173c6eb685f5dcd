"""The input probe's pure checks (aivedio.media.probe): which addresses it refuses to connect to,
which hosts the allow-list exempts, which s3:// keys a tenant may name, and the config that feeds
them. The fetches themselves are in tests/integration/test_input_probe.py."""
from __future__ import annotations

import ipaddress

import pytest

from aivedio.config import ConfigError, Limits, parse_config, settings_from_env
from aivedio.media.probe import Allowance, _Refused, refusal, s3_key

# One per class of address a tenant's URL must never reach from inside the VPC.
REFUSED = {
    "127.0.0.1": "loopback",
    "127.255.0.9": "loopback",
    "10.1.2.3": "RFC 1918",
    "172.16.0.1": "RFC 1918",
    "172.31.255.254": "RFC 1918",
    "192.168.1.1": "RFC 1918",
    "169.254.169.254": "metadata (link-local)",
    "169.254.170.2": "ECS task metadata (link-local)",
    "0.0.0.0": "unspecified",
    "0.1.2.3": "this network, 0/8",
    "100.64.0.1": "carrier-grade NAT, 100.64/10",
    "100.127.255.254": "carrier-grade NAT, 100.64/10",
    "224.0.0.1": "multicast",
    "239.255.255.250": "multicast",
    "240.0.0.1": "reserved",
    "255.255.255.255": "broadcast",
    "192.0.0.8": "IETF protocol assignments",
    "198.18.0.1": "benchmarking",
    "192.0.2.1": "documentation",
    "192.88.99.1": "6to4 relay anycast (deprecated)",
    "::1": "IPv6 loopback",
    "::": "IPv6 unspecified",
    "fc00::1": "ULA fc00::/7",
    "fd12:3456::1": "ULA fc00::/7",
    "fe80::1": "IPv6 link-local",
    "fec0::1": "IPv6 site-local (deprecated)",
    "ff02::1": "IPv6 multicast",
    "2001:db8::1": "IPv6 documentation",
    "3fff::1": "IPv6 documentation (RFC 9637)",
    "100::1": "IPv6 discard-only",
    "::ffff:127.0.0.1": "IPv4-mapped loopback",
    "::ffff:10.0.0.1": "IPv4-mapped RFC 1918",
    "::ffff:169.254.169.254": "IPv4-mapped metadata",
    "::ffff:100.64.0.1": "IPv4-mapped CGNAT",
    "::127.0.0.1": "IPv4-compatible loopback",
    "::10.0.0.1": "IPv4-compatible RFC 1918",
    "::8.8.8.8": "IPv4-compatible (deprecated form, refused outright)",
    "64:ff9b::a9fe:a9fe": "NAT64 of the metadata address",
    "64:ff9b::7f00:1": "NAT64 of loopback",
    "64:ff9b:1::1": "local-use NAT64",
    "2002:7f00:1::": "6to4 of loopback",
    "2002:a00:1::1": "6to4 of RFC 1918",
    "2001::1": "Teredo",
}

ALLOWED = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "2a00:1450:4001:80b::200e",
           "::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::1"]


@pytest.mark.parametrize("address", list(REFUSED), ids=[f"{a} {why}" for a, why in REFUSED.items()])
def test_every_non_global_address_is_refused(address):
    assert refusal(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", ALLOWED)
def test_global_unicast_addresses_pass(address):
    assert refusal(ipaddress.ip_address(address)) is None


def test_the_allow_list_matches_names_against_the_url_host_and_networks_against_the_address():
    a = Allowance.of(Limits(probe_allowed_private_hosts=["Media.Test.", "127.0.0.1", "10.0.0.0/8", "fd00::/8"]).probe_allowed_private_hosts)
    ip = ipaddress.ip_address
    assert a.allows("media.test", ip("192.168.9.9"))  # a name exempts whatever it resolves to
    assert a.allows("media.test.", ip("169.254.169.254"))
    assert a.allows("anything", ip("127.0.0.1")) and a.allows("x", ip("::ffff:127.0.0.1"))
    assert a.allows("x", ip("10.200.0.1")) and a.allows("x", ip("fd00::5"))
    assert not a.allows("x", ip("127.0.0.2"))
    assert not a.allows("x", ip("169.254.169.254"))
    assert not a.allows("other.test", ip("192.168.9.9"))
    assert not Allowance.of([]).allows("localhost", ip("127.0.0.1"))  # the default allows nothing


@pytest.mark.parametrize("entry", ["not a host", "10.0.0.0/33", "http://x", "a..b", ""])
def test_a_bad_allow_list_entry_fails_at_start_naming_the_key(entry):
    with pytest.raises(ConfigError, match="limits.probe_allowed_private_hosts"):
        parse_config({"limits": {"probe_allowed_private_hosts": [entry]}})


def test_fetch_deadlines_have_defaults_and_must_be_positive():
    limits = Limits()
    assert (limits.input_fetch_deadline_seconds, limits.input_request_deadline_seconds, limits.input_max_redirects) == (10, 20, 3)
    assert limits.probe_allowed_private_hosts == []
    with pytest.raises(ConfigError, match="limits.input_fetch_deadline_seconds"):
        parse_config({"limits": {"input_fetch_deadline_seconds": 0}})


def test_the_media_bucket_comes_from_the_environment():
    assert settings_from_env({"AIVEDIO_MEDIA_BUCKET": "av-media-prod"}).media_bucket == "av-media-prod"
    assert settings_from_env({}).media_bucket is None


TENANT = "6f1c2d3e-0000-4000-8000-000000000001"
OTHER = "6f1c2d3e-0000-4000-8000-000000000002"


def test_an_s3_key_under_the_callers_prefix_is_accepted():
    assert s3_key(f"s3://media/inputs/{TENANT}/a/b.png", tenant_id=TENANT, media_bucket="media") == f"inputs/{TENANT}/a/b.png"


@pytest.mark.parametrize("url", [
    f"s3://media/inputs/{OTHER}/a.png",  # another tenant's upload
    f"s3://other-bucket/inputs/{TENANT}/a.png",  # another bucket
    f"s3://media.evil/inputs/{TENANT}/a.png",
    f"s3://media/inputs/{TENANT}/../{OTHER}/a.png",  # climbs out of the prefix
    f"s3://media/inputs/{TENANT}/./a.png",
    f"s3://media/inputs/{TENANT}//a.png",
    f"s3://media/inputs/{TENANT}/",  # the prefix itself
    f"s3://media/inputs/{TENANT}",
    f"s3://media/inputs/{TENANT}x/a.png",  # a tenant id that only starts like the caller's
    f"s3://media/outputs/{TENANT}/a.png",
    f"s3://media/{TENANT}/a.png",
    "s3://media",
], ids=lambda u: u.replace(TENANT, "T").replace(OTHER, "O"))
def test_any_other_s3_key_is_refused(url):
    with pytest.raises(_Refused) as e:
        s3_key(url, tenant_id=TENANT, media_bucket="media")
    assert e.value.hint == f"s3:// inputs must lie under s3://media/inputs/{TENANT}/"


def test_without_a_media_bucket_every_s3_input_is_refused():
    with pytest.raises(_Refused) as e:
        s3_key(f"s3://media/inputs/{TENANT}/a.png", tenant_id=TENANT, media_bucket=None)
    assert "not accepted" in e.value.hint
