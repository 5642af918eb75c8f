"""The int8 / int4 weight-only CPU kernel, the bf16-weight float32 one and the bf16 dot-product one
(``csrc/woq_linear.cpp``: ``linear``, ``bf16_linear``, ``bf16_pairs_linear``) and the int8-activation
kernel (``csrc/woq_a8.cpp``, ``linear_a8``), each built on first use (``cpp_build``) for the best
instruction set this CPU runs: AVX-512 (the int8-activation kernel: AVX-512 VNNI) or AVX2 + FMA.

The AMX kernels (bf16 tiles on the pair layout, the int8-activation kernel's tile path) are in
``amx_cpu``.

Where none can run (no AVX2, no compiler, a failed build, ``SPECDEC_DISABLE_WOQ_KERNEL=1``)
``available()`` is False after one warning and ``linear`` runs ``woq_format.reference_linear``
(dequantize, then ``F.linear``: slower).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.kernels.cpu import cpp_build
from specdec.kernels.cpu.woq_format import (
    Int4Weight,
    Int8Weight,
    pack_nibbles,
    reference_linear,
    reference_linear_a8,
    supports_a8,
)

# instruction set -> (compiler flags, the /proc/cpuinfo flags it needs), best first
ISAS = {
    "avx512": (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"),
               ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
    "avx2": (("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
}
A8_EXTRA = {"avx512": (("-mavx512vnni",), ("avx512_vnni",))}  # the int8-activation kernel's AVX-512 form
DISABLE_ENV = "SPECDEC_DISABLE_WOQ_KERNEL"
ISA_ENV = "SPECDEC_CPU_ISA"  # build the kernels for this instruction set, not the best the CPU runs
BF16_KERNEL_MAX_ROWS = 128


def cpu_isas(a8: bool = False) -> list[str]:
    """The instruction sets of ``ISAS`` this CPU runs, best first (``a8``: for the int8-activation
    kernel, whose AVX-512 form also needs VNNI)."""
    flags = cpp_build.cpu_flags()
    return list(_isas(flags, a8))


@functools.lru_cache(maxsize=None)  # asked on every attention call
def _isas(flags: frozenset[str], a8: bool) -> tuple[str, ...]:
    return tuple(isa for isa, (_, needs) in ISAS.items()
                 if set(needs) <= flags and (not a8 or set(A8_EXTRA.get(isa, ((), ()))[1]) <= flags))


def build_args(isa: str | None = None, a8: bool = False) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(isa, compiler flags, needed CPU flags) of a kernel built for ``isa``; None: ``$SPECDEC_CPU_ISA``
    if set, else the best this CPU runs (where it runs none, the AVX-512 set, so the warning names
    what is missing)."""
    return _build_args(isa or os.environ.get(ISA_ENV), a8, cpp_build.cpu_flags())


@functools.lru_cache(maxsize=None)  # asked on every kernel call
def _build_args(isa: str | None, a8: bool, cpu_flags: frozenset[str]) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    found = _isas(cpu_flags, a8)
    isa = isa or (found[0] if found else "avx512")
    if isa not in ISAS:
        raise ValueError(f"{ISA_ENV}={isa!r}: must be one of {sorted(ISAS)}")
    flags, needs = ISAS[isa]
    if a8 and isa in A8_EXTRA:
        flags, needs = flags + A8_EXTRA[isa][0], needs + A8_EXTRA[isa][1]
    return isa, flags, needs


def extension(isa: str | None = None):
    """``torch.ops.specdec_woq_<isa>`` once built and loaded (``isa``: see ``build_args``), or None
    (after one warning saying why)."""
    return _load("woq", *build_args(isa))


# kernel -> (source, what it is, what runs without it)
_KERNELS = {
    "woq": ("woq_linear.cpp", "the int8/int4 CPU kernel", "int8/int4 weights use the slow pure-torch path"),
    "woq_a8": ("woq_a8.cpp", "the int8-activation CPU kernel", "int8 activations use the slow pure-torch path"),
}


@functools.lru_cache(maxsize=None)
def _load(kernel: str, isa: str, flags: tuple[str, ...], needs: tuple[str, ...]):
    source, what, fallback = _KERNELS[kernel]
    ns = f"specdec_{kernel}_{isa}"
    return cpp_build.load_ops(ns, source, ns, ["-O3", *flags, f"-DSPECDEC_LIB={ns}"], needs=needs, what=what,
                              disable_env=DISABLE_ENV, fallback=fallback)


def available() -> bool:
    return extension() is not None


