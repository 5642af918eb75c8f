"""Phi-3 token-identical to transformers in float32: fused qkv / gate_up weights, partial rotary
(0.75 of each head), LongRoPE switching at 32 positions, every layer sliding (window 12).
Requests that stay within 32 positions rotate with the short factors, prompts longer than 32
(prefilled in one chunk) with the long ones, both kinds in one batch; plain, chunked,
prefix-cached, preempted and speculative (a small Phi-3 draft, a noisy copy, n-gram)."""
from __future__ import annotations

import pytest
import torch
from family_parity import (
    HFGreedy, check_plain_chunked_and_prefix_cached, check_preemption, check_speculative, check_tensor_parallel,
)

NUM_NEW = 20
MAX_MODEL_LEN = 128
ORIGINAL = 32  # LongRoPE's switch point
PHI3 = dict(arch="phi3", num_layers=2, sliding_window=12, max_position_embeddings=256,
            original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75,
            rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(6)],
                          "long_factor": [3.0 + 1.5 * i for i in range(6)]})


@pytest.fixture(scope="module")
def target(make_model):
    return make_model("phi3_target", initializer_range=0.05, random_norms_and_biases=True, **PHI3)


@pytest.fixture(scope="module")
def small_draft(make_model):
    return make_model("phi3_draft", arch="phi3", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                      intermediate_size=64, sliding_window=12, seed=7)


@pytest.fixture(scope="module")
def reference(target):
    return HFGreedy(target, NUM_NEW)


@pytest.fixture(scope="module")
def batch(tiny_tokenizer, prompts):
    """Short requests (prompt + output within 32 positions: short factors) and long prompts
    (over 32 from the first step: long factors); short prompts sharing an 8-token block."""
    short = [p for p in (tiny_tokenizer.encode(s) for s in prompts) if len(p) + NUM_NEW <= ORIGINAL][:5]
    long = [tiny_tokenizer.encode(prompts[10]), tiny_tokenizer.encode(prompts[22] + prompts[11])]
    prefix = list(range(40, 49))
    shared = [prefix + [60 + i] * (i + 1) for i in range(3)]
    assert len(short) == 5 and all(ORIGINAL < len(p) <= MAX_MODEL_LEN - NUM_NEW for p in long)
    assert all(len(p) + NUM_NEW <= ORIGINAL for p in shared)
    return short, long, shared


def test_rotary_tables_match_transformers(target):
    """Our short and long tables (attention factor included) against transformers' own."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from specdec.models.loader import load_model

    model = load_model(target, torch.float32, torch.device("cpu"))
    hf = Phi3RotaryEmbedding(AutoConfig.from_pretrained(target))
    x = torch.zeros(1)
    for length, long in ((ORIGINAL, False), (ORIGINAL + 9, True)):
        positions = torch.arange(length)
        cos, sin = hf(x, positions[None])
        ours = model.rotary.lookup(positions, long_rows=torch.full((length,), long))
        rot = model.rotary_dim
        assert rot == 12 and cos.shape[-1] == rot
        torch.testing.assert_close(ours[0][:, 0], cos[0, :, :rot // 2], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours[1][:, 0], sin[0, :, :rot // 2], rtol=1e-6, atol=1e-6)
    short_cos = model.rotary.lookup(positions)[0]
    assert not torch.allclose(short_cos, ours[0])  # negative control: the two tables differ


def test_plain_chunked_and_prefix_cached(target, reference, batch):
    short, long, shared = batch
    check_plain_chunked_and_prefix_cached(target, short + long, shared, reference, MAX_MODEL_LEN, chunk_budget=8)


def test_preemption_with_a_draft(target, small_draft, reference, batch):
    short, long, _ = batch
    # every layer of both models slides: the freeing alone would let this batch fit
    check_preemption(target, short + long, reference, MAX_MODEL_LEN, draft=small_draft, keep_all_blocks=True)


@pytest.mark.parametrize("method", ["small_draft", "noisy", "ngram"])
def test_speculation_is_greedy_identical(method, target, small_draft, reference, batch, make_perturbed_copy,
                                         tmp_path):
    spec = {
        "small_draft": lambda: {"method": "draft_model", "model": small_draft, "num_speculative_tokens": 3},
        "noisy": lambda: {"method": "draft_model", "num_speculative_tokens": 4,
                          "model": make_perturbed_copy(target, tmp_path / "noisy", scale=0.1, seed=3)},
        "ngram": lambda: {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                          "num_speculative_tokens": 3},
    }[method]()
    short, long, _ = batch
    check_speculative(target, short + long, reference, MAX_MODEL_LEN, spec, expect_accepted=method != "small_draft")


def test_two_tensor_parallel_ranks(target, reference, batch):
    """The fused checkpoint weights are cut into per-rank q / k / v and gate / up rows."""
    short, long, _ = batch
    check_tensor_parallel(target, short[:3] + long[:1], reference, MAX_MODEL_LEN)
