"""DeepSeek-V3 token-identical to transformers in float32 on tiny random checkpoints: MLA with q and
kv low-rank projections, interleaved rotary dimensions, the paged cache holding only the latent
and the rotary key; a dense first layer then DeepSeek MoE layers (8 experts in 4 groups, the 2 best
groups eligible, top-2, one shared expert) whose routers are scaled up and whose correction
biases are random, so rows route to different experts and the bias changes the choice. Logits (and
with YaRN), plain, chunked, prefix-cached, preempted and speculative (a small DeepSeek-V3 draft,
a noisy copy as a chain and as a tree, n-gram) runs; the KV bytes per token."""
from __future__ import annotations

import pytest
import torch
from family_parity import (
    ENGINE, HFGreedy, check_plain_chunked_and_prefix_cached, check_preemption, check_speculative,
)

from specdec import LLM, SamplingParams
from specdec.worker.model_runner import ModelRunner

NUM_NEW = 16
MAX_MODEL_LEN = 128
LAYERS = 3
DS = dict(arch="deepseek_v3", num_layers=LAYERS, num_heads=4, num_kv_heads=4, moe_intermediate_size=32,
          q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
          n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
          first_k_dense_replace=1, routed_scaling_factor=2.5, initializer_range=0.05, random_norms_and_biases=True)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


def _route_widely(path: str, seed: int) -> str:
    """Scale the routers x20 and give each a random correction bias (transformers starts them at
    zero, which would leave the biased choice untested), in place."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.weight.mul_(20.0)
                if hasattr(module, "e_score_correction_bias"):  # DeepSeek-V3's; V2 has none
                    module.e_score_correction_bias.copy_(0.5 * torch.randn(module.weight.shape[0], generator=gen))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(make_model):
    return _route_widely(make_model("deepseek_v3_target", **DS), seed=1)


@pytest.fixture(scope="module")
def small_draft(make_model):
    draft = dict(DS, num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64, seed=7)
    return _route_widely(make_model("deepseek_v3_draft", **draft), seed=2)


@pytest.fixture(scope="module")
def reference(target):
    return HFGreedy(target, NUM_NEW)


@pytest.fixture(scope="module")
def batch(tiny_tokenizer, prompts):
    ragged = [tiny_tokenizer.encode(s) for s in prompts[:6]] + [tiny_tokenizer.encode(prompts[10])]
    prefix = list(range(40, 57))
    shared = [prefix + [60 + i] * (i + 1) for i in range(3)]
    assert all(len(p) + NUM_NEW <= MAX_MODEL_LEN for p in ragged)
    return ragged, shared


def _logits_match(path: str, prompts: list[list[int]]) -> None:
    """Every prompt row's logits, the prompts prefilled together, against transformers'."""
    from transformers import AutoModelForCausalLM

    from specdec.models.loader import load_model

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_model(path, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, 64, 8, torch.device("cpu"), torch.float32)
    tables, next_block = [], 0
    for p in prompts:
        n = -(-len(p) // 8)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    logits = runner.forward(runner.prepare(prompts, [0] * len(prompts), tables, [list(range(len(p))) for p in prompts]))
    start = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(logits[start:start + len(p)], ref, rtol=1e-4, atol=1e-4)
        start += len(p)


def test_logits_match_transformers_and_routing_varies(target, batch):
    ragged, _ = batch
    # the 61-token prompt attends in the expanded form (27 rows and more here), the others absorbed
    assert len(ragged[6]) >= 27 > max(len(p) for p in ragged[:4])
    _logits_match(target, ragged[:4] + ragged[6:7])
    from specdec.models.loader import load_model

    model = load_model(target, torch.float32, torch.device("cpu"))
    hidden = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for layer in model.layers[1:]:
        routing = layer.mlp.routed.gate(hidden)
        weights, ids = routing.weights, routing.expert_ids
        layer.mlp.routed(hidden)
        assert layer.mlp.routed.stats.last_experts_read == len(ids.unique()) >= 6  # each read once; most reached
        unbiased = torch.sigmoid(hidden @ layer.mlp.routed.gate.weight.t()).topk(2, dim=-1)[1]
        # the correction bias (and the group limit) changes some choices: a negative control
        assert (ids.sort(-1)[0] != unbiased.sort(-1)[0]).any(-1).float().mean() > 0.1
        torch.testing.assert_close(weights.sum(-1), torch.full((64,), 2.5))  # normalised, then scaled


def test_logits_match_transformers_with_yarn(make_model, batch):
    path = _route_widely(make_model("deepseek_v3_yarn", max_position_embeddings=128, rope_parameters=YARN, **DS), 3)
    ragged, _ = batch
    _logits_match(path, [ragged[0], ragged[6]])  # the second prompt runs past YaRN's original 32


def test_kv_cache_holds_the_latent(target):
    """Per token and layer: kv_lora_rank + qk_rope_head_dim values, against a per-head K and V
    cache of the same model (heads x (qk_nope + qk_rope + v))."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(target)
    block_size, itemsize = 16, 4
    per_token = ModelRunner.kv_bytes_per_block(cfg, block_size, torch.float32) / block_size
    latent = LAYERS * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * itemsize
    per_head = LAYERS * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * itemsize
    assert per_token == latent == 288 and per_head == 1344
    llm = LLM(model=target, **ENGINE, max_model_len=MAX_MODEL_LEN, block_size=block_size)
    runner = llm.engine.executor.driver_worker.runner
    allocated = sum(c.numel() * c.element_size() for c in runner.kv_caches) / (runner.num_blocks * block_size)
    assert allocated <= 1.05 * latent


