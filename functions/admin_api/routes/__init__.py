"""Admin API route modules: each exposes `router = Router()` and is listed in handler.ROUTE_MODULES."""