def supports(weight: Int8Weight | Int4Weight) -> bool:
    """Whether the kernel takes this weight's layout (int8: K and the group a multiple of 16;
    int4: the group a multiple of 32)."""
    if isinstance(weight, Int8Weight):
        return weight.qweight.shape[1] % 16 == 0 and weight.group_size % 16 == 0
    return weight.group_size % 32 == 0


def linear(x: torch.Tensor, weight: Int8Weight | Int4Weight) -> torch.Tensor:
    """``x @ dequant(weight).T`` in float32 arithmetic, result in x's dtype. x: [..., K] -> [..., N]."""
    ops = extension() if x.device.type == "cpu" and supports(weight) else None
    if ops is None:
        return reference_linear(x, weight)
    if isinstance(weight, Int8Weight):
        return ops.int8_linear(x, weight.qweight, weight.scales)
    return ops.int4_linear(x, weight.packed, weight.scales, weight.offsets)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for a bf16 [N, K] weight in float32 arithmetic (``F.linear(x.float(),
    weight.float())`` to float32 rounding), result in x's dtype; the kernel where it runs."""
    k = weight.shape[1]
    rows = x.numel() // max(k, 1)
    # past BF16_KERNEL_MAX_ROWS rows (prefill) float32 GEMM on a widened copy is faster
    ops = extension() if x.device.type == "cpu" and k % 32 == 0 and rows <= BF16_KERNEL_MAX_ROWS else None
    if ops is not None:
        return ops.bf16_linear(x, weight, bias)
    out = _bf16_linear_unfused(x, weight, rows)
    return out if bias is None else out + bias


def bf16_pairs_available() -> bool:
    """Whether ``bf16_pairs_linear`` runs its kernel here: the AVX-512 build on a CPU with avx512_bf16
    (bf16 dot products)."""
    flags = cpp_build.cpu_flags()
    return "avx512_bf16" in flags and build_args()[0] == "avx512" and available()


PAIR_BLOCK = 16  # outputs per block of the pair layout


def supports_pairs(n: int, k: int) -> bool:
    """Whether a [n, k] weight takes the pair layout (whole 16-output blocks, k a multiple of 32)."""
    return n % PAIR_BLOCK == 0 and k % 32 == 0


def pack_bf16_pairs(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [N, K] weight in ``bf16_pairs_linear``'s layout, [N / 16][K / 2][16][2] (returned as an
    [N, K] tensor): per block of 16 outputs, each 2 consecutive inputs' weights of the 16 outputs in
    one 64-byte run."""
    n, k = weight.shape
    return weight.reshape(n // PAIR_BLOCK, PAIR_BLOCK, k // 2, 2).transpose(1, 2).contiguous().view(n, k)


def unpack_bf16_pairs(packed: torch.Tensor) -> torch.Tensor:
    """``pack_bf16_pairs``' inverse: the [N, K] weight."""
    n, k = packed.shape
    return packed.view(n // PAIR_BLOCK, k // 2, PAIR_BLOCK, 2).transpose(1, 2).reshape(n, k)


def bf16_pairs_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for W in pair layout (``pack_bf16_pairs``): x rounded to bf16, products summed
    in float32 (bf16 dot products), result in x's dtype; off the kernel, the same values from
    ``F.linear`` in float32 on the rounded x (summed in another order)."""
    ops = extension() if x.device.type == "cpu" and bf16_pairs_available() else None
    if ops is not None:
        return ops.bf16_pairs_linear(x, packed, bias)
    out = F.linear(x.to(torch.bfloat16).float(), unpack_bf16_pairs(packed).float())
    return (out if bias is None else out + bias.float()).to(x.dtype)


def _bf16_linear_unfused(x: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    k = weight.shape[1]
    if x.device.type != "cpu":
        return F.linear(x.float(), weight.float()).to(x.dtype)
    # widened a slice of outputs at a time into one reused buffer (no fresh pages per call,
    # bounded memory)
    flat = x.reshape(rows, k).float()
    n = weight.shape[0]
    step = max(1, _WIDEN_ELEMENTS // k)
    out = torch.empty(rows, n)
    buf = _widen_buffer(min(step, n) * k)
    for n0 in range(0, n, step):
        w = buf[:(min(n, n0 + step) - n0) * k].view(-1, k)
        w.copy_(weight[n0:n0 + w.shape[0]])
        out[:, n0:n0 + w.shape[0]] = flat @ w.T
    return out.view(*x.shape[:-1], n).to(x.dtype)


_WIDEN_ELEMENTS = 1 << 24  # float32 elements of the widening buffer (64 MiB)
_widen = [torch.empty(0)]  # the buffer, grown on demand


def _widen_buffer(elements: int) -> torch.Tensor:
    if _widen[0].numel() < elements:
        _widen[0] = torch.empty(elements)
    return _widen[0][:elements]


def extension_a8(isa: str | None = None):
    """``torch.ops.specdec_woq_a8_<isa>`` (the int8-activation kernel) once built, or None (after one
    warning saying why: ``linear_a8`` then runs ``woq_format.reference_linear_a8``, much slower)."""
    return _load("woq_a8", *build_args(isa, a8=True))


SUPER_BLOCK = 256  # inputs per super-block of two-level scales (GGUF's K-quants)
# (divisor, sign) tried per super-block for two-level scales, factor = sign * (the block's value
# of largest magnitude) / divisor: that group's code is 63 in a llama.cpp Q4_K block (scales and
# mins) and -128 in a Q6_K one; the others cover encoders whose largest code rounds lower
_FACTORS = ((63.0, 1.0), (128.0, -1.0), (127.0, 1.0), (62.0, 1.0), (126.0, 1.0), (61.0, 1.0), (125.0, 1.0))


def compact_scales(values: torch.Tensor, group_size: int, half: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The smallest form of float32 [N, K / G] group scales (or offsets) that holds them exactly:
    float16; else int8 codes times one float32 factor per super-block of 256 inputs (what a GGUF
    K-quant stores: d * sc); else float32 as is. -> (values or codes, factors or None)."""
    if half and torch.isfinite(values.half()).all() and torch.equal(values.half().float(), values):
        return values.half(), None
    per = SUPER_BLOCK // group_size
    if SUPER_BLOCK % group_size or values.shape[1] % per or per > 16:
        return values, None
    blocks = values.reshape(values.shape[0], -1, per)
    largest = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))  # signed, largest magnitude
    factor = torch.zeros_like(largest)
    codes = torch.zeros_like(blocks)
    found = largest == 0  # an all-zero block: codes 0, factor 0
    for divisor, sign in _FACTORS:
        f = sign * largest / divisor
        c = (blocks / torch.where(f != 0, f, 1.0)).round()
        ok = ((c >= -128) & (c <= 127) & (c * f == blocks)).all(dim=-1, keepdim=True) & ~found
        factor, codes, found = torch.where(ok, f, factor), torch.where(ok, c, codes), found | ok
    if not found.all():
        return values, None
    return codes.to(torch.int8).reshape(values.shape), factor.reshape(values.shape[0], -1).contiguous()


