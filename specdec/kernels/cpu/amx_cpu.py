"""AMX kernels (``csrc/amx_linear.cpp``) for CPUs with tile registers (Intel Sapphire Rapids and later:
``amx_tile``, ``amx_bf16``, ``amx_int8`` in /proc/cpuinfo), built on first use like the other CPU kernels.

``amx_bf16_linear`` multiplies a bf16 weight kept in ``woq_cpu.pack_bf16_pairs``' layout (the layout a
tile's B operand takes, so the same buffer serves the AVX-512 pair kernel and this one) with up to 16
rows of x per pass over the weight: verification rows cost about what one row costs. Linux grants AMX
state per process on request (``arch_prctl(ARCH_REQ_XCOMP_PERM)``); ``available()`` is True only where
the CPU has the flags, the kernel built and the request was granted. Whether a layer uses it is measured
at load time (``specdec.layers.quantization.bf16_amx_faster``), never assumed from the flags.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specdec.kernels.cpu import cpp_build

# the CPU flags the kernel needs: the AVX-512 base it is compiled with, then the tile extensions
NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "amx_tile", "amx_bf16")
FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mamx-tile", "-mamx-bf16")
DISABLE_ENV = "SPECDEC_DISABLE_AMX"
MAX_TILE_ROWS = 16  # rows of x one pass over the weight serves


def cpu_has_amx(flags: frozenset[str] | None = None) -> bool:
    """Whether a CPU with these /proc/cpuinfo flags (default: this one's) runs the AMX bf16 kernel."""
    return set(NEEDS) <= (cpp_build.cpu_flags() if flags is None else flags)


@functools.lru_cache(maxsize=1)
def extension():
    """``torch.ops.specdec_amx`` once built, loaded and granted AMX state by the OS, else None (after one
    warning where the CPU has AMX but the build or the request failed)."""
    if not cpu_has_amx() or cpp_build.disabled(DISABLE_ENV):
        return None
    ops = cpp_build.load_ops("specdec_amx", "amx_linear.cpp", "specdec_amx",
                             ["-O3", *FLAGS, "-DSPECDEC_LIB=specdec_amx"], needs=NEEDS,
                             what="the AMX CPU kernel", fallback="bf16 linears use the AVX-512 kernels",
                             disable_env=DISABLE_ENV)
    if ops is None:
        return None
    if not ops.amx_init():
        import warnings

        warnings.warn("specdec: the OS refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM); "
                      "bf16 linears use the AVX-512 kernels", stacklevel=2)
        return None
    return ops


def available() -> bool:
    return extension() is not None


# the int8-activation kernel (csrc/woq_a8.cpp) built with its AMX path: a8_linear_amx
A8_NEEDS = NEEDS + ("avx512_vnni", "amx_int8")
A8_FLAGS = FLAGS + ("-mavx512vnni", "-mamx-int8")


def cpu_has_amx_int8(flags: frozenset[str] | None = None) -> bool:
    """Whether a CPU with these /proc/cpuinfo flags (default: this one's) runs the AMX int8 path."""
    return set(A8_NEEDS) <= (cpp_build.cpu_flags() if flags is None else flags)


@functools.lru_cache(maxsize=1)
def extension_a8():
    """``torch.ops.specdec_woq_a8_amx`` (``a8_linear`` and ``a8_linear_amx``, equal bit for bit) once built,
    where the CPU has amx_int8 and the OS granted AMX state; else None."""
    from specdec.kernels.cpu import woq_cpu

    if not (cpu_has_amx_int8() and available() and woq_cpu.extension_a8() is not None):
        return None
    return cpp_build.load_ops("specdec_woq_a8_amx", "woq_a8.cpp", "specdec_woq_a8_amx",
                              ["-O3", *A8_FLAGS, "-DSPECDEC_LIB=specdec_woq_a8_amx"], needs=A8_NEEDS,
                              what="the AMX int8-activation kernel",
                              fallback="int8 activations use the AVX-512 VNNI kernel", disable_env=DISABLE_ENV)


def amx_bf16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for W in pair layout (``woq_cpu.pack_bf16_pairs``): x rounded to bf16, products
    summed in float32 AMX tiles, result in x's dtype; row i of an M-row call equals the one-row call bit
    for bit. Off the kernel, the same values from ``F.linear`` in float32 (summed in another order)."""
    from specdec.kernels.cpu.woq_cpu import unpack_bf16_pairs

    ops = extension() if x.device.type == "cpu" else None
    if ops is not None:
        return ops.amx_bf16_linear(x, packed, bias)
    out = F.linear(x.to(torch.bfloat16).float(), unpack_bf16_pairs(packed).float())
    return (out if bias is None else out + bias.float()).to(x.dtype)
