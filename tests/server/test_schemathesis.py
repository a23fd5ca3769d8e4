"""Property-based fuzzing of every operation in the server's own OpenAPI schema: no 5xx."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error

from tests.server.conftest import start_server

EXAMPLES = 10  # per operation and generation mode: the whole run stays well under a minute


@pytest.fixture(scope="module")
def fuzz_server(tiny_model, tmp_path_factory):
    server = start_server(tiny_model, tmp_path_factory.mktemp("fuzz"), "--max-context", "256", "--max-tokens", "4",
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
                case.validate_response(response, checks=[not_a_server_error])

            try:
                run()
            except Unsatisfiable:
                assert mode is schemathesis.GenerationMode.NEGATIVE  # an operation without inputs has no invalid ones
    assert len(statuses) >= len(operations) * 2  # every operation was exercised
    assert any(s == 200 for s in statuses) and any(400 <= s < 500 for s in statuses)
