"""Qwen3-MoE: token-identical to transformers in float32 (logits, greedy generation in mixed
batches with prefix caching, under preemption, speculative with a draft model and n-gram), on a
tiny random checkpoint with one dense layer (``mlp_only_layers``), top-3 of 8 experts,
``norm_topk_prob`` and per-head q/k norm."""
from __future__ import annotations

import pytest
from moe_parity import (
    HFGreedy,
    check_greedy_mixed_batch,
    check_logits,
    check_preemption,
    check_speculative,
)

from specdec.models.qwen3_moe import sparse_layer

SHAPE = dict(arch="qwen3_moe", num_layers=3, head_dim=32, num_experts=8, num_experts_per_tok=3,
             moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.05,
             router_scale=20.0, random_norms_and_biases=True)


@pytest.fixture(scope="module")
def qwen3_moe(make_model, make_perturbed_copy, tmp_path_factory, tiny_tokenizer):
    target = make_model("qwen3_moe", **SHAPE)
    draft = make_perturbed_copy(target, tmp_path_factory.mktemp("qwen3_moe_draft"), scale=0.1, seed=3)
    return target, draft, HFGreedy(target), tiny_tokenizer


def test_sparse_layers_follow_mlp_only_layers_and_decoder_sparse_step():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [sparse_layer(cfg, i) for i in range(6)] == [False, True, False, False, False, True]


def test_logits_match_transformers(qwen3_moe):
    target, _, hf, _ = qwen3_moe
    check_logits(target, hf)


def test_greedy_mixed_batch_with_prefix_caching(qwen3_moe):
    target, _, hf, tok = qwen3_moe
    check_greedy_mixed_batch(target, hf, tok)


def test_preemption(qwen3_moe):
    target, _, hf, tok = qwen3_moe
    check_preemption(target, hf, tok)


def test_speculative_greedy_matches_transformers(qwen3_moe):
    target, draft, hf, tok = qwen3_moe
    check_speculative(target, draft, hf, tok)


@pytest.mark.parametrize("quantization", ["int8", "w4a8"])
def test_quantized_experts_speculative_greedy_equals_plain(quantization, qwen3_moe):
    """Each expert's linears quantized (the router kept): speculation stays lossless with respect to
    the quantized target (and int8's output starts as the float32 model's)."""
    from moe_parity import PROMPTS, token_ids

    from specdec import LLM
    from specdec.layers.quantization import WeightOnlyLinear

    target, _, hf, tok = qwen3_moe
    prompts = [tok.encode(p) for p in PROMPTS]
    plain = LLM(model=target, dtype="float32", device="cpu", max_model_len=128, quantization=quantization)
    model = plain.engine.executor.driver_worker.runner.model
    assert isinstance(model.layers[0].mlp.experts[5].down_proj, WeightOnlyLinear)
    reference = token_ids(plain, prompts)
    spec = LLM(model=target, dtype="float32", device="cpu", max_model_len=128, quantization=quantization,
               speculative_config={"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                   "num_speculative_tokens": 3})
    assert token_ids(spec, prompts) == reference
    assert spec.get_metrics()["num_accepted_tokens"] > 0
    if quantization == "int8":  # an int8 error in the experts moves late tokens, not the first ones
        assert sum(r[:4] == hf(p)[:4] for r, p in zip(reference, prompts)) >= len(prompts) - 1


def test_eagle3_head_on_the_moe_target_is_greedy_identical(qwen3_moe, tmp_path):
    """An EAGLE-3 head (speculators format, as published for Qwen3-MoE) reading three layers' inputs
    of the MoE target: greedy speculative output equals transformers'."""
    import torch
    from moe_parity import PROMPTS, greedy_params, token_ids

    from specdec import LLM
    from specdec.models.loader import load_model
    from specdec.models.speculators import save_eagle3
    from specdec.training.train_eagle3 import init_eagle3

    target, _, hf, tok = qwen3_moe
    head = init_eagle3(load_model(target, torch.float32, torch.device("cpu")), (0, 1, 2), seed=1)
    with torch.no_grad():  # drafts that vary from row to row
        for name, p in head.named_parameters():
            if p.dim() == 2 and not name.startswith("lm_head"):
                p.mul_(8.0)
    save_eagle3(head, tmp_path / "head", target, ["Qwen3MoeForCausalLM"], 3, dtype=torch.float32)
    llm = LLM(model=target, dtype="float32", device="cpu", max_model_len=128, speculative_config={
        "method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 3})
    prompts = [tok.encode(p) for p in PROMPTS]
    assert token_ids(llm, prompts, greedy_params()) == [hf(p) for p in prompts]
    assert llm.get_metrics()["num_draft_tokens"] > 0
