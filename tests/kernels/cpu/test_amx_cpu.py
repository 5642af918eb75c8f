"""The AMX bf16 kernel (``amx_cpu.amx_bf16_linear``) against its pure-torch reference, on CPUs with AMX,
and its detection from the CPU flags (faked) everywhere.

Tolerance: the kernel sums bf16 x bf16 products (exact in float32) in float32 in AMX's order, the
reference (``F.linear`` on the bf16-rounded x) in its own; both lie within (K + 2) * 2^-24 * sum |x w|
of the exact float64 sum (Higham 3.1). Row independence is asserted bit for bit.
"""
import pytest
import torch
import torch.nn.functional as F

from specdec.kernels.cpu import amx_cpu
from specdec.kernels.cpu.woq_cpu import pack_bf16_pairs

needs_amx = pytest.mark.skipif("not amx_cpu.available()", reason="no AMX (amx_tile, amx_bf16) on this CPU")


def test_amx_is_detected_from_the_tile_and_bf16_flags():
    base = frozenset({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
    assert not amx_cpu.cpu_has_amx(base)  # Zen 4 / Zen 5: bf16 dot products, no tiles
    assert not amx_cpu.cpu_has_amx(base | {"amx_tile"})
    assert amx_cpu.cpu_has_amx(base | {"amx_tile", "amx_bf16", "amx_int8"})  # Sapphire Rapids
    assert not amx_cpu.cpu_has_amx(frozenset({"amx_tile", "amx_bf16"}))  # the AVX-512 base is needed too


def _case(n: int, k: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g) * 3
    return w, x


@needs_amx
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 40])
@pytest.mark.parametrize("n, k", [(48, 64), (96, 1536)])
def test_amx_bf16_is_the_product_of_bf16_rounded_rows_within_the_float32_bound(rows, n, k):
    w, x = _case(n, k, rows)
    xb = x.to(torch.bfloat16).double()
    exact = xb @ w.double().T
    bound = 2 * (k + 2) * 2.0 ** -24 * (xb.abs() @ w.double().abs().T) + 1e-30
    out = amx_cpu.amx_bf16_linear(x, pack_bf16_pairs(w))
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    assert (out.double() - exact).abs().le(bound).all()
    ref = F.linear(x.to(torch.bfloat16).float(), w.float())
    assert (ref.double() - exact).abs().le(bound).all()


@needs_amx
def test_amx_bf16_row_i_of_an_m_row_call_equals_the_one_row_call_bitwise():
    w, x = _case(64, 256, 33)
    packed = pack_bf16_pairs(w)
    whole = amx_cpu.amx_bf16_linear(x, packed)
    for i in range(33):
        assert torch.equal(whole[i:i + 1], amx_cpu.amx_bf16_linear(x[i:i + 1], packed))


@needs_amx
def test_amx_bf16_adds_the_bias_and_returns_x_s_dtype_and_shape():
    w, x = _case(32, 128, 6)
    bias = torch.randn(32)
    packed = pack_bf16_pairs(w)
    out = amx_cpu.amx_bf16_linear(x.view(2, 3, 128), packed, bias)
    assert out.shape == (2, 3, 32) and torch.equal(out.view(6, 32), amx_cpu.amx_bf16_linear(x, packed) + bias)
    assert amx_cpu.amx_bf16_linear(x.to(torch.bfloat16), packed).dtype == torch.bfloat16


def test_amx_bf16_without_the_kernel_gives_the_reference_values(monkeypatch):
    monkeypatch.setattr(amx_cpu, "extension", lambda: None)
    w, x = _case(32, 64, 3)
    out = amx_cpu.amx_bf16_linear(x, pack_bf16_pairs(w))
    torch.testing.assert_close(out, F.linear(x.to(torch.bfloat16).float(), w.float()), rtol=1e-6, atol=1e-6)


