"""The `api` resolver keeps each request's state on its own thread (functions/_edge/resolver.py), so the
local server can run requests concurrently: two requests inside their routes at once each read their
own event, caller and route arguments, through the app and through an included Router."""
from __future__ import annotations

import json
import threading

from aws_lambda_powertools.event_handler.router import APIGatewayRouter

from aivedio_tools.local import apigw
from aivedio_tools.local.lambda_context import FakeLambdaContext
from functions._edge.resolver import ThreadLocalRestResolver

N = 6


def _app(barrier: threading.Barrier) -> ThreadLocalRestResolver:
    app = ThreadLocalRestResolver(enable_validation=True)
    router = APIGatewayRouter()

    @router.get("/who/<name>")
    def who(name: str, n: int = 0):
        seen = (router.current_event.path, router.context.get("caller"), app.current_event.query_string_parameters)
        barrier.wait()  # every request is inside its route now, each having set its own state
        again = (router.current_event.path, router.context.get("caller"), app.current_event.query_string_parameters)
        return {"name": name, "n": n, "seen": list(seen), "again": list(again),
                "request_id": router.lambda_context.aws_request_id}

    app.include_router(router)
    app.freeze()
    return app


def _call(app: ThreadLocalRestResolver, i: int, out: dict) -> None:
    ctx = FakeLambdaContext("api")
    app.start_request()
    app.append_context(caller=f"caller-{i}")  # what auth.gate does before resolve
    event = apigw.to_event("GET", f"/who/t{i}", f"n={i}", [], b"", source_ip="127.0.0.1")
    r = app.resolve(event, ctx)
    out[i] = (r["statusCode"], json.loads(r["body"]), ctx.aws_request_id)


def test_concurrent_requests_each_read_their_own_event_caller_and_context():
    barrier = threading.Barrier(N, timeout=5)
    app = _app(barrier)
    out: dict = {}
    threads = [threading.Thread(target=_call, args=(app, i, out)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(out) == list(range(N))
    for i, (status, body, request_id) in out.items():
        mine = [f"/who/t{i}", f"caller-{i}", {"n": str(i)}]
        assert status == 200, body
        assert (body["name"], body["n"], body["seen"], body["again"], body["request_id"]) == (f"t{i}", i, mine, mine, request_id)


def test_a_thread_starts_each_request_without_the_last_ones_context():
    app = _app(threading.Barrier(1))
    out: dict = {}
    _call(app, 1, out)
    app.start_request()
    assert app.context == {} and app.current_event is None
    # And the context is cleared after a request anyway, as Powertools does.
    _call(app, 2, out)
    assert "caller" not in app.context


def test_freeze_builds_every_route_middleware_stack_before_any_request():
    app = _app(threading.Barrier(1))
    assert all(r._middleware_stack_built for r in app._static_routes + app._dynamic_routes)