def test_plain_chunked_and_prefix_cached(target, reference, batch):
    ragged, shared = batch
    check_plain_chunked_and_prefix_cached(target, ragged, shared, reference, MAX_MODEL_LEN, chunk_budget=8)


def test_preemption_with_a_draft(target, small_draft, reference, batch):
    ragged, _ = batch
    check_preemption(target, ragged, reference, MAX_MODEL_LEN, draft=small_draft)


@pytest.mark.parametrize("method", ["small_draft", "noisy_chain", "noisy_tree", "ngram"])
def test_speculation_is_greedy_identical(method, target, small_draft, reference, batch, make_perturbed_copy,
                                         tmp_path):
    def noisy():
        return make_perturbed_copy(target, tmp_path / "noisy", scale=0.05, seed=3)

    spec = {
        "small_draft": lambda: {"method": "draft_model", "model": small_draft, "num_speculative_tokens": 3},
        "noisy_chain": lambda: {"method": "draft_model", "model": noisy(), "num_speculative_tokens": 4},
        "noisy_tree": lambda: {"method": "draft_model", "model": noisy(), "num_speculative_tokens": 3,
                               "tree_topk": 2, "tree_nodes": 6},
        "ngram": lambda: {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                          "num_speculative_tokens": 3},
    }[method]()
    ragged, _ = batch
    check_speculative(target, ragged, reference, MAX_MODEL_LEN, spec, expect_accepted=method != "small_draft")


def test_bf16_keeps_the_router_in_float32(target, reference, batch, monkeypatch):
    """In a bf16 model the routers and correction biases stay float32, the latent cache is bf16, and
    the weight-format transforms leave kv_b_proj readable; the first greedy tokens match float32's.
    (Where the bf16 kernel is faster, dtype="bfloat16" would widen activations to float32 instead.)"""
    from specdec.layers import quantization

    monkeypatch.setattr(quantization, "bf16_kernel_faster", lambda: False)
    llm = LLM(model=target, dtype="bfloat16", device="cpu", max_model_len=MAX_MODEL_LEN)
    runner = llm.engine.executor.driver_worker.runner
    gate = runner.model.layers[1].mlp.routed.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert runner.kv_caches[0].dtype == torch.bfloat16 and runner.kv_caches[0].shape[-1] == 16 + 8
    ragged, _ = batch
    outs = llm.generate(ragged[:3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert sum(o.outputs[0].token_ids[:2] == reference(p)[:2] for o, p in zip(outs, ragged[:3])) >= 2

