"""Redis holds speed only: rate limits, active-tenant rings and capacity mirrors, all rebuildable
from PostgreSQL. Every key carries the configured prefix, so tests and tenants never collide."""
from aivedio.cache.client import Cache, CacheUnavailable

__all__ = ["Cache", "CacheUnavailable"]
