"""Schemathesis over /openapi.json of the real `api` handler behind a LocalRuntime (real PostgreSQL
and Redis): generated and mutated requests to every operation, authenticated with a real tenant key.
Nothing may answer 5xx, and every answer must be a documented status whose body matches its schema.

Positive and negative generation both run. Input media URLs that schemathesis invents are pointed at
a local server (a real PNG, a real MP4, a text file, a 404), so probing stays real without the
network. The tenant's limits are generous, but its credits and the EXPENSIVE lane are not endless,
so rejections (402, 403, 429) happen too and are validated against their documented schema."""
from __future__ import annotations

import collections
import functools
import json
import os
import re
import threading
import uuid
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import av
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from aivedio.admin.tenants import create_tenant
from aivedio.admission.models import InputRef
from aivedio.config import Limits, PlatformConfig, Settings
from aivedio.context import build_platform
from aivedio_tools.local.runtime import LocalRuntime

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]
MAX_EXAMPLES = int(os.environ.get("AIVEDIO_FUZZ_EXAMPLES", "50"))  # per operation; raise it for a deeper local run
SIZE = 32
URL_PATTERN = re.compile(InputRef.model_json_schema()["properties"]["url"]["pattern"])
STATUSES: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


# --- media the probe can fetch ---------------------------------------------------------------------

