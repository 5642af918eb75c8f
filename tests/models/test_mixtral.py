"""Mixtral: token-identical to transformers in float32 (logits, greedy generation in mixed
batches with prefix caching, under preemption, speculative with a draft model and n-gram) on a
tiny random checkpoint saved with Mixtral's published names (``block_sparse_moe``, ``w1/w2/w3``),
top-2 of 8 experts; and with a sliding window of 8 that the sequences outgrow."""
from __future__ import annotations

import pytest
from moe_parity import (
    HFGreedy,
    check_greedy_mixed_batch,
    check_logits,
    check_preemption,
    check_speculative,
)

from specdec.models.mixtral import hf_name

SHAPE = dict(arch="mixtral", num_layers=2, num_kv_heads=1, intermediate_size=48, num_local_experts=8,
             num_experts_per_tok=2, initializer_range=0.05, router_scale=20.0, random_norms_and_biases=True)


@pytest.fixture(scope="module", params=[None, 8], ids=["full", "window8"])
def mixtral(request, make_model, make_perturbed_copy, tmp_path_factory, tiny_tokenizer):
    window = request.param
    extra = {"sliding_window": window} if window else {}
    target = make_model("mixtral_window" if window else "mixtral", **SHAPE, **extra)
    draft = make_perturbed_copy(target, tmp_path_factory.mktemp("mixtral_draft"), scale=0.1, seed=3)
    return target, draft, HFGreedy(target), tiny_tokenizer


def test_published_names_map_to_the_fused_layout():
    prefix = "model.layers.3.block_sparse_moe"
    assert hf_name(f"{prefix}.experts.7.w1.weight") == "model.layers.3.mlp.experts.7.gate_proj.weight"
    assert hf_name(f"{prefix}.experts.12.w2.weight") == "model.layers.3.mlp.experts.12.down_proj.weight"
    assert hf_name(f"{prefix}.experts.0.w3.weight") == "model.layers.3.mlp.experts.0.up_proj.weight"
    assert hf_name("model.layers.0.block_sparse_moe.gate.weight") == "model.layers.0.mlp.gate.weight"


def test_logits_match_transformers(mixtral):
    target, _, hf, _ = mixtral
    check_logits(target, hf)


def test_greedy_mixed_batch_with_prefix_caching(mixtral):
    target, _, hf, tok = mixtral
    check_greedy_mixed_batch(target, hf, tok)


def test_preemption(mixtral):
    target, _, hf, tok = mixtral
    check_preemption(target, hf, tok, expect_preemption="window" not in target)


def test_speculative_greedy_matches_transformers(mixtral):
    target, draft, hf, tok = mixtral
    check_speculative(target, draft, hf, tok)
