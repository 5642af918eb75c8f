"""Property: for random JSON schemas (hypothesis), every output of a random model parses as
JSON and validates against its schema, and every token it emitted was one the grammar
allowed. The schemas are bounded (string patterns, integer ranges, enums, short arrays, no
free whitespace) so every path through the grammar ends well within max_tokens."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec import LLM, SamplingParams
from specdec.structured_output import StructuredOutputsParams

NAMES = st.sampled_from(["a", "id", "name", "x", "value", "flag"])
LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 500)),
    st.builds(lambda n: {"type": "string", "pattern": f"^[a-z]{{0,{n}}}$"}, st.integers(0, 4)),
    st.builds(lambda vals: {"enum": vals}, st.lists(st.sampled_from(["on", "off", 1, 2, None, True]), min_size=1,
                                                    max_size=3, unique=True)),
    st.just({"type": "null"}),
)


def objects(children):
    return st.builds(
        lambda props, nreq: {"type": "object", "properties": props, "required": sorted(props)[:nreq],
                             "additionalProperties": False},
        st.dictionaries(NAMES, children, min_size=1, max_size=3), st.integers(0, 3))


SCHEMAS = st.recursive(LEAVES, lambda children: st.one_of(
    objects(children),
    st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 2))),
    max_leaves=5).filter(lambda s: s.get("type") in ("object", "array"))


def validate(value, schema) -> None:
    """A validator for exactly the schema subset generated above."""
    if "enum" in schema:
        assert any(value == v and type(value) is type(v) for v in schema["enum"]), (value, schema)
        return
    kind = schema["type"]
    if kind == "boolean":
        assert isinstance(value, bool)
    elif kind == "null":
        assert value is None
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema["minimum"] <= value <= schema["maximum"]
    elif kind == "string":
        import re

        assert isinstance(value, str) and re.fullmatch(schema["pattern"][1:-1], value)
    elif kind == "array":
        assert isinstance(value, list) and len(value) <= schema["maxItems"]
        for item in value:
            validate(item, schema["items"])
    else:
        assert isinstance(value, dict) and set(value) <= set(schema["properties"])
        assert set(schema["required"]) <= set(value)
        for key, item in value.items():
            validate(item, schema["properties"][key])


@pytest.fixture(scope="module")
def llm(llama_path, noisy_draft_path):
    return LLM(model=llama_path, dtype="float32", device="cpu", max_model_len=512,
               speculative_config={"method": "draft_model", "model": noisy_draft_path, "num_speculative_tokens": 3})


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(SCHEMAS, min_size=2, max_size=2), temperature=st.sampled_from([0.0, 1.0]))
def test_random_schemas_always_give_valid_json(llm, prompts, schemas, temperature):
    import xgrammar as xgr

    constraints = [StructuredOutputsParams(json=s, disable_any_whitespace=True) for s in schemas]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=400, structured_outputs=c)
              for i, c in enumerate(constraints)]
    outs = llm.generate(prompts[:len(params)], params, use_tqdm=False)
    for out, schema, c in zip(outs, schemas, constraints):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (schema, o.text)
        validate(json.loads(o.text), schema)
        matcher = xgr.GrammarMatcher(llm.engine.compile_grammar(c))
        assert all(matcher.accept_token(t) for t in o.token_ids), (schema, o.token_ids)
    engine = llm.engine
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
