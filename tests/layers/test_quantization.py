"""Packed bf16 and int8 linears against F.linear on the original / dequantized weights."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec.layers.norm import RMSNorm
from specdec.layers.quantization import Int8Linear, PackedLinear, _can_pack, prepare_for_inference


@pytest.mark.parametrize("rows", [1, 6, 33])
def test_int8_linear_matches_dequantized_reference(rows):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    q = Int8Linear(lin)
    x = torch.randn(rows, 64)
    expected = F.linear(x, q.dequantized_weight(), q.bias)
    torch.testing.assert_close(q(x), expected, rtol=1e-4, atol=1e-4)
    # and the quantization error itself is small relative to the weights
    err = (q.dequantized_weight() - lin.weight).abs().max() / lin.weight.abs().max()
    assert err < 1 / 127


@pytest.mark.skipif(not _can_pack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 packing here")
@pytest.mark.parametrize("rows", [1, 6, 40])
def test_packed_linear_equals_f_linear(rows):
    torch.manual_seed(0)
    lin = nn.Linear(128, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 128, dtype=torch.bfloat16)
    torch.testing.assert_close(PackedLinear(lin)(x).float(), F.linear(x, lin.weight, lin.bias).float(),
                               rtol=2e-2, atol=2e-2)


def test_prepare_for_inference_int8_swaps_every_linear():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    prepare_for_inference(model, "int8", torch.device("cpu"))
    assert isinstance(model[0], Int8Linear) and isinstance(model[2][0], Int8Linear)
    with pytest.raises(ValueError, match="quantization"):
        prepare_for_inference(nn.Sequential(nn.Linear(2, 2)), "int3", torch.device("cpu"))


def test_rms_norm_fused_matches_reference():
    torch.manual_seed(0)
    norm = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    x = torch.randn(5, 32)
    torch.testing.assert_close(norm(x), norm.reference(x), rtol=1e-5, atol=1e-5)
    res = torch.randn(5, 32)
    out, new_res = norm(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(out, norm.reference(x + res), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 6])
def test_dynamic_int8_linear_is_close_to_float(rows):
    from specdec.layers.quantization import DynamicInt8Linear

    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=True)
    x = torch.randn(rows, 64)
    out, ref = DynamicInt8Linear(lin)(x), lin(x)
    # weights and activations both quantized to 8 bits: a few percent of the output scale
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
    assert not torch.equal(out, ref)
