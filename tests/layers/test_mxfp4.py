"""MXFP4 experts (gpt-oss): the dequantisation equals transformers', the packed linear equals its
reference, memory is 4.25 bits per weight, and gpt-oss's MoE block built from a published-format
(packed) or float checkpoint matches transformers' ``GptOssMLP`` in float32."""
from __future__ import annotations

import pytest
import torch

from specdec.layers.mxfp4 import Mxfp4Linear, dequantize_mxfp4, quantize_mxfp4
from specdec.models.gpt_oss import gpt_oss_moe, install_experts

H, I, E = 64, 96, 4


def test_dequantize_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (E, 8, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(118, 134, (E, 8, 2), generator=gen, dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [E, 8, 64]
    assert torch.equal(dequantize_mxfp4(blocks, scales), ref)


def test_quantize_round_trips_representable_weights_and_rounds_to_the_nearest():
    w = torch.randn(16, 64)
    blocks, scales = quantize_mxfp4(w)
    deq = dequantize_mxfp4(blocks, scales)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(deq)), deq)  # a fixed point
    step = torch.ldexp(torch.ones(1), scales.float() - 127).repeat_interleave(32, dim=1)  # 1 unit at this scale
    assert ((deq - w).abs() <= step).all()  # FP4 spacing is at most 2 units (4 -> 6) at the top


@pytest.mark.parametrize("rows", [1, 5])
def test_packed_linear_equals_its_reference_and_uses_4_25_bits_per_weight(rows, monkeypatch):
    import specdec.layers.mxfp4 as mxfp4

    monkeypatch.setattr(mxfp4, "ROWS_PER_CHUNK", 48)  # several chunks, the last one partial
    blocks, scales = quantize_mxfp4(torch.randn(100, 64))
    bias = torch.randn(100)
    layer = Mxfp4Linear(blocks, scales, bias)
    x = torch.randn(rows, 64)
    ref = x @ dequantize_mxfp4(blocks, scales).T + bias
    torch.testing.assert_close(layer(x), ref, rtol=1e-6, atol=1e-6)
    assert layer.bits_per_weight() == 4.25
    assert not any(t.is_floating_point() and t.numel() >= 100 * 64 for t in layer.state_dict().values())


@pytest.mark.parametrize("packed", [True, False], ids=["mxfp4", "float"])
def test_gpt_oss_moe_matches_transformers(packed):
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = AutoConfig.for_model("gpt_oss", hidden_size=H, intermediate_size=I, num_local_experts=E,
                               num_experts_per_tok=2)
    torch.manual_seed(0)
    hf = GptOssMLP(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
        hf.router.weight.mul_(5.0)
        # MXFP4-representable expert weights, so the float and packed checkpoints hold one model
        blocks_gu, scales_gu = quantize_mxfp4(hf.experts.gate_up_proj.transpose(1, 2))  # rows: interleaved outputs
        blocks_d, scales_d = quantize_mxfp4(hf.experts.down_proj.transpose(1, 2))
        hf.experts.gate_up_proj.copy_(dequantize_mxfp4(blocks_gu, scales_gu).transpose(1, 2))
        hf.experts.down_proj.copy_(dequantize_mxfp4(blocks_d, scales_d).transpose(1, 2))
    biases = {"gate_up_proj_bias": hf.experts.gate_up_proj_bias.detach(),
              "down_proj_bias": hf.experts.down_proj_bias.detach()}
    if packed:
        tensors = dict(biases, gate_up_proj_blocks=blocks_gu, gate_up_proj_scales=scales_gu,
                       down_proj_blocks=blocks_d, down_proj_scales=scales_d)
    else:
        tensors = dict(biases, gate_up_proj=hf.experts.gate_up_proj.detach(), down_proj=hf.experts.down_proj.detach())
    ours = gpt_oss_moe(cfg)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.router.weight)
        ours.gate.bias.copy_(hf.router.bias)
    install_experts(ours, tensors)
    if packed:
        assert all(isinstance(e.gate_up_proj, Mxfp4Linear) and e.down_proj.bits_per_weight() == 4.25
                   for e in ours.experts)
    x = 3.0 * torch.randn(1, 20, H)
    with torch.no_grad():
        ref, _ = hf(x)
        out = ours(x[0])
    assert len(set(ours.gate(x[0]).expert_ids.flatten().tolist())) == E
    torch.testing.assert_close(out, ref[0], rtol=1e-5, atol=1e-5 * ref.abs().max().item())
