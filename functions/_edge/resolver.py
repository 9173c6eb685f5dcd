"""The API's resolver: Powertools' APIGatewayRestResolver with its per-request state kept per thread.

The stock resolver keeps the request it is answering in shared places: the current event and Lambda
context on BaseRouter's class attributes, the routing context (where auth.gate puts the caller) and
the middleware frames on the app object. In Lambda an environment runs one invocation at a time, so
that is harmless there. The local server (aivedio_tools.local.http_server) runs each request on a thread of
its own, as concurrent Lambda environments would; with the stock resolver two requests would read
each other's event and caller, which is why that server used to serialise every invocation, and one
slow input probe held up every other request. Here each thread has its own state, as Powertools' own
HttpResolverLocal does for ASGI requests.

Powertools also builds a route's middleware stack on the route's first call, without a lock; two
first calls at once would wrap it twice. freeze() builds every stack once, before any request."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from aws_lambda_powertools.event_handler import APIGatewayRestResolver, Response, content_types
from aws_lambda_powertools.utilities.data_classes.common import BaseProxyEvent

from aivedio.observability import logger
from aivedio.outbox import waking_relay


@dataclass
class _RequestState:
    event: BaseProxyEvent | None = None
    lambda_context: Any = None
    context: dict = field(default_factory=dict)
    processed_stack_frames: list[str] = field(default_factory=list)


class ThreadLocalRestResolver(APIGatewayRestResolver):
    def __init__(self, **kwargs: Any):
        self._local = threading.local()
        self._initial_context: dict = {}  # what routers added before the first request (freeze)
        super().__init__(**kwargs)

    @property
    def _state(self) -> _RequestState:
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _RequestState(context=dict(self._initial_context))
        return state

    def start_request(self) -> None:
        """A fresh state for this thread: call it first thing in each invocation, before the gate
        puts the caller into the context, so nothing of this thread's last request carries over."""
        self._local.state = _RequestState(context=dict(self._initial_context))

    # Powertools declares these as plain attributes; as properties every thread reads its own.
    @property
    def current_event(self) -> BaseProxyEvent:
        return self._state.event  # type: ignore[return-value]

    @current_event.setter
    def current_event(self, value: BaseProxyEvent) -> None:
        self._state.event = value

    @property
    def lambda_context(self) -> Any:
        return self._state.lambda_context

    @lambda_context.setter
    def lambda_context(self, value: Any) -> None:
        self._state.lambda_context = value

    @property
    def context(self) -> dict:
        return self._state.context

    @context.setter
    def context(self, value: dict) -> None:
        self._state.context = value

    @property
    def processed_stack_frames(self) -> list[str]:
        return self._state.processed_stack_frames

    @processed_stack_frames.setter
    def processed_stack_frames(self, value: list[str]) -> None:
        self._state.processed_stack_frames = value

    def resolve(self, event: Any, context: Any) -> dict[str, Any]:
        # The base class stores the event on BaseRouter's class attributes, which every thread shares;
        # this thread's copy is what the routes, middlewares and error handlers read.
        raw = event.raw_event if isinstance(event, BaseProxyEvent) else event
        self._state.event = self._to_proxy_event(raw)
        self._state.lambda_context = context
        return super().resolve(event, context)

    def freeze(self) -> None:
        """Call once all routes are registered: builds each route's middleware stack now, and keeps
        the routers' context as every thread's starting context."""
        self._initial_context = dict(self.context)
        for route in self._static_routes + self._dynamic_routes:
            if not route._middleware_stack_built:
                route._build_middleware_stack(router_middlewares=self._router_middlewares, app=self)

    def add_openapi_route(self, path: str, mark: Any = None) -> None:
        """GET `path` answers the OpenAPI document, built once: routes are fixed after import.
        `mark` decorates the route function first (the admin API marks it public)."""
        built: list[str] = []

        def openapi_json():  # no return annotation: validation would try to model Response
            if not built:
                built.append(self.get_openapi_json_schema())
            return Response(status_code=200, content_type=content_types.APPLICATION_JSON, body=built[0])

        self.get(path, include_in_schema=False)(mark(openapi_json) if mark else openapi_json)

    def handle(self, event: dict, context: Any, gate: Any) -> dict[str, Any]:
        """One invocation: a fresh per-thread state, this request's log keys, the gate (None lets the
        request through), then the routes, with the outbox relay woken for what they wrote."""
        self.start_request()
        # The Lambda decorator's keys are process-wide; these are this thread's, so a log line names
        # its own request when the local server runs several at once.
        logger.thread_safe_append_keys(correlation_id=(event.get("requestContext") or {}).get("requestId"),
                                       function_request_id=getattr(context, "aws_request_id", None))
        refused = gate(self, event)
        if refused is not None:
            return refused
        with waking_relay():  # an admission's TaskQueued, a webhook's terminal event, a redrive: relayed now
            return self.resolve(event, context)
