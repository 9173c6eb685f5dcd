"""The `api` Lambda behind API Gateway (REST, proxy integration). Locally `aivedio serve` feeds
this same handler through aivedio_tools.local.http_server. Routes live in functions/api/routes/*.py."""
from __future__ import annotations

from aws_lambda_powertools.event_handler.openapi.models import HTTPBearer
from aws_lambda_powertools.logging import correlation_paths

from aivedio import __version__
from aivedio.observability import logger
from functions._edge import errors
from functions._edge.resolver import ThreadLocalRestResolver
from functions.api.routes import auth, generations, health, media, providers, wallet

# Per-request state per thread: the local server runs requests concurrently (functions/_edge/resolver.py).
app = ThreadLocalRestResolver(enable_validation=True)
app.configure_openapi(
    title="AiVedio API",
    version=__version__,
    description="Multi-tenant AI video generation control plane. Errors: {error, message, details}.",
    security_schemes={"bearerAuth": HTTPBearer(description="Authorization: Bearer <api_key>")},
)
errors.install(app)

for _router in (health.router, generations.router, wallet.router, providers.router, media.router):
    app.include_router(_router)

app.enable_swagger(path="/swagger")

app.add_openapi_route("/openapi.json")
app.freeze()


@logger.inject_lambda_context(correlation_id_path=correlation_paths.API_GATEWAY_REST, clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    return app.handle(event, context, auth.gate)
