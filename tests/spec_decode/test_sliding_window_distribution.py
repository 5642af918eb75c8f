"""Speculative sampling on a sliding-window target reproduces its distribution exactly.

The target is a tiny Gemma 3 over a 30-token character vocabulary whose first layer sees only the
last 4 positions (the second is global); the draft is the target's weights plus noise (same
layout, K = 3). The prompt is 8 tokens, so every sampled position's window cuts. As in
``test_spec_distribution``: 4000 continuations of 5 tokens, each request with its own seed; the
observed joint counts of the first 3 tokens (one plainly sampled, two speculative) against the
exact joint computed by transformers; Pearson chi-square, cells with expected count < 5 merged,
significance level 1e-3. Negative control: the same counts against the target at a 15% higher
temperature must be rejected at that level.
"""
from __future__ import annotations

import pytest
from test_spec_distribution import K, PROMPT, check_speculative_samples_follow

from specdec import LLM

NUM_SAMPLES = 4000


@pytest.fixture(scope="module")
def windowed_models(make_model, make_char_tokenizer, make_perturbed_copy, tmp_path_factory):
    tok = make_char_tokenizer()
    target = make_model("dist_gemma3", arch="gemma3", vocab_size=len(tok), hidden_size=32, num_heads=2,
                        num_kv_heads=1, head_dim=16, intermediate_size=64, num_layers=2, sliding_window=4,
                        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
                        tokenizer=tok, initializer_range=0.05, seed=21)
    draft = make_perturbed_copy(target, tmp_path_factory.mktemp("dist_gemma3_noisy"), scale=0.3, seed=5)
    return target, draft


def test_speculative_sampling_on_a_sliding_window_target(windowed_models):
    target, draft = windowed_models
    llm = LLM(model=target, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=1000,
              max_num_batched_tokens=8192,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": K})
    assert llm.engine.model_config.sliding_window == 4
    assert len(llm.tokenizer.encode(PROMPT)) > 4
    check_speculative_samples_follow(llm, target, NUM_SAMPLES, "windowed target")
