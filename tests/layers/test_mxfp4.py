"""MXFP4 weights (gpt-oss's experts): the dequantisation equals transformers', quantisation rounds to
the nearest FP4 value, and the packed linear equals its reference at 4.25 bits per weight."""
from __future__ import annotations

import pytest
import torch

from specdec.layers.mxfp4 import Mxfp4Linear, dequantize_mxfp4, quantize_mxfp4

E = 4


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
