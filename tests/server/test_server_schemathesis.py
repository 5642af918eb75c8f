"""Schema-driven fuzzing: schemathesis builds requests from /openapi.json (positive: bodies the
schema allows; negative: bodies it forbids) and sends them to the in-process app. No answer may
be a 5xx; every status, content type, body and stream chunk must be the one the schema declares
(negative bodies must be refused with a 4xx); every byte must be strict JSON. A few examples per
operation here; ``python -m specdec.server.fuzz schemathesis --examples 150`` is the long run."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from specdec.server.fuzz import strict_json_check

NUM_EXAMPLES = 25  # per operation and mode

schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture
def api_schema(asgi_app):
    s = schemathesis.openapi.from_asgi("/openapi.json", asgi_app)
    s.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=NUM_EXAMPLES,
                               deterministic=True, database="none")
    return s


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=NUM_EXAMPLES)
def test_schema_fuzz_never_5xx_and_answers_match_the_schema(case):
    if case.method == "POST" and isinstance(case.body, dict):
        case.headers = {**(case.headers or {}), "Content-Type": "application/json"}
    case.call_and_validate(excluded_checks=[positive_data_acceptance], additional_checks=[strict_json_check])
