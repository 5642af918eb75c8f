"""Fp8Linear (e4m3 weights, per-output-channel scales) against F.linear: the dequantise path
exactly, the torch._scaled_mm path (activations quantised per row) within fp8 rounding, both
formats (OCP e4m3fn, AMD gfx942's e4m3fnuz), and against the bf16 layer it replaces."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specdec.layers.fp8 import Fp8Linear, fp8_dtype_for, quantize_rows, scaled_mm_supported
from specdec.layers.quantization import prepare_for_inference

FORMATS = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]


@pytest.mark.parametrize("fp8_dtype", FORMATS)
def test_weights_round_to_e4m3_with_one_scale_per_output_channel(fp8_dtype):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    with torch.no_grad():
        lin.weight[3] *= 100.0  # one loud channel must not cost the others their precision
    q = Fp8Linear(lin, fp8_dtype=fp8_dtype)
    fmax = torch.finfo(fp8_dtype).max
    assert q.weight_fp8.dtype == fp8_dtype and q.scales.shape == (48,)
    assert torch.equal(q.weight_fp8.float().abs().amax(dim=1), torch.full((48,), fmax))  # each row spans the range
    w, deq = lin.weight.detach(), q.dequantized_weight()
    # 3 mantissa bits: relative error <= 2^-4, plus half the subnormal spacing near zero
    assert ((deq - w).abs() <= w.abs() / 16 + q.scales[:, None] * 2 ** -9).all()
    assert not torch.equal(deq, w)


@pytest.mark.parametrize("rows", [1, 6, 33])
def test_dequantise_path_equals_f_linear_on_the_dequantised_weight(rows):
    torch.manual_seed(1)
    lin = nn.Linear(64, 32)
    q = Fp8Linear(lin)
    assert not q.use_scaled_mm  # CPU: emulation
    x = torch.randn(2, rows, 64)
    torch.testing.assert_close(q(x), F.linear(x, q.dequantized_weight(), lin.bias), rtol=0, atol=0)


@pytest.mark.parametrize("fp8_dtype", FORMATS)
def test_scaled_mm_path_matches_its_emulation(fp8_dtype):
    """The GPU path's arithmetic (activations and weights in fp8, row and column scales), run
    through torch._scaled_mm where this PyTorch has it on CPU."""
    torch.manual_seed(2)
    lin = nn.Linear(64, 48)
    q = Fp8Linear(lin, fp8_dtype=fp8_dtype, use_scaled_mm=True)
    x = torch.randn(5, 64)
    try:
        out = q(x)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run {fp8_dtype} on CPU here: {e}")
    xq, xs = quantize_rows(x, fp8_dtype)
    emulated = F.linear(xq.float() * xs, q.dequantized_weight(), lin.bias)
    torch.testing.assert_close(out, emulated, rtol=1e-2, atol=1e-2)  # bf16 output of _scaled_mm
    ref = lin(x)
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()


def test_fp8_stays_close_to_the_bf16_layer_it_replaces():
    torch.manual_seed(3)
    lin = nn.Linear(128, 64).to(torch.bfloat16)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    out, ref = Fp8Linear(lin)(x).float(), lin(x).float()
    assert out.dtype == torch.float32 and Fp8Linear(lin)(x).dtype == torch.bfloat16
    rel = (out - ref).norm() / ref.norm()
    assert 1e-4 < rel < 0.05  # fp8 rounding shows, and stays a few percent


def test_device_choices_on_cpu_and_prepare_swaps_every_linear():
    cpu = torch.device("cpu")
    assert fp8_dtype_for(cpu) == torch.float8_e4m3fn and not scaled_mm_supported(cpu)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    prepare_for_inference(model, "fp8", cpu)
    assert isinstance(model[0], Fp8Linear) and isinstance(model[2][0], Fp8Linear)


def test_a_failing_scaled_mm_falls_back_to_dequantising_with_a_warning(monkeypatch):
    torch.manual_seed(4)
    lin = nn.Linear(32, 16)
    q = Fp8Linear(lin, use_scaled_mm=True)
    x = torch.randn(3, 32)

    def unsupported(*args, **kwargs):  # what a build without row-wise fp8 for the device does
        raise RuntimeError("row-wise scaling is not supported on this device")

    monkeypatch.setattr(torch, "_scaled_mm", unsupported)
    with pytest.warns(UserWarning, match="dequantising"):
        out = q(x)
    assert not q.use_scaled_mm
    torch.testing.assert_close(out, F.linear(x, q.dequantized_weight(), lin.bias), rtol=0, atol=0)
