"""The int8 / int4 AVX-512 CPU kernel against its pure-torch reference (woq_format.reference_linear).

Tolerance, float32: kernel and reference dequantise each weight with at most two roundings and
sum the K products in different orders, so both lie within the standard bound for a float32 dot
product, (K + 2) * 2^-24 * sum_k |x_k w_k| (Higham, Accuracy and Stability, 3.1), of the exact
value; the float64 dot product of the dequantized weight stands in for it (its own error is
~2^-53 K). Row independence is asserted bit for bit.
"""
import warnings

import pytest
import torch

from specdec.kernels import woq_cpu
from specdec.kernels.woq_format import (
    Int4Weight,
    Int8Weight,
    quantize_int4,
    quantize_int8,
    reference_linear,
)

needs_kernel = pytest.mark.skipif(not woq_cpu.available(), reason="no AVX-512 kernel on this machine")

FORMATS = {
    "int8-channel": lambda w: quantize_int8(w),
    "int8-g32": lambda w: quantize_int8(w, 32),
    "int4-g32": lambda w: quantize_int4(w, 32),
    "int4-g64": lambda w: quantize_int4(w, 64),
    "int4-g128": lambda w: quantize_int4(w, 128),
}


def error_bound(x: torch.Tensor, weight) -> torch.Tensor:
    magnitude = x.reshape(-1, x.shape[-1]).abs().double() @ weight.dequantize(torch.float64).abs().T
    return 2 * (x.shape[-1] + 2) * 2.0 ** -24 * magnitude + 1e-30  # kernel and reference each within the bound


def random_case(fmt: str, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, :3] *= 20  # outlier inputs: scales differ a lot between groups
    return FORMATS[fmt](w), g


@needs_kernel
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 9])
def test_kernel_matches_the_reference_within_the_float32_bound(fmt, rows):
    weight, g = random_case(fmt, n=37, k=256)
    x = torch.randn(rows, 256, generator=g) * 3
    assert woq_cpu.supports(weight)
    y, ref = woq_cpu.linear(x, weight).double(), reference_linear(x, weight).double()
    assert (y - ref).abs().le(error_bound(x, weight)).all(), (y - ref).abs().max()
    exact = x.double() @ weight.dequantize(torch.float64).T
    assert (y - exact).abs().le(error_bound(x, weight) / 2).all()


@needs_kernel
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_row_i_of_an_m_row_call_equals_the_one_row_call_bitwise(fmt):
    weight, g = random_case(fmt, n=67, k=512, seed=1)
    kw = weight
    x = torch.randn(9, 512, generator=g)
    x[4] *= 1000  # one row's magnitude must not leak into the others
    full = woq_cpu.linear(x, kw)
    for m in range(1, 10):
        part = woq_cpu.linear(x[:m], kw)
        assert torch.equal(part, full[:m])
    for i in range(9):
        assert torch.equal(woq_cpu.linear(x[i:i + 1], kw), full[i:i + 1])


@needs_kernel
@pytest.mark.parametrize("fmt", ["int8-channel", "int4-g128"])
def test_bfloat16_activations_compute_on_their_float32_values(fmt):
    weight, g = random_case(fmt, n=10, k=128, seed=2)
    kw = weight
    x = torch.randn(3, 2, 128, generator=g).to(torch.bfloat16)
    y = woq_cpu.linear(x, kw)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 2, 10)
    # the same float32 inputs give the float32 result; bf16 output rounding only
    torch.testing.assert_close(y, woq_cpu.linear(x.float(), kw).to(torch.bfloat16), rtol=0, atol=0)


def test_formats_dequantize_as_documented():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(6, 64, generator=g)
    q8 = quantize_int8(w, 32)
    assert isinstance(q8, Int8Weight) and q8.scales.shape == (6, 2)
    assert (q8.dequantize() - w).abs().max() <= q8.scales.max() / 2 + 1e-6
    q4 = quantize_int4(w, 32)
    assert isinstance(q4, Int4Weight) and q4.packed.shape == (6, 32) and (q4.offsets <= 0).all()
    assert (q4.dequantize() - w).abs().max() <= q4.scales.max() / 2 + 1e-6
    # Q4_0 nibble order: byte j of a block holds inputs j (low) and j + 16 (high)
    values = q4.unpacked()
    assert torch.equal(q4.packed[:, 3] & 0xF, values[:, 3]) and torch.equal(q4.packed[:, 3] >> 4, values[:, 19])


def test_shapes_the_kernel_does_not_take_use_the_reference():
    weight = quantize_int8(torch.randn(4, 40), 8)  # groups of 8 inputs: not a multiple of 16
    assert not woq_cpu.supports(weight)
    x = torch.randn(2, 40)
    assert torch.equal(woq_cpu.linear(x, weight), reference_linear(x, weight))


def test_a_failed_build_warns_once_and_falls_back(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr(woq_cpu, "_cpu_flags", lambda: set(woq_cpu._CPU_FLAGS))
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    woq_cpu.extension.cache_clear()
    try:
        with pytest.warns(UserWarning, match="could not build the int8/int4 CPU kernel.*c\\+\\+"):
            assert woq_cpu.extension() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert woq_cpu.extension() is None  # cached: no second warning
            weight = quantize_int8(torch.randn(4, 64))
            x = torch.randn(1, 64)
            assert torch.equal(woq_cpu.linear(x, weight), reference_linear(x, weight))
    finally:
        woq_cpu.extension.cache_clear()
