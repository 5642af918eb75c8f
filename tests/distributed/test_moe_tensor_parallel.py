"""Tensor parallelism on a mixture-of-experts target (Qwen3-MoE, float32, CPU over gloo, 2 ranks):
each expert's intermediate dimension is split across the ranks, and greedy output equals one
device's token for token, plain and with n-gram speculation, in a mixed batch."""
from __future__ import annotations

import pytest

from specdec import SamplingParams

SHAPE = dict(arch="qwen3_moe", num_layers=2, head_dim=32, num_experts=8, num_experts_per_tok=3,
             moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.05,
             router_scale=20.0, random_norms_and_biases=True)


@pytest.fixture(scope="module")
def moe_path(make_model) -> str:
    return make_model("qwen3_moe_tp", **SHAPE)


def test_moe_under_tp_equals_one_device(moe_path, prompts, tp, one_device):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    batch = prompts[:10]
    reference = [o.outputs[0].token_ids for o in one_device(moe_path).generate(batch, params, use_tqdm=False)]
    llm = tp.engine(moe_path, {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                               "num_speculative_tokens": 3})
    moe = llm.engine.executor.driver_worker.runner.model.layers[0].mlp.moe  # the sharded layer inside its all-reduce
    assert moe.experts[0].gate_up_proj.weight.shape == (2 * 16, 64)  # 32 / 2 ranks, gate and up
    assert moe.experts[0].down_proj.weight.shape == (64, 16)  # row-parallel: the reduction is the layer's
    assert tp.mixed_batch(llm, batch, params) == reference
    assert llm.get_metrics()["num_accepted_tokens"] > 0
