"""Fused float32 CPU ops for the decoder's small per-layer steps (``csrc/cpu_ops.cpp``), built on
first use (``cpp_build``): add + RMSNorm, RMSNorm, rotary.

At batch 1 these steps are a few hundred floats each and their cost is ATen's per-op overhead
(``F.rms_norm`` is six ops on CPU, the rotary split / multiply / cat eight), so each becomes one
C++ call. Used for float32 CPU tensors that need no gradient; everything else (and
``SPECDEC_DISABLE_CPU_OPS=1``, or a failed build) runs the torch forms, which are the reference
the tests hold these to.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from specdec.kernels.cpu import cpp_build


@functools.lru_cache(maxsize=1)
def extension():
    """``torch.ops.specdec_cpu`` once built and loaded, or None (after one warning saying why)."""
    flags = cpp_build.cpu_flags()
    isa = ["-mavx512f", "-mfma"] if "avx512f" in flags else ["-mavx2", "-mfma"] if "avx2" in flags else []
    return cpp_build.load_ops("specdec_cpu_ops", "cpu_ops.cpp", "specdec_cpu", ["-O3", "-fopenmp-simd"] + isa,
                              what="the fused CPU ops", disable_env="SPECDEC_DISABLE_CPU_OPS",
                              fallback="using the torch forms")


class FusedOps(NamedTuple):
    """The ops as their one overload each (``.default``: a call skips the packet's overload lookup)."""
    add_rms_norm: Callable  # (x [.., n], residual [.., n], weight [n], eps) -> [out, x + residual]
    rms_norm: Callable  # (x [.., n], weight [n], eps) -> out
    rotate: Callable  # (x [T, heads, D], cos [T, 1, D/2], sin [T, 1, D/2]) -> rotated x
    silu_mul: Callable  # (x [rows, 2n]) -> silu(x[:, :n]) * x[:, n:]


@functools.lru_cache(maxsize=1)
def _fused_ops() -> FusedOps | None:
    ops = extension()
    return None if ops is None else FusedOps(*(getattr(ops, name).default for name in FusedOps._fields))


def ops_for(*tensors: torch.Tensor) -> FusedOps | None:
    """The fused ops where they take these tensors (float32, CPU, no autograd), else None: the check
    and the ops in one call."""
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_cpu or (grad and t.requires_grad):
            return None
    return _fused_ops()


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the fused ops take these tensors (float32, CPU, no autograd)."""
    return ops_for(*tensors) is not None
