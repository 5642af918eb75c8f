"""Structured output through the engine (float32, tiny random models): every output is in the
grammar's language, greedy speculative output equals non-speculative constrained output token
for token for every proposer, forced tokens change nothing but the number of target decisions,
and bad constraints are clear errors that disturb nothing."""
from __future__ import annotations

import json

import pytest

from specdec import LLM, SamplingParams
from specdec.structured_output import StructuredOutputsParams

ENGINE = dict(dtype="float32", device="cpu", max_model_len=256)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},  # xgrammar alone would admit raw control characters
    "count": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "def"]}, "maxItems": 3}},
    "required": ["name", "count", "ok", "tags"], "additionalProperties": False}
CONSTRAINTS = [
    StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    StructuredOutputsParams(regex=r"(def|class) [a-z_]{1,12}\((x|y)?\):"),
    StructuredOutputsParams(choice=["import json", "import os", "return value"]),
    StructuredOutputsParams(grammar='root ::= "[" item ("," item){0,3} "]"\nitem ::= [0-9]{1,3}'),
    StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
]


def constrained(i: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=CONSTRAINTS[i % len(CONSTRAINTS)], **kw)


@pytest.fixture(scope="module")
def plain_outputs(llama_path, prompts):
    llm = LLM(model=llama_path, **ENGINE)
    outs = llm.generate(prompts, [constrained(i) for i in range(len(prompts))], use_tqdm=False)
    return [o.outputs[0] for o in outs]


def matcher_accepts(llm: LLM, params: StructuredOutputsParams, token_ids: list[int]) -> bool:
    import xgrammar as xgr

    m = xgr.GrammarMatcher(llm.engine.compile_grammar(params))
    return all(m.accept_token(t) for t in token_ids)


