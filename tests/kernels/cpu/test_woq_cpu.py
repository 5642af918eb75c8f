"""The int8 / int4 CPU kernels (each instruction set this CPU runs: ``kernel_isa``) against their
pure-torch reference (woq_format.reference_linear).

Tolerance, float32: kernel and reference dequantise each weight with at most two roundings and
sum the K products in different orders, so both lie within the standard bound for a float32 dot
product, (K + 2) * 2^-24 * sum_k |x_k w_k| (Higham, Accuracy and Stability, 3.1), of the exact
value; the float64 dot product of the dequantized weight stands in for it (its own error is
~2^-53 K). Row independence is asserted bit for bit.
"""
import warnings

import pytest
import torch

from specdec.kernels.cpu import cpp_build, woq_cpu
from specdec.kernels.cpu.woq_format import (
    Int4Weight,
    Int8Weight,
    quantize_activations,
    quantize_int4,
    quantize_int8,
    reference_linear,
    reference_linear_a8,
    supports_a8,
)

needs_kernel = pytest.mark.skipif("not woq_cpu.available()", reason="no AVX-512 or AVX2 kernel on this machine")
pytestmark = pytest.mark.usefixtures("kernel_isa")

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

    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: frozenset(woq_cpu.ISAS["avx512"][1] + woq_cpu.ISAS["avx2"][1]))
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    woq_cpu._load.cache_clear()
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
        woq_cpu._load.cache_clear()


# ---- int8 activations (w8a8 / w4a8): csrc/woq_a8.cpp against woq_format.reference_linear_a8 ----

needs_a8_kernel = pytest.mark.skipif("woq_cpu.extension_a8() is None", reason="no AVX-512 VNNI or AVX2 kernel here")

A8_FORMATS = {
    "w8a8-channel": lambda w: quantize_int8(w),
    "w8a8-g32": lambda w: quantize_int8(w, 32),
    "w8a8-g16": lambda w: quantize_int8(w, 16),  # GGUF Q6_K's groups
    "w4a8-g32": lambda w: quantize_int4(w, 32),
    "w4a8-g64": lambda w: quantize_int4(w, 64),
    "w4a8-g128": lambda w: quantize_int4(w, 128),
}


def a8_case(fmt: str, n: int, k: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, :3] *= 20
    x = torch.randn(rows, k, generator=g) * 3
    x[:, 5] *= 50  # an outlier input: its block's scale differs from the others'
    x[0, 32:64] = 0  # an all-zero block: scale 0
    return A8_FORMATS[fmt](w), x


def a8_error_bound(x: torch.Tensor, weight) -> torch.Tensor:
    """Both sides add the same exact terms xs * (ws * I + wo * S) per 32-input block, in different
    orders, with a few roundings per term: within (K / 32 + 8) eps32 of the sum of their magnitudes."""
    q, xs = quantize_activations(x)
    k = x.shape[-1]
    w = weight.dequantize(torch.float64).abs()  # int8: |ws q|
    if isinstance(weight, Int4Weight):  # |ws| q + |wo|: the two terms are rounded apart
        w = (weight.unpacked().double() * weight.scales.double().repeat_interleave(weight.group_size, 1)
             + weight.offsets.double().abs().repeat_interleave(weight.group_size, 1))
    xd = (q.double().abs() * xs.double().repeat_interleave(32, 1))
    return 2 * (k / 32 + 8) * 2.0 ** -24 * (xd @ w.T) + 1e-30


def test_activation_quantization_is_as_documented():
    x = torch.tensor([[0.5, -1.0, 0.25, 1.5 / 127] + [0.0] * 28 + [0.0] * 32])
    q, scales = quantize_activations(x)
    assert scales.shape == (1, 2) and scales[0, 1] == 0 and torch.equal(q[0, 32:], torch.zeros(32, dtype=torch.int8))
    assert scales[0, 0] == torch.tensor(1.0) / torch.tensor(127.0)
    assert q[0, :4].tolist() == [64, -127, 32, 2]  # 63.5 -> 64 and 1.5 -> 2: round half to even


