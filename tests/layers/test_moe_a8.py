"""``A8FusedMoE`` in an engine: a tiny Qwen3-MoE (float32, experts of 256 so that both expert linears
take int8 activations) loaded with ``quantization="w4a8"`` on CPU runs every MoE layer as one C++
call; its greedy tokens equal those of the same weights run expert by expert, and speculative
decoding (n-gram, K = 3, mixed batch) equals plain decoding."""
from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.kernels.cpu import moe_cpu
from specdec.layers.moe import SparseMoE, experts_read, moe_layers
from specdec.layers.moe_a8 import A8FusedMoE

pytestmark = pytest.mark.skipif("moe_cpu.extension() is None", reason="no CPU MoE kernel on this machine")

SHAPE = dict(arch="qwen3_moe", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
             intermediate_size=512, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
             norm_topk_prob=True, initializer_range=0.05, router_scale=20.0, random_norms_and_biases=True)
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9], list(range(40, 70))]


def greedy(llm: LLM, **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                          use_tqdm=False)]


def test_one_call_layers_decode_the_expert_by_expert_tokens_and_speculation_is_lossless(make_model):
    llm = LLM(model=make_model("qwen3_moe_a8", **SHAPE), quantization="w4a8", dtype="float32", device="cpu",
              max_model_len=96, spec_cost_calibration=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    model = llm.engine.executor.driver_worker.runner.model
    assert all(isinstance(layer.mlp, A8FusedMoE) for layer in model.layers)
    plain = greedy(llm, use_speculation=False)
    assert greedy(llm) == plain
    assert experts_read(model) > 0 and len(moe_layers(model)) == 2
    for layer in model.layers:
        layer.mlp = layer.mlp.unfused()
    assert all(isinstance(m, SparseMoE) for m in moe_layers(model))
    assert greedy(llm, use_speculation=False) == plain
