"""The int8 / int4 weight-only CPU kernel, the bf16-weight float32 one and the bf16 dot-product one
(``csrc/woq_linear.cpp``: ``linear``, ``bf16_linear``, ``bf16_pairs_linear``) and the int8-activation
kernel (``csrc/woq_a8.cpp``, ``linear_a8``), each built on first use (``cpp_build``) for the best
instruction set this CPU runs: AVX-512 (the int8-activation kernel: AVX-512 VNNI) or AVX2 + FMA.

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

from specdec.kernels import cpp_build
from specdec.kernels.woq_format import (
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


def a8_chunks(k: int, group_size: int = 32) -> list[tuple[int, int]]:
    """(start, size) of the chunks ``csrc/woq_a8.cpp`` cuts K into: 512, 256, 128, 64, largest first,
    at most 16 weight groups each (a lane's inputs stay in one group)."""
    out, c0 = [], 0
    while c0 < k:
        c = 512
        while c > k - c0 or c // 16 > group_size:
            c //= 2
        out.append((c0, c))
        c0 += c
    return out


def a8_order(k: int, group_size: int = 32) -> torch.Tensor:
    """[K] int64: position p of the kernel's chunk order holds input ``a8_order(k)[p]`` (in a chunk
    of C inputs, step s, lane l, byte t: input start + l * C / 16 + 4 s + t)."""
    parts = []
    for c0, c in a8_chunks(k, group_size):
        w = c // 16
        s, lane, t = torch.meshgrid(torch.arange(c // 64), torch.arange(16), torch.arange(4), indexing="ij")
        parts.append((c0 + lane * w + 4 * s + t).reshape(-1))
    return torch.cat(parts)


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


A8_ROW_GROUP = 4  # csrc/woq_a8.cpp's kRowGroup


def interleave_rows(rows: torch.Tensor, step_bytes: int, inverse: bool = False) -> torch.Tensor:
    """[N, R] bytes, R = steps * step_bytes, with each group of ``A8_ROW_GROUP`` rows (the last one:
    the rest) stored step by step: the group's rows' step 0, then their step 1, ... (the kernel's
    weight layout; ``inverse``: back to row-major). The shape stays [N, R]."""
    n, r = rows.shape
    steps, full = r // step_bytes, n - n % A8_ROW_GROUP
    out = torch.empty_like(rows)
    for start, count, g in ((0, full, A8_ROW_GROUP), (full, n - full, n - full)):
        if count == 0:
            continue
        part = rows[start:start + count]
        shape = (count // g, steps, g, step_bytes) if inverse else (count // g, g, steps, step_bytes)
        out[start:start + count] = part.reshape(shape).transpose(1, 2).reshape(count, r)
    return out


@dataclass
class A8Weight:
    """An ``Int8Weight`` / ``Int4Weight`` with its integers in the VNNI kernel's chunk order (int8:
    [N, K] int8; int4: [N, K / 2] uint8, 32 bytes per 64 positions, byte b = position b low,
    b + 32 high), rows interleaved by ``interleave_rows``, and the source's scales and (int4)
    offsets. ``source()`` gives the weight back.
    ``kernel_scales`` / ``kernel_offsets`` are the compact forms the kernel reads (``compact_scales``:
    the same values in fewer bytes): ``(values, super-block factors or None)``."""
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

    @classmethod
    def prepare(cls, weight: Int8Weight | Int4Weight) -> "A8Weight":
        if not supports_a8(weight):
            raise ValueError("int8 activations need K a multiple of 64 and weight groups a multiple of 32 (int8: 16)")
        if isinstance(weight, Int8Weight):
            order = a8_order(weight.qweight.shape[1], weight.group_size)
            return cls(interleave_rows(weight.qweight[:, order], 64), weight.scales, None).compacted()
        n, k = weight.shape
        q = weight.unpacked()[:, a8_order(k, weight.group_size)].view(n, k // 64, 2, 32)
        return cls(interleave_rows((q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2), 32), weight.scales,
                   weight.offsets).compacted()

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
        return A8Weight(self.weight, self.scales, self.offsets, scales, offsets)

    def source(self) -> Int8Weight | Int4Weight:
        n, k = self.weight.shape[0], self.in_features
        order = a8_order(k, k // self.scales.shape[1])
        if not self.int4:
            q = torch.empty_like(self.weight)
            q[:, order] = interleave_rows(self.weight, 64, inverse=True)
            return Int8Weight(q, self.scales)
        steps = interleave_rows(self.weight, 32, inverse=True).view(n, k // 64, 32)
        values = torch.stack([steps & 0xF, steps >> 4], dim=2).reshape(n, k)  # chunk order
        q = torch.empty_like(values)
        q[:, order] = values
        return Int4Weight(pack_nibbles(q), self.scales, self.offsets)


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
    offset factors, K); a module calls ``a8_linear(x, *args, bias)`` with them cached."""
    scales, scales_sup = weight.kernel_scales or (weight.scales, None)
    offsets, offsets_sup = (weight.kernel_offsets or (weight.offsets, None)) if weight.int4 else (scales, None)
    return (weight.weight, scales, offsets, _NONE if scales_sup is None else scales_sup,
            _NONE if offsets_sup is None else offsets_sup, weight.in_features)