def test_every_output_is_in_its_grammar(llama_path, plain_outputs, prompts):
    llm = LLM(model=llama_path, **ENGINE)
    for i, out in enumerate(plain_outputs):
        kind = CONSTRAINTS[i % len(CONSTRAINTS)].kind
        assert matcher_accepts(llm, CONSTRAINTS[i % len(CONSTRAINTS)], out.token_ids)
        if kind == "json_object" and out.finish_reason == "length":
            continue  # an unbounded language: a random model may not close it within max_tokens
        assert out.finish_reason == "stop", (i, out.text)
        assert matcher_accepts(llm, CONSTRAINTS[i % len(CONSTRAINTS)], out.token_ids)
        if kind == "json":
            value = json.loads(out.text)
            assert set(value) == {"name", "count", "ok", "tags"} and 0 <= value["count"] <= 999
        elif kind == "choice":
            assert out.text in CONSTRAINTS[2].choice
        elif kind == "json_object":
            assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("spec", [
    {"method": "draft_model", "model": "noisy", "num_speculative_tokens": 3},
    {"method": "draft_model", "model": "noisy", "num_speculative_tokens": 3, "tree_topk": 2, "tree_nodes": 6},
    {"method": "eagle", "model": "eagle", "num_speculative_tokens": 3},
    {"method": "eagle", "model": "eagle", "num_speculative_tokens": 3, "tree_topk": 2, "tree_nodes": 6},
    {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 4},
    {"method": "suffix", "num_speculative_tokens": 4},
], ids=["draft-chain", "draft-tree", "eagle-chain", "eagle-tree", "ngram", "suffix"])
def test_greedy_speculative_equals_plain_constrained(llama_path, noisy_draft_path, eagle_head_path, plain_outputs,
                                                     prompts, spec):
    spec = dict(spec)
    if "model" in spec:
        spec["model"] = {"noisy": noisy_draft_path, "eagle": eagle_head_path}[spec["model"]]
    llm = LLM(model=llama_path, **ENGINE, speculative_config=spec)
    # mixed batch: every third request unconstrained and sampled
    params = [constrained(i) if i % 3 else SamplingParams(temperature=0.8, seed=i, max_tokens=30)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (o, want) in enumerate(zip(outs, plain_outputs)):
        if i % 3:
            assert o.outputs[0].token_ids == want.token_ids, f"prompt {i} diverged: {o.outputs[0].text!r}"
    assert llm.get_metrics()["num_draft_tokens"] > 0
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks
    assert llm.engine.executor.driver_worker.num_request_states() == 0


def test_forced_tokens_are_lossless_and_counted(llama_path, plain_outputs, prompts):
    llm = LLM(model=llama_path, **ENGINE, structured_outputs_forced_tokens=False)
    outs = llm.generate(prompts, [constrained(i) for i in range(len(prompts))], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.token_ids for o in plain_outputs]
    forced = LLM(model=llama_path, **ENGINE)
    forced.generate(prompts, [constrained(i) for i in range(len(prompts))], use_tqdm=False)
    assert forced.get_metrics()["num_forced_tokens"] > 0
    assert llm.get_metrics()["num_forced_tokens"] == 0


def test_preemption_n_seeds_stop_strings_and_logprobs(llama_path, noisy_draft_path, prompts):
    # a KV pool too small for the batch: requests are preempted and recomputed mid-grammar
    spec = {"method": "draft_model", "model": noisy_draft_path, "num_speculative_tokens": 3}
    small = LLM(model=llama_path, dtype="float32", device="cpu", max_model_len=160, kv_cache_memory=42 * 4096,
                block_size=4, speculative_config=spec)
    big = LLM(model=llama_path, dtype="float32", device="cpu", max_model_len=160)
    params = [constrained(0), constrained(1), constrained(3)] * 6
    want = [o.outputs[0].token_ids for o in big.generate(prompts[:18], params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in small.generate(prompts[:18], params, use_tqdm=False)]
    assert small.engine.scheduler.num_preemptions > 0
    assert got == want
    # n > 1 with a seed: reproducible, each completion in the grammar; logprobs of the constrained distribution
    sampled = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=150, logprobs=2,
                             structured_outputs=CONSTRAINTS[0])
    a = small.generate([prompts[0]], sampled, use_tqdm=False)[0].outputs
    b = small.generate([prompts[0]], sampled, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for c in a:
        assert c.finish_reason == "stop"
        json.loads(c.text)
        for token, lp in zip(c.token_ids, c.logprobs):
            assert token in lp and lp[token] <= 0.0
    # a stop string inside the grammar's language cuts the output there
    stop = small.generate([prompts[0]], constrained(0, stop=['"count"']), use_tqdm=False)[0].outputs[0]
    assert stop.finish_reason == "stop" and '"count"' not in stop.text and stop.text.startswith('{"name":')


def test_bad_constraints_are_clear_errors_and_disturb_nothing(llama_path, prompts):
    llm = LLM(model=llama_path, **ENGINE)
    for params, field in [(StructuredOutputsParams(regex="(("), "structured_outputs.regex"),
                          (StructuredOutputsParams(json={"type": "foo"}), "structured_outputs.json"),
                          (StructuredOutputsParams(grammar="root ::= "), "structured_outputs.grammar"),
                          (StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?"),
                           "structured_outputs.whitespace_pattern")]:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            llm.generate([prompts[0]], SamplingParams(structured_outputs=params), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    out = llm.generate([prompts[0]], constrained(2), use_tqdm=False)[0].outputs[0]
    assert out.text in CONSTRAINTS[2].choice
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_pydantic_model_as_schema(llama_path, prompts):
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        label: str

    llm = LLM(model=llama_path, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(
        json=Point, disable_any_whitespace=True))
    out = llm.generate([prompts[1]], params, use_tqdm=False)[0].outputs[0]
    if out.finish_reason == "stop":  # a random model may write a long label
        Point.model_validate_json(out.text)
    assert out.text.startswith('{"x":')
