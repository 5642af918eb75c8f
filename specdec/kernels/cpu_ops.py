"""Fused float32 CPU ops for the decoder's small per-layer steps (``csrc/cpu_ops.cpp``), built on
first use like the int8 / int4 kernel (``woq_cpu``): add + RMSNorm, RMSNorm, rotary.

At batch 1 these steps are a few hundred floats each and their cost is ATen's per-op overhead
(``F.rms_norm`` is six ops on CPU, the rotary split / multiply / cat eight), so one C++ call each
takes 2-3 µs where the torch forms take 20-55 µs. Used for float32 CPU tensors that need no
gradient; everything else (and ``SPECDEC_DISABLE_CPU_OPS=1``, or a failed build) runs the torch
forms, which are the reference the tests hold these to.
"""
from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch

from specdec.kernels.woq_cpu import _build_dir, _cpu_flags

_SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"


@functools.lru_cache(maxsize=1)
def extension():
    """``torch.ops.specdec_cpu`` once built and loaded, or None (after one warning saying why)."""
    if os.environ.get("SPECDEC_DISABLE_CPU_OPS", "0") not in ("", "0"):
        return None
    flags = ["-O3", "-fopenmp-simd"] + (["-mavx512f", "-mfma"] if "avx512f" in _cpu_flags() else
                                         ["-mavx2", "-mfma"] if "avx2" in _cpu_flags() else [])
    try:
        from torch.utils.cpp_extension import load

        build_dir = os.path.join(_build_dir(), "cpu_ops")
        os.makedirs(build_dir, exist_ok=True)
        load(name="specdec_cpu_ops", sources=[str(_SOURCE)], extra_cflags=flags, build_directory=build_dir,
             is_python_module=False, verbose=False)
        return torch.ops.specdec_cpu
    except Exception as e:  # no compiler, no headers: the torch forms still run
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        warnings.warn(f"specdec: could not build the fused CPU ops ({type(e).__name__}: {last}); "
                      f"using the torch forms", stacklevel=3)
        return None


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the fused ops take these tensors (float32, CPU, no autograd)."""
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or (grad and t.requires_grad):
            return False
    return extension() is not None
