"""The fused-MoE Triton kernel (two launches per layer, pairs sorted by expert) against the
per-pair torch reference and against ``layers.moe``'s grouped execution.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported); on a GPU run this file with SPECDEC_KERNEL_DEVICE=cuda."""
import os

DEVICE = os.environ.get("SPECDEC_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton; it is in the 'test' extra)")

import torch

from specdec.kernels.triton import load
from specdec.layers.moe import Expert, Routing, grouped_experts

kernels = load("fused_moe")


def test_align_pairs_groups_by_expert_and_pads_each_group():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # pairs 0..5 -> experts 2 0 2 1 0 2
    sorted_pairs, block_expert = kernels.align_pairs(ids, num_experts=4, block_m=2)
    p = 6  # the sentinel
    assert sorted_pairs[:8].tolist() == [1, 4, 3, p, 0, 2, 5, p]  # expert 0: pairs 1, 4; 1: 3; 2: 0, 2, 5
    assert block_expert[:4].tolist() == [0, 1, 2, 2] and (block_expert[4:] == -1).all()


@pytest.mark.parametrize("rows, top_k, num_experts, hidden, inter", [(1, 2, 8, 64, 32), (7, 3, 8, 48, 40),
                                                                     (16, 8, 32, 32, 16)])
def test_fused_moe_matches_the_reference(rows, top_k, num_experts, hidden, inter):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen, device="cpu").to(DEVICE)
    w13 = (0.2 * torch.randn(num_experts, 2 * inter, hidden, generator=gen)).to(DEVICE)
    w2 = (0.2 * torch.randn(num_experts, hidden, inter, generator=gen)).to(DEVICE)
    scores = torch.randn(rows, num_experts, generator=gen).softmax(-1)
    weights, ids = scores.topk(top_k, dim=-1)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    out = kernels.fused_moe(x, weights, ids, w13, w2)
    ref = kernels.reference_fused_moe(x, weights, ids, w13, w2)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    experts = []
    for e in range(num_experts):  # the same weights as layers.moe experts
        expert = Expert(hidden, inter).to(DEVICE)
        with torch.no_grad():
            expert.gate_up_proj.weight.copy_(w13[e])
            expert.down_proj.weight.copy_(w2[e])
        experts.append(expert)
    with torch.no_grad():
        grouped = grouped_experts(x, Routing(weights, ids), experts)
    torch.testing.assert_close(out, grouped, rtol=0, atol=1e-5 * ref.abs().max().item())


def test_a_model_with_fused_experts_gives_the_same_logits_and_tokens(make_model):
    """``fuse_experts`` (what GPUs get) on a Qwen3-MoE target: the same logits as the grouped torch
    path within float32 rounding, and the same greedy tokens."""
    from specdec import LLM, SamplingParams
    from specdec.layers.moe import FusedMoE, fuse_experts, moe_layers

    path = make_model("qwen3_moe_fused", arch="qwen3_moe", num_layers=2, head_dim=32, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, initializer_range=0.05, router_scale=20.0)
    llm = LLM(model=path, dtype="float32", device="cpu", max_model_len=64)
    runner = llm.engine.executor.driver_worker.runner
    feeds = [[5, 6, 7, 8, 9], [10, 11, 12]]
    batch = runner.prepare(feeds, [0, 0], [[0], [1]], [list(range(len(f))) for f in feeds])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["def f(x):", "import json"]
    grouped_logits = runner.forward(batch).clone()
    grouped_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert fuse_experts(runner.model) == 2 and all(isinstance(m, FusedMoE) for m in moe_layers(runner.model))
    fused_logits = runner.forward(batch)
    scale = grouped_logits.abs().max().item()
    torch.testing.assert_close(fused_logits, grouped_logits, rtol=0, atol=1e-5 * scale)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == grouped_tokens