@needs_a8_kernel
@pytest.mark.parametrize("k", [64, 576, 896, 1536])
@pytest.mark.parametrize("int4", [False, True])
def test_kernel_quantizes_activations_as_the_reference_bitwise(k, int4):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(5, k, generator=g) * torch.logspace(-3, 3, k)[torch.randperm(k, generator=g)]
    x[1, 64:] = 0
    q, xs = quantize_activations(x)
    xq, scales, scaled_sums = woq_cpu.extension_a8().a8_quantize(x, int4)
    # int8 weights on VNNI take the activations + 128 as uint8; int4 (and AVX2) their int8 bits
    shifted = not int4 and woq_cpu.build_args(None, a8=True)[0] == "avx512"
    got = (xq.to(torch.int16) - 128).to(torch.int8) if shifted else xq.view(torch.int8)
    assert torch.equal(got, q)
    assert torch.equal(scales, xs)
    if int4:
        sums = q.view(5, k // 32, 32).sum(-1).float()
        assert torch.equal(scaled_sums, xs * sums)


@needs_a8_kernel
@pytest.mark.parametrize("fmt", list(A8_FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 9, 13])
@pytest.mark.parametrize("k", [256, 576, 896])
def test_a8_kernel_matches_its_reference_within_float32_rounding(fmt, rows, k):
    if fmt.endswith("g128") and k % 128:
        pytest.skip("groups of 128 do not divide K")
    weight, x = a8_case(fmt, n=37, k=k, rows=rows)
    y = woq_cpu.linear_a8(x, woq_cpu.A8Weight.prepare(weight)).double()
    ref = reference_linear_a8(x, weight).double()
    assert (y - ref).abs().le(a8_error_bound(x, weight)).all(), (y - ref).abs().max()
    # the quantized activations are a different function: far from the weight-only result in ulps
    assert not torch.equal(y.float(), reference_linear(x, weight))


@needs_a8_kernel
@pytest.mark.parametrize("fmt", list(A8_FORMATS))
def test_a8_row_i_of_an_m_row_call_equals_the_one_row_call_bitwise(fmt):
    weight, x = a8_case(fmt, n=67, k=640 if fmt.endswith("g128") else 576, rows=12, seed=1)
    x[4] *= 1000  # one row's magnitude must not leak into the others
    kw = woq_cpu.A8Weight.prepare(weight)
    full = woq_cpu.linear_a8(x, kw)
    for m in range(1, 13):
        assert torch.equal(woq_cpu.linear_a8(x[:m], kw), full[:m])
    for i in range(12):
        assert torch.equal(woq_cpu.linear_a8(x[i:i + 1], kw), full[i:i + 1])
    assert torch.equal(woq_cpu.linear_a8(x[[7, 2, 9]], kw), full[[7, 2, 9]])


@pytest.mark.parametrize("n", [1, 16, 21, 37])
def test_a8_layout_holds_16_outputs_x_4_bytes_per_vector_and_inverts(n):
    g = torch.Generator().manual_seed(n)
    k = 128
    q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    v4 = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    l8, l4 = woq_cpu.a8_int8_layout(q8), woq_cpu.a8_int4_layout(v4)
    padded = -(-n // 16) * 16
    assert l8.shape == (padded, k) and l4.shape == (padded, k // 2)
    flat8, flat4 = l8.reshape(-1), l4.reshape(-1)
    for o in range(n):
        blk, lane = divmod(o, 16)
        for j in (0, 5, k // 4 - 1):  # int8 vector j: inputs 4j .. 4j + 3, output lane at bytes 4 lane ..
            at = blk * 16 * k + 64 * j + 4 * lane
            assert torch.equal(flat8[at:at + 4], q8[o, 4 * j:4 * j + 4])
        for j in (0, 3, k // 8 - 1):  # int4 vector j: inputs 8j .. 8j + 7, low nibbles the first four
            at = blk * 8 * k + 64 * j + 4 * lane
            assert torch.equal(flat4[at:at + 4], v4[o, 8 * j:8 * j + 4] | (v4[o, 8 * j + 4:8 * j + 8] << 4))
    # the padding outputs are zero weights
    assert woq_cpu.a8_int8_values(l8, padded)[n:].eq(0).all() and woq_cpu.a8_int4_values(l4, padded)[n:].eq(0).all()
    assert torch.equal(woq_cpu.a8_int8_values(l8, n), q8)
    assert torch.equal(woq_cpu.a8_int4_values(l4, n), v4)


def test_a8_falls_back_to_the_reference_without_the_kernel(monkeypatch):
    weight, x = a8_case("w4a8-g32", n=9, k=128, rows=3)
    monkeypatch.setattr(woq_cpu, "extension_a8", lambda: None)
    assert torch.equal(woq_cpu.linear_a8(x, woq_cpu.A8Weight.prepare(weight)), reference_linear_a8(x, weight))
    assert not supports_a8(quantize_int8(torch.randn(4, 96)))  # K not a multiple of 64


def bf16_case(n: int, k: int, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    return w, torch.randn(rows, k, generator=g) * 3


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 9, 128, 129])
def test_bf16_kernel_is_the_float32_product_within_the_float32_bound(rows):
    w, x = bf16_case(37, 320, rows, seed=rows)
    y = woq_cpu.bf16_linear(x, w).double()
    exact = x.double() @ w.double().T
    bound = (320 + 2) * 2.0 ** -24 * (x.abs().double() @ w.double().abs().T) + 1e-30
    assert y.shape == (rows, 37) and (y - exact).abs().le(bound).all(), (y - exact).abs().max()


@needs_kernel
def test_bf16_kernel_row_i_of_an_m_row_call_equals_the_one_row_call_bitwise():
    w, x = bf16_case(67, 512, 9, seed=5)
    x[4] *= 1000
    full = woq_cpu.bf16_linear(x, w)
    for m in range(1, 10):
        assert torch.equal(woq_cpu.bf16_linear(x[:m], w), full[:m])
    for i in range(9):
        assert torch.equal(woq_cpu.bf16_linear(x[i:i + 1], w), full[i:i + 1])


def test_bf16_linear_the_kernel_does_not_take_is_f_linear_on_the_widened_weight():
    w, x = bf16_case(5, 48, 3, seed=6)  # K not a multiple of 32: the widened F.linear
    torch.testing.assert_close(woq_cpu.bf16_linear(x, w), torch.nn.functional.linear(x, w.float()), rtol=0, atol=0)


def test_bf16_linear_past_the_kernel_rows_widens_slices_of_outputs(monkeypatch):
    w, x = bf16_case(37, 64, 130, seed=7)
    monkeypatch.setattr(woq_cpu, "_WIDEN_ELEMENTS", 10 * 64)  # 10 outputs per slice: 4 slices
    y = woq_cpu.bf16_linear(x.view(2, 65, 64), w)
    assert y.shape == (2, 65, 37)
    torch.testing.assert_close(y.view(130, 37), x @ w.float().T, rtol=1e-6, atol=1e-5)


@pytest.fixture
def pairs_kernel(kernel_isa):
    """Skips where ``bf16_pairs_linear`` has no kernel (no avx512_bf16, or the AVX2 build under test)."""
    if not woq_cpu.bf16_pairs_available():
        pytest.skip("no avx512_bf16 kernel here")


def test_the_pair_layout_holds_each_16_outputs_2_inputs_in_one_run_and_unpacks_exactly():
    w = torch.arange(32 * 64, dtype=torch.float32).view(32, 64).to(torch.bfloat16)
    packed = woq_cpu.pack_bf16_pairs(w)
    assert packed.shape == (32, 64)
    flat = packed.reshape(-1)
    # block 1 (outputs 16..31), inputs 6 and 7: outputs 16..31 interleaved, at pair 3 of that block
    run = flat[16 * 64 + 3 * 32:16 * 64 + 4 * 32].view(16, 2)
    assert torch.equal(run, w[16:32, 6:8])
    assert torch.equal(woq_cpu.unpack_bf16_pairs(packed), w)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 130])
def test_bf16_pairs_kernel_is_the_product_of_bf16_rounded_rows_within_the_float32_bound(pairs_kernel, rows):
    w, x = bf16_case(80, 320, rows, seed=rows)  # 5 blocks of 16 outputs: a 4-block tile and a 1-block one
    bias = torch.randn(80)
    y = woq_cpu.bf16_pairs_linear(x, woq_cpu.pack_bf16_pairs(w), bias).double()
    xr = x.to(torch.bfloat16).double()  # the activations rounded to bf16, products exact in float32
    exact = xr @ w.double().T + bias.double()
    bound = (320 + 3) * 2.0 ** -24 * (xr.abs() @ w.double().abs().T + bias.double().abs()) + 1e-30
    assert y.shape == (rows, 80) and (y - exact).abs().le(bound).all(), (y - exact).abs().max()
    assert not torch.allclose(y, x.double() @ w.double().T + bias.double(), rtol=0, atol=1e-7)  # x was rounded


def test_bf16_pairs_kernel_row_i_of_an_m_row_call_equals_the_one_row_call_bitwise(pairs_kernel):
    w, x = bf16_case(64, 512, 13, seed=8)
    x[4] *= 1000
    packed = woq_cpu.pack_bf16_pairs(w)
    full = woq_cpu.bf16_pairs_linear(x, packed)
    for m in range(1, 14):
        assert torch.equal(woq_cpu.bf16_pairs_linear(x[:m], packed), full[:m])
    for i in range(13):
        assert torch.equal(woq_cpu.bf16_pairs_linear(x[i:i + 1], packed), full[i:i + 1])


def test_bf16_pairs_linear_without_the_kernel_gives_the_same_values(monkeypatch):
    w, x = bf16_case(48, 64, 5, seed=9)
    packed = woq_cpu.pack_bf16_pairs(w)
    kernel = woq_cpu.bf16_pairs_linear(x.view(5, 1, 64), packed)
    monkeypatch.setattr(woq_cpu, "bf16_pairs_available", lambda: False)
    reference = woq_cpu.bf16_pairs_linear(x.view(5, 1, 64), packed)
    assert reference.shape == kernel.shape == (5, 1, 48)
    torch.testing.assert_close(kernel, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(reference.view(5, 48), x.to(torch.bfloat16).float() @ w.float().T, rtol=0, atol=0)
    out = woq_cpu.bf16_pairs_linear(x.to(torch.bfloat16), packed)
    assert out.dtype == torch.bfloat16


def k_quant_scales(n: int, k: int, group: int, seed: int, signed: bool) -> torch.Tensor:
    """[n, k / group] float32 scales as a GGUF K-quant holds them: an fp16 factor per 256 inputs
    times small integer codes (Q4_K: 0..63, the largest 63; Q6_K: -128..127, the largest -128)."""
    g = torch.Generator().manual_seed(seed)
    per = 256 // group
    d = ((torch.rand(n, k // 256, 1, generator=g) - (0.5 if signed else 0.0)) * 0.02).half().float()
    lo, top = (-127, -128) if signed else (0, 63)
    codes = torch.randint(lo, 128 if signed else 64, (n, k // 256, per), generator=g).float()
    codes[..., 1] = top
    return (d * codes).reshape(n, -1)


def test_compact_scales_hold_the_same_values_in_fewer_bytes():
    fp16 = (torch.rand(4, 8) * 0.01).half().float()
    assert woq_cpu.compact_scales(fp16, 32)[0].dtype == torch.float16
    for group, signed in ((32, False), (16, True)):
        s = k_quant_scales(3, 512, group, seed=group, signed=signed)
        codes, factors = woq_cpu.compact_scales(s, group)
        assert codes.dtype == torch.int8 and factors.shape == (3, 2)
        assert torch.equal((codes.float().view(3, 2, -1) * factors[..., None]).reshape(3, -1), s)
    for offsets in (-k_quant_scales(3, 512, 32, seed=9, signed=False),):  # Q4_K's -dmin * m
        codes, factors = woq_cpu.compact_scales(offsets, 32)
        assert codes.dtype == torch.int8
    arbitrary = torch.rand(3, 16) * 0.01  # float32 values of no such form stay float32
    values, factors = woq_cpu.compact_scales(arbitrary, 32)
    assert values is arbitrary and factors is None


COMPACT_KINDS = ["int4-fp16", "int4-two-level", "int8-g16-two-level", "int8-g32-fp16"]


def compact_scales_case(kind: str, rows: int, n: int = 37, k: int = 768):
    """(a weight whose scales (and offsets) a compact form holds exactly: float16 or, "two-level", GGUF
    K-quant int8 codes times a factor per super-block; x [rows, k])."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, k, generator=g) * 3
    if kind.startswith("int4"):
        base = quantize_int4(torch.randn(n, k, generator=g) * 0.05, 32)
        if kind == "int4-fp16":
            scales, offsets = base.scales.half().float(), base.offsets.half().float()
        else:
            scales, offsets = k_quant_scales(n, k, 32, 4, False), -k_quant_scales(n, k, 32, 5, False)
        return Int4Weight(base.packed, scales, offsets), x
    group = 16 if "g16" in kind else 32
    base = quantize_int8(torch.randn(n, k, generator=g) * 0.05, group)
    scales = k_quant_scales(n, k, 16, 6, True) if group == 16 else base.scales.half().float()
    return Int8Weight(base.qweight, scales), x


@needs_a8_kernel
@pytest.mark.parametrize("kind", COMPACT_KINDS)
def test_a8_kernel_on_compact_scales_equals_it_on_float32_scales_bitwise(kind):
    weight, x = compact_scales_case(kind, rows=6)
    compact = woq_cpu.A8Weight.prepare(weight)
    expected = torch.int8 if "two-level" in kind else torch.float16
    assert compact.kernel_scales[0].dtype == expected
    assert compact.kernel_offsets is None or compact.kernel_offsets[0].dtype == expected
    plain = woq_cpu.A8Weight(compact.weight, compact.scales, compact.offsets)  # float32 scales
    for rows in (1, 6):
        assert torch.equal(woq_cpu.linear_a8(x[:rows], compact), woq_cpu.linear_a8(x[:rows], plain))


@needs_a8_kernel
@pytest.mark.parametrize("rows", [1, 6, 129])
def test_a_bias_in_the_kernels_adds_as_torch_does_bitwise(rows):
    weight, x = a8_case("w4a8-g32", n=37, k=256, rows=rows, seed=3)
    bias = torch.randn(37, generator=torch.Generator().manual_seed(4))
    kw = woq_cpu.A8Weight.prepare(weight)
    assert torch.equal(woq_cpu.linear_a8(x, kw, bias), woq_cpu.linear_a8(x, kw) + bias)
    w, x = bf16_case(37, 256, rows, seed=3)  # 129 rows: past the kernel, widened F.linear
    assert torch.equal(woq_cpu.bf16_linear(x, w, bias), woq_cpu.bf16_linear(x, w) + bias)
    with pytest.raises(RuntimeError, match="bias has 36 elements"):
        woq_cpu.linear_a8(x[:, :256], kw, bias[:36])


@needs_a8_kernel
def test_a_module_s_cached_kernel_arguments_follow_its_buffers():
    import copy

    from specdec.layers.quantization import W4A8Linear

    linear = torch.nn.Linear(256, 37)
    module = W4A8Linear(linear)
    x = torch.randn(2, 256)
    before = module(x)
    twin = copy.deepcopy(module)  # its own buffers: its calls must read them, not the original's
    twin.a8_scales.zero_() if twin.a8_scales.dtype != torch.int8 else twin.a8_scale_factors.zero_()
    twin.a8_offsets.zero_() if twin.a8_offsets.dtype != torch.int8 else twin.a8_offset_factors.zero_()
    assert torch.equal(twin(x), linear.bias.detach().expand(2, 37))
    assert torch.equal(module(x), before)


def test_the_kernels_are_built_for_the_best_instruction_set_the_cpu_runs(monkeypatch):
    avx512, avx2 = woq_cpu.ISAS["avx512"][1], woq_cpu.ISAS["avx2"][1]
    monkeypatch.delenv(woq_cpu.ISA_ENV, raising=False)
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: frozenset(avx512 + avx2))
    assert woq_cpu.cpu_isas() == ["avx512", "avx2"]
    assert woq_cpu.cpu_isas(a8=True) == ["avx2"]  # AVX-512 without VNNI: the int8-activation kernel's AVX2 form
    isa, flags, needs = woq_cpu.build_args(a8=True)
    assert isa == "avx2" and "-mavx2" in flags and "avx512_vnni" not in needs
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: frozenset(avx2))
    assert woq_cpu.build_args()[0] == "avx2"
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: frozenset({"sse4_2"}))
    assert woq_cpu.cpu_isas() == [] and woq_cpu.build_args()[0] == "avx512"  # its warning names what is missing
    monkeypatch.setenv(woq_cpu.ISA_ENV, "neon")
    with pytest.raises(ValueError, match="SPECDEC_CPU_ISA='neon'"):
        woq_cpu.build_args()