A8_BLOCK_OUTPUTS = 16  # csrc/woq_a8.cpp's kBlock: outputs per block of the layout


def _padded(n: int) -> int:
    return -(-n // A8_BLOCK_OUTPUTS) * A8_BLOCK_OUTPUTS


def block_rows(values: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """[N, R] per-output values (N a multiple of 16) stored as the kernel reads them, per block of 16
    outputs R-major: [N / 16][R][16] (``inverse``: back to [N, R] rows). The shape stays [N, R]."""
    n, r = values.shape
    shape = (n // A8_BLOCK_OUTPUTS, r, A8_BLOCK_OUTPUTS) if inverse else (n // A8_BLOCK_OUTPUTS, A8_BLOCK_OUTPUTS, r)
    return values.reshape(shape).transpose(1, 2).contiguous().view(n, r)


def pad_rows(values: torch.Tensor) -> torch.Tensor:
    """[N, R] with zero rows appended up to a multiple of 16 outputs."""
    extra = _padded(values.shape[0]) - values.shape[0]
    return values if extra == 0 else torch.cat([values, values.new_zeros(extra, values.shape[1])])


def a8_int8_layout(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernel's [N padded to 16, K]: per block of 16 outputs, vector j (64 bytes)
    holds inputs 4j .. 4j + 3 of each output, output o in bytes 4o .. 4o + 3."""
    return block_rows(pad_rows(q).contiguous().view(torch.int32)).view(torch.int8)


def a8_int4_layout(values: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> the kernel's uint8 [N padded to 16, K / 2]: per block of 16 outputs,
    vector j (64 bytes) holds inputs 8j .. 8j + 7 of each output, output o in bytes 4o .. 4o + 3,
    byte t with input 8j + t in its low nibble and 8j + 4 + t in its high one."""
    v = pad_rows(values.to(torch.uint8))
    n, k = v.shape
    octets = v.view(n, k // 8, 2, 4)
    words = (octets[:, :, 0] | (octets[:, :, 1] << 4)).reshape(n, k // 2).view(torch.int32)
    return block_rows(words).view(torch.uint8)


def a8_int8_values(layout: torch.Tensor, n: int) -> torch.Tensor:
    """``a8_int8_layout``'s inverse: the int8 [n, K] weight."""
    return block_rows(layout.view(torch.int32), inverse=True).view(torch.int8)[:n]


def a8_int4_values(layout: torch.Tensor, n: int) -> torch.Tensor:
    """``a8_int4_layout``'s inverse: [n, K] values 0..15."""
    rows, half = layout.shape
    octets = block_rows(layout.view(torch.int32), inverse=True).view(torch.uint8).reshape(rows, half // 4, 4)
    return torch.stack([octets & 0xF, octets >> 4], dim=2).reshape(rows, 2 * half)[:n]


@dataclass
class A8Weight:
    """An ``Int8Weight`` / ``Int4Weight`` with its integers in the kernel's layout (``a8_int8_layout`` /
    ``a8_int4_layout``: blocks of 16 outputs, N padded to a multiple of 16) and the source's scales
    and (int4) offsets. ``source()`` gives the weight back.
    ``kernel_scales`` / ``kernel_offsets`` are the compact forms the kernel reads (``compact_scales``:
    the same values in fewer bytes, padded and stored per block by ``block_rows``):
    ``(values, super-block factors or None)``."""
    weight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None  # int4 only
    kernel_scales: tuple | None = None
    kernel_offsets: tuple | None = None

    @property
    def int4(self) -> bool:
        return self.offsets is not None

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] * (2 if self.int4 else 1)

    @property
    def out_features(self) -> int:
        return self.scales.shape[0]

    @classmethod
    def prepare(cls, weight: Int8Weight | Int4Weight) -> "A8Weight":
        if not supports_a8(weight):
            raise ValueError("int8 activations need K a multiple of 64 and weight groups a multiple of 32 (int8: 16)")
        if isinstance(weight, Int8Weight):
            return cls(a8_int8_layout(weight.qweight), weight.scales, None).compacted()
        return cls(a8_int4_layout(weight.unpacked()), weight.scales, weight.offsets).compacted()

    def compacted(self) -> "A8Weight":
        """With the kernel's compact scales; scales and offsets share one form (a weight whose
        offsets do not take the scales' form keeps float32 for both)."""
        g = self.in_features // self.scales.shape[1]
        scales = compact_scales(self.scales, g)
        offsets = compact_scales(self.offsets, g) if self.int4 else None
        if offsets is not None and offsets[0].dtype != scales[0].dtype:  # one fp16-exact by chance
            scales, offsets = compact_scales(self.scales, g, half=False), compact_scales(self.offsets, g, half=False)
        if offsets is not None and offsets[0].dtype != scales[0].dtype:
            scales, offsets = (self.scales, None), (self.offsets, None)
        return A8Weight(self.weight, self.scales, self.offsets, _blocked(scales), _blocked(offsets))

    def source(self) -> Int8Weight | Int4Weight:
        n = self.out_features
        if not self.int4:
            return Int8Weight(a8_int8_values(self.weight, n), self.scales)
        return Int4Weight(pack_nibbles(a8_int4_values(self.weight, n)), self.scales, self.offsets)


def _blocked(form: tuple | None) -> tuple | None:
    """``compact_scales``' (values, factors or None) padded and stored per block of 16 outputs."""
    if form is None:
        return None
    return tuple(None if t is None else block_rows(pad_rows(t)) for t in form)


_NONE = torch.empty(0)


def linear_a8(x: torch.Tensor, weight: A8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``woq_format.reference_linear_a8(x, weight.source()) (+ bias)`` (int8 activations), to float32
    rounding; row i of an M-row call equals the one-row call bit for bit. x: [..., K] -> [..., N]."""
    ops = extension_a8() if x.device.type == "cpu" else None
    if ops is None:
        out = reference_linear_a8(x, weight.source())
        return out if bias is None else out + bias
    return ops.a8_linear(x, *a8_kernel_args(weight), bias)


def a8_kernel_args(weight: A8Weight) -> tuple:
    """The kernel's weight arguments for ``weight``: (integers, scales, offsets, scale factors,
    offset factors, K, N); a module calls ``a8_linear(x, *args, bias)`` with them cached."""
    scales, scales_sup = weight.kernel_scales or _blocked((weight.scales, None))
    offsets, offsets_sup = (scales, None)
    if weight.int4:
        offsets, offsets_sup = weight.kernel_offsets or _blocked((weight.offsets, None))
    return (weight.weight, scales, offsets, _NONE if scales_sup is None else scales_sup,
            _NONE if offsets_sup is None else offsets_sup, weight.in_features, weight.out_features)