def test_amx_int8_is_detected_from_the_tile_int8_and_vnni_flags():
    base = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "amx_tile", "amx_bf16"})
    assert not amx_cpu.cpu_has_amx_int8(base)
    assert not amx_cpu.cpu_has_amx_int8(base | {"amx_int8"})
    assert amx_cpu.cpu_has_amx_int8(base | {"amx_int8", "avx512_vnni"})


needs_amx_a8 = pytest.mark.skipif("amx_cpu.extension_a8() is None", reason="no AMX int8 on this CPU")


@needs_amx_a8
@pytest.mark.parametrize("fmt", ["int4-g128", "int4-g32", "int8-channel", "int8-g16", "int4-g32-two-level"])
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 21])
def test_amx_int8_path_equals_the_vnni_kernel_bitwise(fmt, rows):
    """Exact: the integer sums are exact in both paths and the float scaling is the same instructions
    in the same order, which is what lets a layer switch paths by row count and stay row-consistent."""
    from specdec.kernels.cpu import woq_cpu
    from specdec.kernels.cpu.woq_format import quantize_int4, quantize_int8

    g = torch.Generator().manual_seed(1)
    w = torch.randn(80, 256, generator=g) * 0.05
    w[:, :3] *= 20
    if fmt == "int4-g32-two-level":  # GGUF Q4_K-like scales: int8 codes times a factor per 256 inputs
        q = quantize_int4(w, 32)
        factor = q.scales.reshape(80, -1, 8).amax(-1, keepdim=True) / 63
        q.scales = ((q.scales.reshape(80, -1, 8) / factor).round().clamp(1, 63) * factor).reshape(80, -1)
    else:
        q = {"int4-g128": lambda: quantize_int4(w, 128), "int4-g32": lambda: quantize_int4(w, 32),
             "int8-channel": lambda: quantize_int8(w), "int8-g16": lambda: quantize_int8(w, 16)}[fmt]()
    args = woq_cpu.a8_kernel_args(woq_cpu.A8Weight.prepare(q))
    x = torch.randn(rows, 256, generator=g) * 3
    bias = torch.randn(80, generator=g)
    ops = amx_cpu.extension_a8()
    assert torch.equal(ops.a8_linear_amx(x, *args, bias), ops.a8_linear(x, *args, bias))
    assert torch.equal(ops.a8_linear_amx(x, *args, bias), woq_cpu.linear_a8(x, woq_cpu.A8Weight.prepare(q), bias))


@needs_amx_a8
@pytest.mark.parametrize("fmt", ["int4-g128", "int8-channel", "int8-g16"])
@pytest.mark.parametrize("rows", [5, 16, 21, 40])
def test_amx_int8_path_over_input_chunks_and_a_shifted_last_pass_equals_the_vnni_kernel_bitwise(fmt, rows):
    """K = 2176 runs as two chunks of inputs (1088 + 1088; a group of 128 and the per-channel group
    straddle the boundary), and M = 21 or 40 ends with a 16-row pass that overlaps the pass before it:
    every row still equals the VNNI kernel's, and N = 40 ends in a partial block."""
    from specdec.kernels.cpu import woq_cpu
    from specdec.kernels.cpu.woq_format import quantize_int4, quantize_int8

    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 2176, generator=g) * 0.05
    q = {"int4-g128": lambda: quantize_int4(w, 128), "int8-channel": lambda: quantize_int8(w),
         "int8-g16": lambda: quantize_int8(w, 16)}[fmt]()
    args = woq_cpu.a8_kernel_args(woq_cpu.A8Weight.prepare(q))
    x = torch.randn(rows, 2176, generator=g)
    ops = amx_cpu.extension_a8()
    out = ops.a8_linear_amx(x, *args, None)
    assert torch.equal(out, ops.a8_linear(x, *args, None))
    assert torch.equal(out[-1:], ops.a8_linear_amx(x[-1:], *args, None))


