"""The grouped-by-expert MoE layer against transformers' MoE blocks and the per-pair reference.

float32: outputs within 1e-6 relative of transformers' Qwen3-MoE and Mixtral blocks (same routing,
same accumulation order); the grouped execution equals ``reference_moe`` (each (row, choice) pair
alone); and the experts read per call is the union of the rows' choices, counted exactly.
"""
from __future__ import annotations

import pytest
import torch

from specdec.layers.moe import (
    ClampedSwiGLU,
    Expert,
    Routing,
    SparseMoE,
    TopKRouter,
    experts_read,
    grouped_experts,
    reference_moe,
)

H, I, E = 32, 24, 8


def random_moe(top_k: int, softmax_first=True, normalize=True, bias=False, activation=None, seed=0) -> SparseMoE:
    torch.manual_seed(seed)
    router = TopKRouter(H, E, top_k, softmax_first, normalize, bias)
    experts = [Expert(H, I, bias=bias, **({"activation": activation} if activation else {})) for _ in range(E)]
    moe = SparseMoE(router, experts)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
    return moe


def test_router_choices_and_weights():
    moe = random_moe(top_k=3, normalize=True)
    x = torch.randn(5, H)
    r = moe.gate(x)
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)
    assert torch.equal(r.expert_ids, probs.topk(3).indices)
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(5))
    raw = random_moe(top_k=3, normalize=False).gate(x)
    assert (raw.weights.sum(-1) < 1).all()  # not renormalised: the rest of the mass is on other experts
    topk_first = random_moe(top_k=2, softmax_first=False, bias=True).gate
    r2 = topk_first(x)
    logits = x @ topk_first.weight.T + topk_first.bias
    torch.testing.assert_close(r2.weights, torch.softmax(logits.topk(2).values, -1))


@pytest.mark.parametrize("top_k, rows", [(1, 1), (2, 7), (3, 16)])
def test_grouped_equals_the_per_pair_reference(top_k, rows):
    moe = random_moe(top_k)
    x = torch.randn(rows, H)
    routing = moe.gate(x)
    ref = reference_moe(x, routing, moe.experts)  # sums the choices in another order: float32 rounding only
    torch.testing.assert_close(moe(x), ref, rtol=0, atol=1e-6 * ref.abs().max().item())


def test_one_row_sums_its_experts_in_increasing_id_order():
    """Batch-1 decode skips the grouping; its sum is the grouped one's, term for term."""
    moe = random_moe(top_k=3)
    x = torch.randn(1, H)
    routing = Routing(torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[6, 1, 4]]))
    expected = torch.zeros_like(x)
    for choice in (1, 2, 0):  # experts 1, 4, 6
        expected += moe.experts[int(routing.expert_ids[0, choice])](x) * routing.weights[0, choice]
    assert torch.equal(grouped_experts(x, routing, moe.experts, moe.stats), expected)
    assert moe.stats.last_experts_read == 3 and moe.stats.num_pairs == 3 and moe.stats.num_calls == 1


def test_each_touched_expert_is_read_once_per_call():
    moe = random_moe(top_k=2)
    calls = []
    for i, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda m, args, out, i=i: calls.append((i, args[0].shape[0])))
    x = torch.randn(6, H)
    routing = Routing(torch.full((6, 2), 0.5), torch.tensor([[0, 3], [3, 0], [5, 0], [0, 3], [3, 5], [7, 0]]))
    out = grouped_experts(x, routing, moe.experts, moe.stats)
    assert calls == [(0, 5), (3, 4), (5, 2), (7, 1)]  # increasing id, each once with all its rows
    assert moe.stats.last_experts_read == 4 and moe.stats.num_pairs == 12  # not 6 x 2 = 12 expert reads
    ref = reference_moe(x, routing, moe.experts)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    moe(torch.randn(1, H))
    assert moe.stats.last_experts_read == 2 and experts_read(moe) == 6 and moe.stats.num_calls == 2


def _load_hf_experts(ours: SparseMoE, hf_gate, hf_experts, gate_up_interleaved_transposed=False):
    with torch.no_grad():
        hf_gate.weight.copy_(ours.gate.weight)
        if ours.gate.bias is not None:
            hf_gate.bias.copy_(ours.gate.bias)
        gate_up = torch.stack([e.gate_up_proj.weight for e in ours.experts])  # [E, 2I, H]
        down = torch.stack([e.down_proj.weight for e in ours.experts])  # [E, H, I]
        if gate_up_interleaved_transposed:  # gpt-oss: [E, H, 2I] with gate/up interleaved
            inter = torch.empty_like(gate_up)
            inter[:, 0::2], inter[:, 1::2] = gate_up[:, :I], gate_up[:, I:]
            hf_experts.gate_up_proj.copy_(inter.transpose(1, 2))
            hf_experts.down_proj.copy_(down.transpose(1, 2))
            b = torch.stack([e.gate_up_proj.bias for e in ours.experts])
            ib = torch.empty_like(b)
            ib[:, 0::2], ib[:, 1::2] = b[:, :I], b[:, I:]
            hf_experts.gate_up_proj_bias.copy_(ib)
            hf_experts.down_proj_bias.copy_(torch.stack([e.down_proj.bias for e in ours.experts]))
        else:
            hf_experts.gate_up_proj.copy_(gate_up)
            hf_experts.down_proj.copy_(down)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_unnormalized", "mixtral", "gpt_oss"])
