"""``draft_confidence_threshold``: a chain stops drafting at the first token its draft is unsure of.
Greedy output stays the target's, and the chains really get shorter (sampling: the chi-square case
``noisy-draft-confidence-stop`` in test_spec_distribution.py)."""
from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig

K = 4


def _run(path: str, prompts: list[str], **spec):
    llm = LLM(model=path, dtype="float32", device="cpu", max_model_len=256,
              speculative_config={"method": "draft_model", "model": spec.pop("draft", path),
                                  "num_speculative_tokens": K, **spec} if spec is not None else None)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.get_metrics()


@pytest.mark.parametrize("threshold", [0.3, 0.9])
def test_greedy_output_is_the_targets_and_chains_get_shorter(llama_path, noisy_draft_path, prompts, threshold):
    plain = LLM(model=llama_path, dtype="float32", device="cpu", max_model_len=256)
    expected = [o.outputs[0].token_ids for o in plain.generate(
        prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)]
    full, m_full = _run(llama_path, prompts, draft=noisy_draft_path)
    cut, m_cut = _run(llama_path, prompts, draft=noisy_draft_path, draft_confidence_threshold=threshold)
    assert full == expected and cut == expected
    full_chain = m_full["num_draft_tokens"] / m_full["num_drafts"]
    cut_chain = m_cut["num_draft_tokens"] / m_cut["num_drafts"]
    assert 1 <= cut_chain < full_chain


def test_eagle_chains_take_it_too(llama_path, eagle_head_path, prompts):
    plain = LLM(model=llama_path, dtype="float32", device="cpu", max_model_len=256)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(model=llama_path, dtype="float32", device="cpu", max_model_len=256,
              speculative_config={"method": "eagle", "model": eagle_head_path, "num_speculative_tokens": K,
                                  "draft_confidence_threshold": 0.95})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    m = llm.get_metrics()
    assert m["num_draft_tokens"] == m["num_drafts"] > 0


@pytest.mark.parametrize("spec, match", [
    ({"method": "ngram", "draft_confidence_threshold": 0.5}, "applies to chains drafted by a model"),
    ({"method": "draft_model", "model": "m", "tree_topk": 2, "draft_confidence_threshold": 0.5}, "tree_topk"),
    ({"method": "draft_model", "model": "m", "draft_confidence_threshold": 1.0}, r"in \[0, 1\)"),
    ({"method": "draft_model", "model": "m", "draft_confidence_threshold": -0.1}, r"in \[0, 1\)"),
    ({"method": "draft_model", "model": "m", "draft_confidence_threshold": "0.5"}, r"in \[0, 1\)"),
])
def test_bad_values_name_the_field(spec, match):
    with pytest.raises(ValueError, match=match) as err:
        SpeculativeConfig(**spec)
    assert "draft_confidence_threshold" in str(err.value)


def test_zero_and_a_valid_value_are_accepted():
    assert SpeculativeConfig(method="draft_model", model="m").draft_confidence_threshold == 0.0
    assert SpeculativeConfig(method="draft_model", model="m", draft_confidence_threshold=0.6).draft_confidence_threshold == 0.6
