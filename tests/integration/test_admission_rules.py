"""Request rules of the tenant API (docs/tenant-api.md), through the real `api` handler behind
the local HTTP server, each refusal writing nothing:

- a prompt is required and not blank: empty, whitespace-only or missing is a 422 naming body.prompt,
  for a generation and for a quote alike;
- POST /v1/quotes spends the same user and tenant submit rate limits as POST /v1/generations, and is
  refused with the same 429 codes and Retry-After;
- input media is fetched only for a mode that uses it: text_to_video takes no inputs (422 naming
  body.inputs, and the media server sees no request), image_to_video fetches its image."""
from __future__ import annotations

import functools
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from aivedio.config import Limits, PlatformConfig
from tests.admission_support import BODY, CONTRACT_STATUS, accepted, footprint, new_tenant, second_user, serve
from tests.integration.test_idempotency_contract import _png

_ = serve  # a fixture, imported for the tests that request it


def assert_field_refused(r, field: str, conn, tenant_id, before) -> dict:
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"] == "VALIDATION_ERROR" and field in body["details"]["fields"], body
    assert footprint(conn, tenant_id) == before
    return body


# --- the prompt ----------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["", " ", "   \t\n ", "\u3000\u00a0", ...], ids=["empty", "space", "whitespace",
                                                                                    "unicode-space", "missing"])
def test_a_blank_or_missing_prompt_is_422_naming_body_prompt(platform, conn, serve, prompt):
    api = serve(platform)
    t = new_tenant(platform)
    body = {k: v for k, v in BODY.items() if k != "prompt"} if prompt is ... else {**BODY, "prompt": prompt}
    before = footprint(conn, t.tenant_id)
    assert_field_refused(api.submit(t, body), "body.prompt", conn, t.tenant_id, before)
    assert_field_refused(api.quote(t, body), "body.prompt", conn, t.tenant_id, before)
    # Words with whitespace around them are a prompt.
    accepted(api.submit(t, {**BODY, "prompt": "  a fox  "}))


def test_the_openapi_document_says_the_prompt_is_required(platform, serve):
    api = serve(platform)
    doc = api.http.get("/openapi.json").json()
    schema = doc["components"]["schemas"]["GenerationRequest"]
    assert "prompt" in schema["required"] and schema["properties"]["prompt"]["minLength"] == 1


# --- quotes and the submit rate limits ------------------------------------------------------------

def _assert_rate_limited(r, decision: str, conn, tenant_id, before) -> None:
    assert r.status_code == CONTRACT_STATUS[decision] == 429, r.text
    body = r.json()
    assert body["error"] == "REJECTED" and body["decision"] == decision, body
    assert body["retry_after_seconds"] >= 1 and r.headers["Retry-After"] == str(body["retry_after_seconds"])
    assert footprint(conn, tenant_id) == before


def test_quotes_spend_the_user_submit_rate_limit(platform, conn, serve):
    api = serve(platform)
    t = new_tenant(platform, user_submit_rate_per_minute=2)
    for _ in range(2):
        assert api.quote(t).status_code == 200
    before = footprint(conn, t.tenant_id)
    _assert_rate_limited(api.quote(t), "REJECT_USER_RATE_LIMIT", conn, t.tenant_id, before)
    # One budget for both: the quotes spent it, so a submission is refused too.
    _assert_rate_limited(api.submit(t), "REJECT_USER_RATE_LIMIT", conn, t.tenant_id, before)
    # The limit is the user's: another user of the tenant still gets a quote.
    assert api.quote(second_user(platform, t)).status_code == 200


def test_quotes_spend_the_tenant_submit_rate_limit(platform, conn, serve):
    api = serve(platform)
    t = new_tenant(platform, tenant_submit_rate_per_minute=2)
    other = second_user(platform, t)
    accepted(api.submit(t))  # a submission and a quote draw on the same tenant budget
    assert api.quote(other).status_code == 200
    before = footprint(conn, t.tenant_id)
    _assert_rate_limited(api.quote(t), "REJECT_TENANT_RATE_LIMIT", conn, t.tenant_id, before)
    _assert_rate_limited(api.quote(other), "REJECT_TENANT_RATE_LIMIT", conn, t.tenant_id, before)
    assert api.quote(new_tenant(platform)).status_code == 200  # another tenant is untouched


def test_the_openapi_document_lists_429_for_quotes(platform, serve):
    api = serve(platform)
    doc = api.http.get("/openapi.json").json()
    assert "429" in doc["paths"]["/v1/quotes"]["post"]["responses"]


# --- inputs only where the mode uses them ---------------------------------------------------------

@pytest.fixture
def counted_media(tmp_path):
    """A local media server that counts the requests it gets."""
    _png(tmp_path / "still.png")
    hits: list[str] = []

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            hits.append(self.path)
            super().do_GET()

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/still.png", hits
    server.shutdown()
    server.server_close()


def test_text_to_video_takes_no_inputs_and_fetches_none(make_platform, conn, serve, counted_media):
    url, hits = counted_media
    p = make_platform(PlatformConfig(limits=Limits(probe_allowed_private_hosts=["127.0.0.1"])))
    api = serve(p)
    t = new_tenant(p)
    before = footprint(conn, t.tenant_id)
    with_input = {**BODY, "inputs": [{"url": url, "kind": "image"}]}
    got = assert_field_refused(api.submit(t, with_input), "body.inputs", conn, t.tenant_id, before)
    assert "text_to_video" in got["details"]["fields"]["body.inputs"]
    assert_field_refused(api.quote(t, with_input), "body.inputs", conn, t.tenant_id, before)
    assert hits == []  # nothing was fetched for a mode that would not use it
    # The mode that uses an image fetches it (once) and is admitted with it.
    task = accepted(api.submit(t, {**with_input, "mode": "image_to_video"}))
    assert hits == ["/still.png"]
    row = conn.execute("select mode, inputs from generation_task where task_id = %s", (task["task_id"],)).fetchone()
    assert row["mode"] == "image_to_video" and row["inputs"] == [{"url": url, "kind": "image"}]
    # And text_to_video without inputs is admitted without any fetch.
    accepted(api.submit(t))
    assert hits == ["/still.png"]
