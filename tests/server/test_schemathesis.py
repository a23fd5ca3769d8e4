"""Property-based fuzzing of every operation in the server's own OpenAPI schema, every check
schemathesis has: no 5xx, every status and body as declared, invalid input rejected and
valid input accepted. LOCALMOE_FUZZ_EXAMPLES sets the examples per operation and mode."""

from __future__ import annotations

import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from tests.server.conftest import start_server

EXAMPLES = int(os.environ.get("LOCALMOE_FUZZ_EXAMPLES", "200"))  # per operation and generation mode


@pytest.fixture(scope="module")
def fuzz_server(tiny_model, tmp_path_factory):
    # --max-body 64 MiB: a list past its declared maxItems must reach validation (400), not the body limit (413)
    server = start_server(tiny_model, tmp_path_factory.mktemp("fuzz"), "--max-context", "256", "--max-tokens", "4",
                          "--max-body", str(64 << 20),
                          "--max-tokens-limit", "8", "--sessions", str(tmp_path_factory.mktemp("fuzzdb") / "s.db"))
    yield server
    server.stop()


def test_no_server_errors(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/messages",
                                              "/v1/models", "/health", "/metrics"}
    statuses: list[int] = []
    for operation in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case):
                response = case.call(base_url=fuzz_server.url, timeout=60)
                statuses.append(response.status_code)
                if mode is schemathesis.GenerationMode.NEGATIVE and response.status_code == 413:  # noqa: B023 - run now
                    # an invalid body past --max-body (a string far over its maxLength, say) is refused by the
                    # body limit before validation: a declared rejection, which schemathesis only counts as 4xx
                    assert response.json()["error"]["message"].startswith("the request body is larger than")
                    return
                case.validate_response(response)  # every check, positive-data acceptance included

            try:
                run()
            except Unsatisfiable:
                assert mode is schemathesis.GenerationMode.NEGATIVE  # an operation without inputs has no invalid ones
    assert len(statuses) >= len(operations) * 2  # every operation was exercised
    assert any(s == 200 for s in statuses) and any(400 <= s < 500 for s in statuses)
