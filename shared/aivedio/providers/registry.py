"""The provider adapters of one process, built once from the config. A provider whose entry has no
base_url is served by a built-in simulator, whose address the local runtime records in
platform.extras["provider_base_urls"]; in AWS every provider entry names its base_url."""
from __future__ import annotations

import threading

from aivedio.errors import DomainError
from aivedio.providers.adapter import HttpProviderAdapter, build_adapters

_lock = threading.Lock()


class UnknownProvider(DomainError):
    code = "UNKNOWN_PROVIDER"


def adapters(platform) -> dict[str, HttpProviderAdapter]:
    with _lock:
        built = platform.extras.get("provider_adapters")
        if built is None:
            built = build_adapters(platform.config.providers, platform.extras.get("provider_base_urls"))
            platform.extras["provider_adapters"] = built
        return built


def adapter(platform, provider: str) -> HttpProviderAdapter:
    try:
        return adapters(platform)[provider]
    except KeyError:
        raise UnknownProvider(f"no provider {provider!r} in the config") from None


def close_adapters(platform) -> None:
    with _lock:
        for a in (platform.extras.pop("provider_adapters", None) or {}).values():
            a.close()
