"""functions/_edge/errors.py gives every failure the contract's shape {error, message, details}."""
import json
from typing import Annotated

import pytest
from aws_lambda_powertools.event_handler import APIGatewayRestResolver
from aws_lambda_powertools.event_handler.openapi.params import Header, Query
from pydantic import BaseModel, Field

from aivedio.errors import DomainError, NotFound
from aivedio_tools.local.apigw import from_response, to_event
from aivedio_tools.local.lambda_context import FakeLambdaContext
from functions._edge import errors


class Body(BaseModel):
    model: str
    duration_seconds: int = Field(gt=0, le=60)
    inputs: list[dict[str, str]] = []


class Quota(DomainError):
    code = "TEST_QUOTA_EXCEEDED"


app = APIGatewayRestResolver(enable_validation=True)
errors.install(app)
errors.register_status({"TEST_QUOTA_EXCEEDED": 429})


@app.post("/things")
def create(body: Body, idem: Annotated[str, Header(alias="Idempotency-Key", min_length=1)], limit: Annotated[int, Query(ge=1)] = 10) -> dict:
    return {"ok": True}


@app.get("/boom")
def boom():
    raise RuntimeError("secret internals")


@app.get("/gone")
def gone():
    raise NotFound("task not found")


@app.get("/quota")
def quota():
    raise Quota("slow down", details={"retry_after_seconds": 3})


@app.get("/unmapped")
def unmapped():
    raise DomainError("no", code="SOMETHING_NEW")


@app.get("/rejected")
def rejected():
    raise errors.ApiError(429, "REJECTED", "too many", headers={"Retry-After": "7"},
                          extra={"decision": "REJECT_USER_RATE_LIMIT", "retry_after_seconds": 7})


def call(method, path, body=b"", query="", headers=(("Content-Type", "application/json"), ("Idempotency-Key", "k1"))):
    out = from_response(app.resolve(to_event(method, path, query, list(headers), body), FakeLambdaContext("t")))
    return out.status, json.loads(out.body), out


def assert_shape(doc):
    assert set(doc) >= {"error", "message", "details"}
    assert isinstance(doc["message"], str) and isinstance(doc["details"], dict)


def test_body_validation_names_each_field_by_path():
    status, doc, _ = call("POST", "/things", json.dumps({"duration_seconds": 0, "inputs": [{"url": 3}]}).encode())
    assert status == 422
    assert_shape(doc)
    assert doc["error"] == "VALIDATION_ERROR"
    assert set(doc["details"]["fields"]) == {"body.model", "body.duration_seconds", "body.inputs.0.url"}
    assert all(doc["details"]["fields"].values())  # each path with its message
    assert {e["field"] for e in doc["details"]["errors"]} == set(doc["details"]["fields"])


def test_query_and_header_validation():
    status, doc, _ = call("POST", "/things", json.dumps({"model": "m", "duration_seconds": 5}).encode(),
                          query="limit=0", headers=[("Content-Type", "application/json")])
    assert status == 422
    fields = doc["details"]["fields"]
    assert "query.limit" in fields
    assert any(f.startswith("header.") for f in fields)


def test_invalid_json_is_a_422_on_body():
    status, doc, _ = call("POST", "/things", b"{not json")
    assert status == 422 and list(doc["details"]["fields"]) == ["body"]


def test_valid_request_passes():
    status, doc, _ = call("POST", "/things", json.dumps({"model": "m", "duration_seconds": 5}).encode())
    assert (status, doc) == (200, {"ok": True})


def test_unknown_route_and_wrong_method_are_404():
    for method, path in (("GET", "/nowhere"), ("DELETE", "/boom")):
        status, doc, _ = call(method, path)
        assert status == 404 and doc["error"] == "NOT_FOUND"
        assert_shape(doc)


def test_unexpected_exception_is_500_without_internals():
    status, doc, out = call("GET", "/boom")
    assert status == 500 and doc["error"] == "INTERNAL"
    assert "secret" not in out.body.decode()
    assert doc["details"]["request_id"]


@pytest.mark.parametrize("path,status,code", [("/gone", 404, "NOT_FOUND"), ("/quota", 429, "TEST_QUOTA_EXCEEDED"),
                                              ("/unmapped", 400, "SOMETHING_NEW")])
def test_domain_errors_map_through_the_status_table(path, status, code):
    got, doc, _ = call("GET", path)
    assert (got, doc["error"]) == (status, code)
    assert_shape(doc)
    if path == "/quota":
        assert doc["details"] == {"retry_after_seconds": 3}


def test_api_error_carries_extra_fields_and_headers():
    status, doc, out = call("GET", "/rejected")
    assert status == 429
    assert doc["error"] == "REJECTED" and doc["decision"] == "REJECT_USER_RATE_LIMIT" and doc["retry_after_seconds"] == 7
    assert out.header("Retry-After") == "7"


def test_header_fields_are_named_in_their_canonical_spelling():
    status, doc, _ = call("POST", "/things", json.dumps({"model": "m", "duration_seconds": 5}).encode(),
                          headers=[("Content-Type", "application/json")])
    assert status == 422
    assert list(doc["details"]["fields"]) == ["header.Idempotency-Key"]
    assert errors.field_path(("header", "x-request-id")) == "header.X-Request-Id"


@app.get("/invalid")
def invalid():
    from aivedio.errors import InvalidRequest

    raise InvalidRequest("bad cursor", {"query.cursor": "not a cursor this API returned"})


@app.get("/reused")
def reused():
    raise DomainError("used with another body", code="TEST_KEY_REUSED")


errors.register_status(TEST_KEY_REUSED=422)


@pytest.mark.parametrize("path, fields", [("/invalid", {"query.cursor": "not a cursor this API returned"}), ("/reused", {})])
def test_every_422_has_fields_and_errors(path, fields):
    status, doc, _ = call("GET", path)
    assert status == 422
    assert doc["details"]["fields"] == fields
    assert [e["field"] for e in doc["details"]["errors"]] == list(fields)