def test_matches_the_transformers_block(family):
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    top_k = 3 if family.startswith("qwen3") else 2
    common = dict(hidden_size=H, num_experts_per_tok=top_k)
    if family.startswith("qwen3_moe"):
        normalize = family == "qwen3_moe"
        cfg = AutoConfig.for_model("qwen3_moe", num_experts=E, moe_intermediate_size=I, norm_topk_prob=normalize,
                                   **common)
        ours, hf = random_moe(top_k, normalize=normalize), Qwen3MoeSparseMoeBlock(cfg)
        _load_hf_experts(ours, hf.gate, hf.experts)
    elif family == "mixtral":
        cfg = AutoConfig.for_model("mixtral", num_local_experts=E, intermediate_size=I, **common)
        ours, hf = random_moe(top_k), MixtralSparseMoeBlock(cfg)
        _load_hf_experts(ours, hf.gate, hf.experts)
    else:
        cfg = AutoConfig.for_model("gpt_oss", num_local_experts=E, intermediate_size=I, **common)
        ours = random_moe(top_k, softmax_first=False, normalize=False, bias=True, activation=ClampedSwiGLU(1.702, 7.0))
        hf = GptOssMLP(cfg)
        _load_hf_experts(ours, hf.router, hf.experts, gate_up_interleaved_transposed=True)
    x = 2.0 * torch.randn(1, 24, H)  # large enough that gpt-oss's clamp at 7 is reached
    with torch.no_grad():
        ref = hf(x)
        ref = ref[0] if isinstance(ref, tuple) else ref
        out = ours(x[0])
    assert len(set(ours.gate(x[0]).expert_ids.flatten().tolist())) == E  # routing really varies
    # our router rounds float64 logits (row-consistent), transformers' computes them in float32: the
    # mixing weights differ in the last bits, a different expert choice would differ by O(1)
    torch.testing.assert_close(out, ref[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quantization", ["int8", "int4", "w4a8"])
def test_quantization_transforms_every_expert_and_keeps_the_router(quantization):
    from specdec.layers.quantization import WeightOnlyLinear, prepare_for_inference

    torch.manual_seed(0)
    hidden = 64  # w4a8 takes layers of 64k inputs: gate_up here, down (24 inputs) stays weight-only
    moe = SparseMoE(TopKRouter(hidden, E, 2), [Expert(hidden, I) for _ in range(E)])
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
    router_weight = moe.gate.weight.detach().clone()
    x = torch.randn(9, hidden)
    with torch.no_grad():
        dense_out = moe(x)
    prepare_for_inference(moe, quantization, torch.device("cpu"))
    assert all(isinstance(e.gate_up_proj, WeightOnlyLinear) and isinstance(e.down_proj, WeightOnlyLinear)
               for e in moe.experts)
    assert isinstance(moe.gate, TopKRouter) and torch.equal(moe.gate.weight, router_weight)
    assert moe.experts[0].gate_up_proj.int8_activations == (quantization == "w4a8")
    with torch.no_grad():
        out = moe(x)
        if quantization == "w4a8":  # activations rounded too: only close to the float layer
            assert ((out - dense_out).abs().max() / dense_out.abs().max()) < 0.3
            return
        # weight-only: the float layer with the dequantized weights
        dequantized = [Expert(hidden, I) for _ in range(E)]
        for ours, ref in zip(moe.experts, dequantized):
            ref.gate_up_proj.weight.copy_(ours.gate_up_proj.dequantized_weight())
            ref.down_proj.weight.copy_(ours.down_proj.dequantized_weight())
        expected = grouped_experts(x, moe.gate(x), dequantized)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    assert not torch.equal(out, dense_out)


def test_router_logits_of_a_row_do_not_depend_on_the_rows_beside_it():
    """A verification step routes K+1 rows at once, a plain decode step one: the same token must pick the
    same experts. (A float32 CPU matmul of one row differs from the same row among 16 in the last bits.)"""
    from specdec.layers.moe import router_logits

    torch.manual_seed(0)
    weight, bias, x = torch.randn(128, 2048), torch.randn(128), torch.randn(16, 2048)
    full = router_logits(x, weight, bias)
    for m in (1, 2, 3, 5, 8):
        assert torch.equal(router_logits(x[:m], weight, bias), full[:m])
    weight.mul_(2.0)  # written in place: the float64 copy follows
    assert torch.equal(router_logits(x, weight, bias), torch.nn.functional.linear(x.double(), weight.double(), bias.double()).float())


def test_the_router_keeps_its_float64_weight_and_remakes_it_when_the_weight_changes():
    router = random_moe(top_k=2, bias=True).gate
    x = torch.randn(4, H)
    first = router(x)
    cached = router.weight_float64
    assert cached.dtype == torch.float64 and torch.equal(cached, router.weight.double())
    assert torch.equal(router(x).expert_ids, first.expert_ids) and router.weight_float64 is cached  # kept
    with torch.no_grad():
        router.weight.mul_(-1.0)  # written in place: the copy follows
    assert torch.equal(router.weight_float64, cached) and not torch.equal(router(x).expert_ids, first.expert_ids)
    assert torch.equal(router.weight_float64, router.weight.double())
    router.weight_float64 = router.weight_float64.float()  # a cast of the model's buffers: made again
    router(x)
    assert router.weight_float64.dtype == torch.float64
    assert "weight_float64" not in router.state_dict() and "bias_float64" not in router.state_dict()
