"""Fuzz the HTTP API from its own OpenAPI schema (schemathesis, valid and invalid inputs): no input may produce a 5xx."""
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings, strategies as st

from server_helpers import MODEL, LiveServer, tiny_config

EXAMPLES = 60  # per operation: bounded so the whole file stays around half a minute


@pytest.fixture(scope="module")
def fuzzed(tiny_llama):
    # a short context keeps every accepted request (max_tokens <= 64) quick on the tiny model
    with LiveServer(tiny_config(tiny_llama, drafter="eagle", draft_vocab_size=200, max_model_len=64, max_queue=8)) as live:
        yield live


def test_no_input_gives_a_5xx(fuzzed):
    schema = schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")
    failures, statuses = [], {}
    for operation in schema.get_all_operations():
        op = operation.ok()

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=st.one_of(op.as_strategy(schemathesis.GenerationMode.POSITIVE), op.as_strategy(schemathesis.GenerationMode.NEGATIVE)))
        def run(case):
            if isinstance(case.body, dict) and isinstance(case.body.get("model"), str) and len(case.body["model"]) % 2 == 0:
                case.body["model"] = MODEL  # half the cases name the served model, so they get past the model check
            response = case.call(base_url=fuzzed.url, timeout=60)
            statuses.setdefault(op.label, set()).add(response.status_code)
            if response.status_code >= 500:
                failures.append((op.label, case.body, response.status_code, response.text[:200]))

        run()
    assert not failures, failures[:5]
    print(statuses)
    for label in ("POST /v1/completions", "POST /v1/chat/completions"):  # the fuzzer reached both sides of validation
        assert 200 in statuses[label] and 400 in statuses[label], statuses
    assert fuzzed.runtime.loop.alive and fuzzed.runtime.loop.steps_failed == 0
