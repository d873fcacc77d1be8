"""schemathesis over the app's own OpenAPI schema: no input makes Turnstile answer 5xx."""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.unit.conftest import MakeApp

# Examples per operation: enough to cover each body and path shape, bounded for CI.
EXAMPLES_PER_OPERATION = 40


def test_no_input_gives_a_server_error(make_app: MakeApp, live: Any) -> None:
    server = live(make_app().app)
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    tried: dict[str, int] = {}
    for result in schema.get_all_operations():
        _fuzz(result.ok(), tried)  # type: ignore[union-attr]
    assert len(tried) >= 15, sorted(tried)
    assert sum(tried.values()) >= 15 * 10
    print(f"schemathesis: {sum(tried.values())} cases over {len(tried)} operations, no 5xx")


def _fuzz(operation: Any, tried: dict[str, int]) -> None:
    label = operation.label

    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy())
    def check(case: Any) -> None:
        tried[label] = tried.get(label, 0) + 1
        case.call_and_validate(checks=[not_a_server_error])

    check()