@needs_amx_a8
@pytest.mark.parametrize("rows", [7, 40])
def test_amx_int8_path_on_two_threads_equals_the_vnni_kernel_bitwise(rows):
    """Each thread configures its own tiles (a tile configuration is per thread; a worker thread that
    runs a tile instruction without one faults)."""
    from specdec.kernels.cpu import woq_cpu
    from specdec.kernels.cpu.woq_format import quantize_int4

    g = torch.Generator().manual_seed(3)
    args = woq_cpu.a8_kernel_args(woq_cpu.A8Weight.prepare(quantize_int4(torch.randn(96, 512, generator=g), 32)))
    x = torch.randn(rows, 512, generator=g)
    ops = amx_cpu.extension_a8()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(ops.a8_linear_amx(x, *args, None), ops.a8_linear(x, *args, None))
    finally:
        torch.set_num_threads(threads)


@needs_amx_a8
@pytest.mark.parametrize("fmt, k", [("int4-g32-two-level", 768), ("int4-g32", 320), ("int4-g128", 384),
                                    ("int8-g16", 320), ("int8-channel", 320)])
def test_amx_int8_path_equals_the_vnni_kernel_bitwise_at_every_row_count_to_130(fmt, k):
    """M = 1 .. 130: one partial tile pass, then 16-row passes ending in one that overlaps the pass
    before it; K = 320 gives an odd number of unit pairs (the tile products alternate between two
    pairs of C tiles), int8 groups of 16 run units of 16 inputs, N = 40 ends in a partial block. The
    VNNI kernel's row i does not depend on the call's other rows, so one 130-row call is the oracle."""
    from specdec.kernels.cpu import woq_cpu
    from specdec.kernels.cpu.woq_format import quantize_int4, quantize_int8

    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, k, generator=g) * 0.05
    if fmt == "int4-g32-two-level":
        q = quantize_int4(w, 32)
        for name in ("scales", "offsets"):
            v = getattr(q, name).reshape(40, -1, 8)
            factor = v.abs().amax(-1, keepdim=True) / 63
            setattr(q, name, ((v / factor).round() * factor).reshape(40, -1))
    else:
        q = {"int4-g32": lambda: quantize_int4(w, 32), "int4-g128": lambda: quantize_int4(w, 128),
             "int8-g16": lambda: quantize_int8(w, 16), "int8-channel": lambda: quantize_int8(w)}[fmt]()
    weight = woq_cpu.A8Weight.prepare(q)
    if fmt == "int4-g32-two-level":
        assert weight.kernel_scales[0].dtype == torch.int8  # the two-level form, not a float fallback
    args = woq_cpu.a8_kernel_args(weight)
    x = torch.randn(130, k, generator=g) * 2
    ops = amx_cpu.extension_a8()
    vnni = ops.a8_linear(x, *args, None)
    for m in range(1, 131):
        assert torch.equal(ops.a8_linear_amx(x[:m], *args, None), vnni[:m]), f"M={m}"


@needs_amx_a8
def test_amx_int8_path_with_no_rows_returns_an_empty_result():
    from specdec.kernels.cpu import woq_cpu
    from specdec.kernels.cpu.woq_format import quantize_int4

    args = woq_cpu.a8_kernel_args(woq_cpu.A8Weight.prepare(quantize_int4(torch.randn(32, 128), 32)))
    assert amx_cpu.extension_a8().a8_linear_amx(torch.empty(0, 128), *args, None).shape == (0, 32)


def test_a_call_without_rows_returns_an_empty_result():
    """A step may hand a layer no rows (an EAGLE head with nothing to draft): every bf16 path returns
    [0, N] instead of running a kernel on nothing."""
    from torch import nn

    from specdec.layers.quantization import Bf16WeightLinear

    layer = Bf16WeightLinear(nn.Linear(64, 32, bias=False, dtype=torch.bfloat16))
    for dtype in (torch.float32, torch.bfloat16):
        out = layer(torch.empty(0, 64, dtype=dtype))
        assert out.shape == (0, 32) and out.dtype == dtype
