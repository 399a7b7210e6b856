"""Schema-driven fuzzing of the whole HTTP API (schemathesis over our own OpenAPI): bad input is a
4xx naming the problem, never a 500. Bounded so CI runs it on every change; set
``TANGRAM_FUZZ_EXAMPLES`` for a longer hunt."""

from __future__ import annotations

import os
import shutil

import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")

from arl_tangram.runtime.local import LocalRuntime  # noqa: E402
from arl_tangram.server.app import create_app  # noqa: E402
from arl_tangram.server.service import Service  # noqa: E402

from servers import Server  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

EXAMPLES = int(os.environ.get("TANGRAM_FUZZ_EXAMPLES", "6"))

# The schema comes from the app itself (nothing is started to build it); requests go to a real server.
schema = schemathesis.openapi.from_dict(create_app(Service(LocalRuntime())).openapi())


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("fuzz"))
    yield s
    s.stop()


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_operation_answers_a_server_error(case, live):
    response = case.call(base_url=live.url, timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.status_code, response.text)
    if response.status_code >= 400:  # ours name the problem; routing 404/405 have FastAPI's (SandboxFusion's) body
        body = response.json()
        # a path the model protocols' routes take (GET /v1/models/{name:path}) answers in OpenAI's
        # shape, {"error": {"message", ...}}: a message naming the problem all the same
        named = "message" in body or (isinstance(body.get("error"), dict) and bool(body["error"].get("message")))
        assert named or (response.status_code in (404, 405) and "detail" in body), response.text
