"""The API's key cache (aivedio.auth): a key that authenticated is remembered for
limits.api_key_cache_seconds, so a request costs no round trip for its authentication; a key
revoked in this process stops at once, one revoked elsewhere (another API process) within the TTL."""
from __future__ import annotations

import time

from aivedio import auth
from aivedio.admin import operators
from aivedio.admin.api_keys import revoke_api_key
from tests.admission_support import new_tenant
from tests.integration.test_admin_api import tenant_call


def _cache_for(platform, monkeypatch, seconds: float) -> None:
    limits = platform.config.limits.model_copy(update={"api_key_cache_seconds": seconds})
    monkeypatch.setattr(platform, "config", platform.config.model_copy(update={"limits": limits}))


def _key_id(platform, secret: str):
    return platform.db.fetchone("select key_id from api_key where key_hash = %s", (auth.hash_key(secret),))["key_id"]


def test_a_key_revoked_elsewhere_stops_within_the_ttl(platform, monkeypatch):
    _cache_for(platform, monkeypatch, 0.5)
    t = new_tenant(platform)
    assert tenant_call("GET", "/v1/wallet", t.api_key)[0] == 200
    # Another process revokes it (a plain UPDATE: nothing tells this process).
    platform.db.transaction(lambda c: c.execute("update api_key set revoked_at = now() where key_id = %s",
                                                (_key_id(platform, t.api_key),)))
    assert tenant_call("GET", "/v1/wallet", t.api_key)[0] == 200  # remembered, no database read
    time.sleep(0.6)
    status, body = tenant_call("GET", "/v1/wallet", t.api_key)
    assert status == 401 and body["error"] == "UNAUTHENTICATED"


def test_a_key_revoked_here_stops_at_once(platform, monkeypatch):
    _cache_for(platform, monkeypatch, 30)
    t = new_tenant(platform)
    admin = platform.db.transaction(lambda c: operators.create_operator(c, actor="test", name="key-admin", role="admin"))
    assert tenant_call("GET", "/v1/wallet", t.api_key)[0] == 200
    assert auth.cached_caller(f"Bearer {t.api_key}", 30) is not None
    key_id = _key_id(platform, t.api_key)
    platform.db.transaction(lambda c: revoke_api_key(c, operator=f"op:{admin.name}", key_id=key_id,
                                                     now=platform.clock.now(), tenant_id=t.tenant_id))
    assert auth.cached_caller(f"Bearer {t.api_key}", 30) is None
    assert tenant_call("GET", "/v1/wallet", t.api_key)[0] == 401


def test_no_cache_reads_every_request(platform, monkeypatch):
    _cache_for(platform, monkeypatch, 0)
    t = new_tenant(platform)
    assert tenant_call("GET", "/v1/wallet", t.api_key)[0] == 200
    assert auth.cached_caller(f"Bearer {t.api_key}", 0) is None
    platform.db.transaction(lambda c: c.execute("update api_key set revoked_at = now() where key_id = %s",
                                                (_key_id(platform, t.api_key),)))
    assert tenant_call("GET", "/v1/wallet", t.api_key)[0] == 401
