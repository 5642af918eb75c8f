"""The one-call CPU MoE kernel (``csrc/moe_cpu.cpp`` through ``layers.moe_a8.A8FusedMoE``), for each
instruction set this CPU runs (``kernel_isa``), against ``layers.moe.grouped_experts`` over the same
int8-activation experts: equal bit for bit (the same products and sums in the same order), alone and
among other rows (row-consistency, which keeps speculative == plain), on every scale form the GGUF
path produces; and the pure-torch ``reference_moe`` (pairs one by one, summed in choice order) within
float32 rounding.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from specdec.kernels.cpu import moe_cpu, woq_cpu
from specdec.layers import cpu_kernel_choice
from specdec.kernels.cpu.woq_format import Int4Weight, Int8Weight, quantize_int4, quantize_int8
from specdec.layers.moe import (
    Expert,
    Routing,
    SparseMoE,
    TopKRouter,
    experts_read,
    grouped_experts,
    moe_layers,
    reference_moe,
)
from specdec.layers.moe_a8 import A8FusedMoE, fuse_a8_experts
from specdec.layers.quantization import WeightOnlyLinear, prepare_for_inference

needs_kernel = pytest.mark.skipif("woq_cpu.extension_a8() is None or moe_cpu.extension() is None",
                                  reason="no int8-activation kernel on this machine")
pytestmark = [pytest.mark.usefixtures("kernel_isa"), needs_kernel]

H, I, E = 256, 256, 8  # one GGUF super-block (256 inputs) per row of either linear
KINDS = ("w4a8", "w8a8", "q4_k_m", "mixed-forms")


_plans_for = [None]


@pytest.fixture(autouse=True)
def a8_plans_of_this_build(kernel_isa):
    """The w4a8 / w8a8 linears' per-row variant plan is measured once per process for the build found
    then (variant names differ between builds): a test under another SPECDEC_CPU_ISA measures its own."""
    def clear(isa):
        cpu_kernel_choice.clear_a8_timings()
        _plans_for[0] = isa

    if _plans_for[0] != kernel_isa:
        clear(kernel_isa)
    yield
    if kernel_isa != (woq_cpu.cpu_isas() or ["none"])[0]:  # leave the default build's plan to later tests
        clear(None)


def k_quant_scales(n: int, k: int, group: int, gen: torch.Generator, signed: bool,
                   factor: float | None = None) -> torch.Tensor:
    """GGUF K-quant group scales: int8 codes times an fp16 factor per 256 inputs (two-level form);
    ``factor``: one factor for all."""
    per = 256 // group
    d = ((torch.rand(n, k // 256, 1, generator=gen) - (0.5 if signed else 0.0)) * 0.02).half().float()
    if factor is not None:
        d = torch.full_like(d, factor)
    codes = torch.randint(-127 if signed else 0, 128 if signed else 64, (n, k // 256, per), generator=gen).float()
    codes[..., 1] = -128 if signed else 63
    return (d * codes).reshape(n, -1)


def expert_weights(kind: str, expert: int, gen: torch.Generator) -> tuple:
    """(gate_up, down) quantized weights of one expert: ``kind`` w4a8 (int4, groups of 32), w8a8 (int8 per
    channel), q4_k_m (llama.cpp's Q4_K gate_up and Q6_K down: two-level scales), mixed-forms (q4_k_m with
    expert 0's scales fp16-exact instead: the experts' compact forms differ)."""
    up, down = torch.randn(2 * I, H, generator=gen) * 0.05, torch.randn(H, I, generator=gen) * 0.05
    if kind == "w4a8":
        return quantize_int4(up, 32), quantize_int4(down, 32)
    if kind == "w8a8":
        return quantize_int8(up), quantize_int8(down)
    q_up, q_down = quantize_int4(up, 32), quantize_int8(down, 16)
    if kind == "mixed-forms" and expert == 0:  # power-of-two factors: the scales are fp16-exact too
        return (Int4Weight(q_up.packed, k_quant_scales(2 * I, H, 32, gen, False, 2.0 ** -8),
                           -k_quant_scales(2 * I, H, 32, gen, False, 2.0 ** -9)),
                Int8Weight(q_down.qweight, k_quant_scales(H, I, 16, gen, True, 2.0 ** -10)))
    return (Int4Weight(q_up.packed, k_quant_scales(2 * I, H, 32, gen, False), -k_quant_scales(2 * I, H, 32, gen, False)),
            Int8Weight(q_down.qweight, k_quant_scales(H, I, 16, gen, True)))


def a8_moe(kind: str, top_k: int = 3, seed: int = 0) -> nn.ModuleDict:
    """{"mlp": SparseMoE} of int8-activation experts; router weights large enough that rows route apart."""
    gen = torch.Generator().manual_seed(seed)
    router = TopKRouter(H, E, top_k)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=gen) * 0.3)
    experts = []
    for e in range(E):
        expert = Expert(H, I)
        gate_up, down = expert_weights(kind, e, gen)
        expert.gate_up_proj = WeightOnlyLinear(gate_up, None, torch.float32, int8_activations=True)
        expert.down_proj = WeightOnlyLinear(down, None, torch.float32, int8_activations=True)
        experts.append(expert)
    return nn.ModuleDict({"mlp": SparseMoE(router, experts)})


def fused(kind: str, **kw) -> tuple[A8FusedMoE, nn.ModuleDict]:
    holder = a8_moe(kind, **kw)
    assert fuse_a8_experts(holder) == 1
    assert isinstance(holder["mlp"], A8FusedMoE)
    return holder["mlp"], holder


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 8, 40])
def test_fused_layer_equals_the_expert_by_expert_layer_bitwise(kind, rows):
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows)) * 2
    before = a8_moe(kind)["mlp"]
    with torch.no_grad():
        expected = before(x)
        layer, _ = fused(kind)
        out = layer(x)
        routing = layer.gate(x)
        again = grouped_experts(x, routing, layer.experts)  # the experts now read the stacked weights
        reference = reference_moe(x, routing, layer.experts)
    assert torch.equal(out, expected) and torch.equal(again, expected)
    assert not torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-6 * reference.abs().max().item())
    if rows == 40:  # 120 pairs over 8 experts: some expert runs more rows than one kernel pass holds
        assert torch.bincount(routing.expert_ids.flatten()).max() > 16


@pytest.mark.parametrize("kind", ["w4a8", "q4_k_m"])
def test_a_row_alone_equals_it_among_other_rows_bitwise(kind):
    layer, _ = fused(kind)
    x = torch.randn(8, H, generator=torch.Generator().manual_seed(5))
    x[3] *= 100  # one row's magnitude must not reach the others
    with torch.no_grad():
        full = layer(x)
        for m in (1, 3, 8):
            assert torch.equal(layer(x[:m]), full[:m])
        for i in range(8):
            assert torch.equal(layer(x[i:i + 1]), full[i:i + 1])


def test_amx_tiles_give_the_vnni_values_bitwise():
    layer, _ = fused("q4_k_m")
    if not moe_cpu.has_amx(layer._ops):
        pytest.skip("the MoE kernel runs without AMX here")
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(2))
    routing = layer.gate(x)
    args = (layer._ops, x, routing.expert_ids, routing.weights, layer.gate_up, layer.down)
    vnni, touched = moe_cpu.moe_a8(*args, amx_min_rows=(None, None))
    for thresholds in ((1, 1), (4, None), (None, 2)):
        amx, again = moe_cpu.moe_a8(*args, amx_min_rows=thresholds)
        assert torch.equal(amx, vnni) and again == touched


def test_experts_read_is_the_union_of_the_rows_choices():
    layer, _ = fused("w4a8", top_k=2)
    x = torch.randn(6, H)
    ids = torch.tensor([[0, 3], [3, 0], [5, 0], [0, 3], [3, 5], [7, 0]])
    routing = Routing(torch.full((6, 2), 0.5), ids)
    out, touched = moe_cpu.moe_a8(layer._ops, x, ids, routing.weights, layer.gate_up, layer.down)
    assert touched == 4
    assert torch.equal(out, grouped_experts(x, routing, layer.experts))
    layer, holder = fused("w4a8", top_k=2)
    layer(x)
    assert moe_layers(holder) == [layer] and experts_read(holder) == layer.stats.last_experts_read
    assert layer.stats.last_experts_read == len(torch.unique(layer.gate(x).expert_ids))
    assert layer.stats.num_pairs == 12 and layer.stats.num_calls == 1
    with pytest.raises(RuntimeError, match="expert id 8 outside"):
        moe_cpu.moe_a8(layer._ops, x, torch.full((6, 2), 8), routing.weights, layer.gate_up, layer.down)


def test_the_experts_keep_one_copy_of_their_weights():
    layer, _ = fused("mixed-forms")
    for e, expert in enumerate(layer.experts):
        for linear, stacked in ((expert.gate_up_proj, layer.gate_up), (expert.down_proj, layer.down)):
            assert linear.a8_layout.data_ptr() == stacked.weight[e].data_ptr()
            assert linear.a8_scales.data_ptr() == stacked.scales[e].data_ptr()
    # expert 0's scales (fp16-exact) took the others' two-level form: the same values in other bytes
    assert layer.gate_up.scales.dtype == torch.int8 and layer.down.scales.dtype == torch.int8
    assert layer.gate_up.scale_factors is not None and layer.down.scale_factors is not None


def test_layers_the_kernel_does_not_take_stay_expert_by_expert():
    holder = a8_moe("w4a8")
    holder["mlp"].experts[2].down_proj = WeightOnlyLinear(quantize_int8(torch.randn(H, I)), torch.zeros(H),
                                                          torch.float32, int8_activations=True)
    assert fuse_a8_experts(holder) == 0 and isinstance(holder["mlp"], SparseMoE)  # a bias
    holder = a8_moe("w4a8")
    holder["mlp"].experts[0].gate_up_proj = WeightOnlyLinear(quantize_int4(torch.randn(2 * I, H), 32), None,
                                                             torch.float32)  # weight-only
    assert fuse_a8_experts(holder) == 0


def test_w4a8_quantization_fuses_a_float_moe_layer():
    torch.manual_seed(0)
    holder = nn.ModuleDict({"mlp": SparseMoE(TopKRouter(H, E, 2), [Expert(H, I) for _ in range(E)])})
    with torch.no_grad():
        for p in holder.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(4, H)
    with torch.no_grad():
        dense = holder["mlp"](x)
        prepare_for_inference(holder, "w4a8", torch.device("cpu"))
        layer = holder["mlp"]
        assert isinstance(layer, A8FusedMoE)
        out = layer(x)
        assert torch.equal(out, layer.unfused()(x))
    assert (out - dense).abs().max() < 0.3 * dense.abs().max()  # int4 weights, int8 activations
