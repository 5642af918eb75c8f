"""The AVX-512 weight-only int8 / int4 CPU kernel (``csrc/woq_linear.cpp``), built on first use.

``torch.utils.cpp_extension.load`` compiles it once per torch version into
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/specdec/torch_extensions`` (a few seconds with gcc);
nothing is built at install time. Where it cannot run (no AVX-512, no compiler, a failed build)
``available()`` is False after one warning and callers use ``woq_format.reference_linear``.
"""
from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch

from specdec.kernels.woq_format import Int4Weight, Int8Weight, reference_linear

_SOURCE = Path(__file__).parent / "csrc" / "woq_linear.cpp"
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]


def _cpu_has_avx512() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))


def _build_dir() -> str:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(Path.home(), ".cache", "specdec", "torch_extensions")
    path = os.path.join(root, f"torch{torch.__version__.replace('+', '_')}")
    os.makedirs(path, exist_ok=True)
    return path


@functools.lru_cache(maxsize=1)
def extension():
    """The compiled module, or None (after one warning saying why)."""
    if os.environ.get("SPECDEC_DISABLE_WOQ_KERNEL"):
        return None
    if not _cpu_has_avx512():
        warnings.warn("specdec: this CPU lacks AVX-512; int8/int4 weights use the slower "
                      "dequantize-then-matmul path", stacklevel=3)
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(name="specdec_woq_linear", sources=[str(_SOURCE)], extra_cflags=_FLAGS,
                    build_directory=_build_dir(), verbose=False)
    except Exception as e:  # no compiler, no headers, a failed build: the reference path still runs
        warnings.warn(f"specdec: could not build the int8/int4 CPU kernel ({type(e).__name__}: "
                      f"{str(e).strip().splitlines()[-1] if str(e).strip() else e}); falling back to the "
                      f"slower dequantize-then-matmul path", stacklevel=3)
        return None


def available() -> bool:
    return extension() is not None


def supports(weight: Int8Weight | Int4Weight) -> bool:
    """Whether the kernel takes this weight's layout (K and the group size multiples of 16 / 32)."""
    if isinstance(weight, Int8Weight):
        return weight.qweight.shape[1] % 16 == 0 and weight.group_size % 16 == 0
    return weight.group_size % 32 == 0


def linear(x: torch.Tensor, weight: Int8Weight | Int4Weight) -> torch.Tensor:
    """``x @ dequant(weight).T`` in x's dtype; float32 arithmetic. x: [..., K] -> [..., N]."""
    ext = extension()
    if ext is None or x.device.type != "cpu" or not supports(weight):
        return reference_linear(x, weight)
    if isinstance(weight, Int8Weight):
        return ext.int8_linear(x, weight.qweight, weight.scales)
    return ext.int4_linear(x, weight.packed, weight.scales, weight.zeros)
