"""The int8-activation kernel's variants (``csrc/woq_a8_variants.h``, ``woq_a8_variants``): each equals
``a8_linear`` bit for bit and the reference within float32 rounding, for every format, scale form and
row count, and a row's result is the same alone and among M rows: the engine runs a different variant
at each row count, so speculative == plain depends on all of it."""
import pytest
import torch

from specdec.kernels.cpu import cpp_build, woq_a8_variants, woq_cpu
from specdec.kernels.cpu.woq_format import reference_linear_a8
from tests.kernels.cpu.test_woq_cpu import A8_FORMATS, COMPACT_KINDS, a8_case, a8_error_bound, compact_scales_case

needs_a8_kernel = pytest.mark.skipif("woq_cpu.extension_a8() is None", reason="no int8-activation kernel here")


def other_variants(int4: bool) -> dict:
    """The variants besides the default (AMX included where it runs): what is compared with it."""
    ops = woq_a8_variants.variant_ops(int4)
    return {name: op for name, op in ops.items() if name != woq_a8_variants.default_variant()}


@needs_a8_kernel
@pytest.mark.parametrize("fmt", list(A8_FORMATS))
@pytest.mark.parametrize("k", [256, 640])
def test_every_variant_equals_the_default_kernel_bitwise_and_the_reference_within_rounding(fmt, k):
    weight, x = a8_case(fmt, n=37, k=k, rows=17, seed=k)
    x[4] *= 1000  # one row's magnitude must not leak into the others
    kw = woq_cpu.A8Weight.prepare(weight)
    args = woq_cpu.a8_kernel_args(kw)
    variants = other_variants(kw.int4)
    if woq_cpu.build_args(None, a8=True)[0] == "avx512":  # where a VNNI build runs, vnni256 runs every format
        assert "vnni256" in variants and ("vnni512-bcast" in variants) == kw.int4
    bound = a8_error_bound(x, weight)
    ref = reference_linear_a8(x, weight).double()
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17):  # one pass, a full pass of 9, passes plus a remainder
        expected = woq_cpu.linear_a8(x[:rows], kw)
        for name, op in variants.items():
            got = op(x[:rows], *args, None)
            assert torch.equal(got, expected), (name, rows, (got - expected).abs().max())
            assert (got.double() - ref[:rows]).abs().le(bound[:rows]).all(), name


@needs_a8_kernel
@pytest.mark.parametrize("int4", [True, False])
def test_every_variant_gives_a_row_alone_the_value_it_has_among_m_rows(int4):
    weight, x = a8_case("w4a8-g32" if int4 else "w8a8-g16", n=67, k=576, rows=12, seed=1)
    x[4] *= 1000
    kw = woq_cpu.A8Weight.prepare(weight)
    args = woq_cpu.a8_kernel_args(kw)
    for name, op in woq_a8_variants.variant_ops(int4).items():
        full = op(x, *args, None)
        for i in range(12):
            assert torch.equal(op(x[i:i + 1], *args, None), full[i:i + 1]), (name, i)
        assert torch.equal(op(x[[7, 2, 9]], *args, None), full[[7, 2, 9]]), name


@needs_a8_kernel
@pytest.mark.parametrize("kind", COMPACT_KINDS)
def test_every_variant_reads_compact_scales_as_their_float32_values(kind):
    weight, x = compact_scales_case(kind, rows=7)
    compact = woq_cpu.A8Weight.prepare(weight)
    assert compact.kernel_scales[0].dtype == (torch.int8 if "two-level" in kind else torch.float16)
    plain = woq_cpu.A8Weight(compact.weight, compact.scales, compact.offsets)  # float32 scales
    for name in woq_a8_variants.variant_ops(compact.int4):
        for rows in (1, 7):
            assert torch.equal(woq_a8_variants.linear_a8_variant(x[:rows], compact, name),
                               woq_cpu.linear_a8(x[:rows], plain)), (name, rows)


@needs_a8_kernel
def test_a_bias_adds_as_torch_does_in_every_variant():
    weight, x = a8_case("w4a8-g32", n=37, k=256, rows=6, seed=3)
    bias = torch.randn(37, generator=torch.Generator().manual_seed(4))
    kw = woq_cpu.A8Weight.prepare(weight)
    for name in woq_a8_variants.variant_ops(True):
        assert torch.equal(woq_a8_variants.linear_a8_variant(x, kw, name, bias), woq_cpu.linear_a8(x, kw) + bias)


@needs_a8_kernel
def test_a_variant_that_does_not_run_a_format_here_is_refused_by_name():
    weight, x = a8_case("w8a8-channel", n=16, k=128, rows=1)
    with pytest.raises(ValueError, match="'bf16' does not run w8a8 here"):
        woq_a8_variants.linear_a8_variant(x, woq_cpu.A8Weight.prepare(weight), "bf16")


@needs_a8_kernel
def test_the_bf16_variant_is_offered_only_where_the_cpu_has_avx512_bf16(monkeypatch):
    if woq_cpu.build_args(None, a8=True)[0] != "avx512":
        pytest.skip("the AVX2 build has its one kernel")
    flags = cpp_build.cpu_flags()
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: flags - {"avx512_bf16"})
    assert "bf16" not in woq_a8_variants.variant_ops(True)
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: flags | {"avx512_bf16"})
    assert "bf16" in woq_a8_variants.variant_ops(True) and "bf16" not in woq_a8_variants.variant_ops(False)


def test_the_forcing_variable_takes_known_names_only(monkeypatch):
    monkeypatch.setenv(woq_a8_variants.FORCE_ENV, "vnni256")
    assert woq_a8_variants.forced_variant() == "vnni256"
    monkeypatch.setenv(woq_a8_variants.FORCE_ENV, "avx1024")
    with pytest.raises(ValueError, match="SPECDEC_A8_KERNEL='avx1024': must be one of"):
        woq_a8_variants.forced_variant()
    monkeypatch.delenv(woq_a8_variants.FORCE_ENV)
    assert woq_a8_variants.forced_variant() is None


def test_the_avx2_build_offers_its_one_kernel(kernel_isa):
    if kernel_isa != "avx2":
        pytest.skip("the AVX2 build is tested where it is asked for")
    assert list(woq_a8_variants.variant_ops(True, amx=False)) == ["avx2"]
    assert list(woq_a8_variants.variant_ops(False, amx=False)) == ["avx2"]
