"""The `admin_api` Lambda behind its own API Gateway REST API (infra_cdk/admin_api.py). Locally
`aivedio serve` sends `/admin/...` and `/dashboard...` here, on the tenant API's port.

Every route sits behind access.gate (operator token, role, audit of denials). Route modules live
in functions/admin_api/routes/, one per concern, each exposing `router`."""
from __future__ import annotations

from aws_lambda_powertools.event_handler.openapi.models import HTTPBearer
from aws_lambda_powertools.logging import correlation_paths

from aivedio import __version__
from aivedio.observability import logger
from functions._edge import errors
from functions._edge.resolver import ThreadLocalRestResolver
from functions.admin_api import access
from functions.admin_api.routes import audit, capacity, dashboard, insight, lanes, operations, operators, policy, tenants, wallets

ROUTE_MODULES = (tenants, lanes, operations, operators, audit, policy, capacity, dashboard, insight, wallets)

app = ThreadLocalRestResolver(enable_validation=True)
app.configure_openapi(
    title="AiVedio admin API",
    version=__version__,
    description="The operator plane: tenants, policies, capacity, reviews, refunds. Every route needs an "
                "operator token; a role lacking the operation answers 403 and is audited. "
                "Errors: {error, message, details}.",
    security_schemes={"bearerAuth": HTTPBearer(description="Authorization: Bearer <operator token> (avop_...)")},
    security=[{"bearerAuth": []}],
)
errors.install(app)

for _module in ROUTE_MODULES:
    app.include_router(_module.router)

app.add_openapi_route(access.OPENAPI_PATH, mark=access.public)
app.freeze()


@logger.inject_lambda_context(correlation_id_path=correlation_paths.API_GATEWAY_REST, clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    return app.handle(event, context, access.gate)