def _frame(shade: int) -> av.VideoFrame:
    f = av.VideoFrame(SIZE, SIZE, "rgb24")
    plane = f.planes[0]
    plane.update((bytes([shade, 255 - shade, 90]) * (plane.buffer_size // 3 + 1))[: plane.buffer_size])
    return f


def _encode(path: Path, codec: str, frames: int, fmt: str | None = None) -> Path:
    with av.open(str(path), "w", format=fmt) as c:
        s = c.add_stream(codec, rate=10 if frames > 1 else 1)
        s.width = s.height = SIZE
        s.pix_fmt = "rgb24" if codec == "png" else "yuv420p"
        for i in range(frames):
            for packet in s.encode(_frame((i * 7) % 255)):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return path


def _encode_wav(path: Path, seconds: int = 1, rate: int = 8000) -> Path:
    with av.open(str(path), "w") as c:
        s = c.add_stream("pcm_s16le", rate=rate)
        s.layout = "mono"
        for i in range(seconds * 8):
            f = av.AudioFrame(format="s16", layout="mono", samples=rate // 8)
            f.sample_rate, f.pts = rate, i * (rate // 8)
            f.planes[0].update(bytes(f.planes[0].buffer_size))  # silence
            for packet in s.encode(f):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return path


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-media")
    _encode(root / "still.png", "png", 1, fmt="image2")
    _encode(root / "clip.mp4", "mpeg4", 10)
    _encode_wav(root / "tone.wav")
    (root / "notes.txt").write_text("not media\n" * 10)
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    yield {"image": f"{base}/still.png", "video": f"{base}/clip.mp4", "audio": f"{base}/tone.wav",
           "text": f"{base}/notes.txt", "missing": f"{base}/missing.mp4"}
    server.shutdown()
    server.server_close()


def _local_inputs(body, media: dict, n: int) -> None:
    """Point every well-formed input URL at local media: mostly the declared kind, sometimes a file
    that is not media, a 404 or the other kind. A malformed URL stays malformed."""
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list):
        return
    for i, item in enumerate(body["inputs"]):
        if isinstance(item, dict) and isinstance(item.get("url"), str) and URL_PATTERN.match(item["url"]):
            kind = item.get("kind") if item.get("kind") in ("image", "video", "audio") else "image"
            choice = (n + i) % 8
            item["url"] = {5: media["text"], 6: media["missing"], 7: media["video" if kind == "image" else "image"]}.get(choice, media[kind])


# --- the platform under test ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_platform(db_url, redis_url):
    from tests.conftest import TEST_HOME, drop_redis_prefix

    prefix = f"t{uuid.uuid4().hex[:10]}"
    p = build_platform(Settings(database_url=db_url, redis_url=redis_url, redis_prefix=prefix, home=TEST_HOME),
                       PlatformConfig(limits=Limits(probe_allowed_private_hosts=["127.0.0.1"])))  # the local media server
    yield p
    p.close()
    drop_redis_prefix(redis_url, prefix)


@pytest.fixture(scope="module")
def runtime(fuzz_platform):
    rt = LocalRuntime(fuzz_platform, port=0, loops=[]).start()
    yield rt
    rt.stop()


GENEROUS = dict(user_submit_rate_per_minute=100_000, tenant_submit_rate_per_minute=100_000, cancel_rate_per_minute=100_000,
                max_user_queued_tasks=100_000, max_user_queued_units=1_000_000, max_queued_tasks=100_000,
                max_queued_units=1_000_000, max_cost_per_minute=10**9, max_cost_per_day=10**10, max_wait_seconds=86_400)


@pytest.fixture(scope="module")
def tenant(runtime):
    """High rate and queue limits, so admission is not all that gets exercised; credit for a dozen or
    so tasks, not for every generated one (402 later on)."""
    return create_tenant(runtime.platform, name=f"fuzz-{uuid.uuid4().hex[:8]}", service_class="PAID_SHARED", weight=10,
                         credits=3_000, policy_overrides=GENEROUS)


@pytest.fixture(scope="module")
def restricted(runtime):
    """Every fourth call comes from a tenant whose contract excludes EXPENSIVE work (403), whose user
    may submit only a dozen times a minute (429) and who has no credit (402). It sees none of the
    other tenant's tasks (404)."""
    return create_tenant(runtime.platform, name=f"fuzz-r-{uuid.uuid4().hex[:8]}", service_class="STANDARD", weight=1,
                         credits=0, policy_overrides={**GENEROUS, "user_submit_rate_per_minute": 12})


@pytest.fixture(scope="module")
def seeded(runtime, tenant):
    """A few real tasks, so get and cancel see ids that exist (and then terminal ones, 409)."""
    import httpx

    ids = []
    with httpx.Client(base_url=runtime.base_url, timeout=30) as c:
        for i in range(4):
            r = c.post("/v1/generations", json={"model": "video-model-x", "mode": "text_to_video", "prompt": "a seed",
                                                "duration_seconds": 3, "resolution": "480p"},
                       headers={"Authorization": f"Bearer {tenant.api_key}", "Idempotency-Key": f"seed-{i}"})
            assert r.status_code == 202, r.text
            ids.append(r.json()["task_id"])
    return ids


def _document() -> dict:
    """The document the handler serves at /openapi.json. Read from the app at import, because the
    parametrized test needs its operations at collection time (schemathesis' lazy fixture loader
    does not run under pytest 9); test_the_fuzzed_document_is_the_served_one proves it is the same."""
    from functions.api.handler import app

    return json.loads(app.get_openapi_json_schema())


DOCUMENT = _document()
# The key is only known once the tenant exists, so each call sends it (and schemathesis does not
# generate Authorization values of its own). Unknown query parameters are ignored by design, so
# schemathesis does not invent any.
CONFIG = schemathesis.Config.from_dict({
    "seed": 20260624,
    "generation": {"max-examples": MAX_EXAMPLES, "allow-extra-parameters": False, "with-security-parameters": False},
    # Schemathesis' own list of statuses that reject invalid data, and 413: a generated body over the
    # 64 KiB limit is refused before it is read, which is a rejection too.
    "checks": {"negative_data_rejection": {"expected-statuses": ["400", "401", "403", "404", "405", "406", "409", "413",
                                                                 "415", "422", "428", "429", "5xx"]}},
})
schema = schemathesis.openapi.from_dict(DOCUMENT, config=CONFIG)


def test_the_fuzzed_document_is_the_served_one(runtime):
    import httpx

    served = httpx.get(f"{runtime.base_url}/openapi.json", timeout=30)
    assert served.status_code == 200 and served.json() == DOCUMENT
    assert served.json()["openapi"].startswith("3.1")


@pytest.fixture(scope="module", autouse=True)
def report_statuses():
    """Print what the fuzzing reached (pytest -s shows it), and fail if it never got past validation:
    some generation must be accepted and some rejected by admission."""
    yield
    for label, counter in sorted(STATUSES.items()):
        print(f"\n{label}: {dict(sorted(counter.items()))}", end="")
    created = STATUSES.get("POST /v1/generations")
    if created:  # the fuzz test ran in this process
        assert any(k.startswith("202 ") for k in created), f"no generation was accepted: {dict(created)}"
        assert any(" REJECT_" in k for k in created), f"no generation was rejected by admission: {dict(created)}"


_calls = collections.Counter()


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_openapi_document(case, runtime, tenant, restricted, seeded, media):
    label = f"{case.method.upper()} {case.operation.path}"
    n = _calls[label]
    _calls[label] += 1
    positive = case.meta is None or case.meta.generation.mode == GenerationMode.POSITIVE
    if positive and case.path_parameters and "task_id" in case.path_parameters and n % 3 == 0:
        case.path_parameters["task_id"] = seeded[(n // 3) % len(seeded)]  # a real task, now and then
    if positive and isinstance(case.body, dict) and n % 4 != 3:
        case.body["model"] = "video-model-x"  # a model that exists, mostly: random strings name none
    if positive and case.headers and "Idempotency-Key" in case.headers and n % 5 != 4:
        case.headers["Idempotency-Key"] = f"fuzz-{n}-{case.headers['Idempotency-Key']}"[:255]  # mostly fresh keys
    _local_inputs(case.body, media, n)
    auth = {"Authorization": f"Bearer {(restricted if n % 4 == 1 else tenant).api_key}"}
    response = case.call(base_url=runtime.base_url, headers=auth, timeout=60)
    try:
        doc = response.json()
        code = doc.get("decision") or doc.get("error") if isinstance(doc, dict) else None
        if code in ("VALIDATION_ERROR",) and positive:
            code += ":" + ",".join(sorted(doc["details"]["fields"]))
    except Exception:
        code = None
    STATUSES[label][f"{response.status_code} {'+' if positive else '-'} {code or ''}"] += 1
    case.validate_response(response, checks=CHECKS, headers=auth)
