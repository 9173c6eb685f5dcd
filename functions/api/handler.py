"""The `api` Lambda behind API Gateway (REST, proxy integration). Locally `aivedio serve` feeds
this same handler through aivedio.local.http_server. Routes live in functions/api/routes/*.py."""
from __future__ import annotations

from aws_lambda_powertools.event_handler import Response, content_types
from aws_lambda_powertools.event_handler.openapi.models import HTTPBearer
from aws_lambda_powertools.logging import correlation_paths

from aivedio import __version__
from aivedio.observability import logger
from aivedio.outbox import waking_relay
from functions.api import errors
from functions.api.resolver import ThreadLocalRestResolver
from functions.api.routes import auth, generations, health, providers, wallet

# Per-request state per thread: the local server runs requests concurrently (functions/api/resolver.py).
app = ThreadLocalRestResolver(enable_validation=True)
app.configure_openapi(
    title="AiVedio API",
    version=__version__,
    description="Multi-tenant AI video generation control plane. Errors: {error, message, details}.",
    security_schemes={"bearerAuth": HTTPBearer(description="Authorization: Bearer <api_key>")},
)
errors.install(app)

for _router in (health.router, generations.router, wallet.router, providers.router):
    app.include_router(_router)

app.enable_swagger(path="/swagger")

_openapi_json: str | None = None


@app.get("/openapi.json", include_in_schema=False)
def openapi_json():  # no return annotation: validation would try to model Response
    global _openapi_json
    if _openapi_json is None:  # routes are fixed after import, so the document is too
        _openapi_json = app.get_openapi_json_schema()
    return Response(status_code=200, content_type=content_types.APPLICATION_JSON, body=_openapi_json)


app.freeze()


@logger.inject_lambda_context(correlation_id_path=correlation_paths.API_GATEWAY_REST, clear_state=True)
def lambda_handler(event: dict, context) -> dict:
    app.start_request()
    # The decorator's keys are process-wide; these are this thread's, so a log line names its own
    # request when the local server runs several at once.
    logger.thread_safe_append_keys(correlation_id=(event.get("requestContext") or {}).get("requestId"),
                                   function_request_id=getattr(context, "aws_request_id", None))
    refused = auth.gate(app, event)
    if refused is not None:
        return refused
    with waking_relay():  # an admission's TaskQueued, a webhook's terminal event: relayed now
        return app.resolve(event, context)
