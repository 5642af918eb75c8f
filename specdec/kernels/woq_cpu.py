"""The AVX-512 int8 / int4 weight-only CPU kernel (``csrc/woq_linear.cpp``), built on first use.

``torch.utils.cpp_extension.load`` compiles it once per torch version into
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/specdec/torch_extensions`` (about a minute with gcc);
nothing is built at install time. Where it cannot run (no AVX-512, no compiler, a failed
build, ``SPECDEC_DISABLE_WOQ_KERNEL=1``) ``available()`` is False after one warning and
``linear`` runs ``woq_format.reference_linear`` (dequantize, then ``F.linear``: slower).
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
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build_dir() -> str:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(Path.home(), ".cache", "specdec", "torch_extensions")
    path = os.path.join(root, f"torch{torch.__version__.replace('+', '_')}")
    os.makedirs(path, exist_ok=True)
    return path


@functools.lru_cache(maxsize=1)
def extension():
    """``torch.ops.specdec_woq`` once built and loaded, or None (after one warning saying why)."""
    if os.environ.get("SPECDEC_DISABLE_WOQ_KERNEL", "0") not in ("", "0"):
        return None
    missing = [f for f in _CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        warnings.warn(f"specdec: this CPU lacks {', '.join(missing)}; int8/int4 weights use the slow "
                      f"pure-torch path", stacklevel=3)
        return None
    try:
        from torch.utils.cpp_extension import load

        load(name="specdec_woq_linear", sources=[str(_SOURCE)], extra_cflags=_FLAGS,
             build_directory=_build_dir(), is_python_module=False, verbose=False)
        return torch.ops.specdec_woq
    except Exception as e:  # no compiler, no headers, a failed build: the reference path still runs
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        warnings.warn(f"specdec: could not build the int8/int4 CPU kernel ({type(e).__name__}: {last}); "
                      f"falling back to the slow pure-torch path", stacklevel=3)
        return None


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
