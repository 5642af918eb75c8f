"""Tensor parallelism on DeepSeek-V3 (float32, CPU over gloo, 2 ranks): MLA's heads split across
the ranks (q_b_proj / kv_b_proj by head, o_proj row-parallel), the latent cache replicated, the
routed and shared experts split by width; greedy output equals one device's token for token, in
a ragged batch whose longest prompt runs the expanded attention form, plain and with n-gram
speculation (verification rows)."""
from __future__ import annotations

import pytest

from specdec import SamplingParams

DS = dict(arch="deepseek_v3", num_layers=2, num_heads=4, num_kv_heads=4, moe_intermediate_size=32,
          q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
          n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
          first_k_dense_replace=1, initializer_range=0.05, random_norms_and_biases=True, router_scale=20.0)


@pytest.fixture(scope="module")
def target(make_model) -> str:
    return make_model("deepseek_v3_tp", **DS)


def test_mla_under_tp_equals_one_device(target, tiny_tokenizer, prompts, tp, one_device):
    batch = [tiny_tokenizer.encode(p) for p in prompts[:6] + prompts[10:11]]
    assert len(batch[-1]) >= 27  # the expanded form's rows (test_deepseek_v3.py)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in
                 one_device(target, max_model_len=128).generate(batch, params, use_tqdm=False)]
    llm = tp.engine(target, {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                             "num_speculative_tokens": 3}, max_model_len=128)
    model = llm.engine.executor.driver_worker.runner.model
    attn = model.layers[0].self_attn
    cfg = model.config
    assert attn.num_heads == 2
    assert attn.q_b_proj.weight.shape[0] == 2 * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    assert attn.kv_b_proj.weight.shape == (2 * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    assert attn.o_proj.linear.weight.shape[1] == 2 * cfg.v_head_dim  # row-parallel, inside its all-reduce
    assert model.layers[1].mlp.moe.shared_experts.down_proj.weight.shape[1] == cfg.moe_intermediate_size // 2
    runner = llm.engine.executor.driver_worker.runner
    assert runner.kv_caches[0].shape[-1] == cfg.kv_lora_rank + cfg.qk_rope_head_dim  # the whole latent per rank
    assert tp.mixed_batch(llm, batch, params) == reference
    assert llm.get_metrics()["num_accepted_tokens"] > 0
