"""The AVX-512 VNNI int8 / int4 CPU kernel (``csrc/woq_linear.cpp``), built on first use.

``torch.utils.cpp_extension.load`` compiles it once per torch version into
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/specdec/torch_extensions`` (about a minute with gcc);
nothing is built at install time. Where it cannot run (no AVX-512 VNNI, no compiler, a failed
build, ``SPECDEC_DISABLE_WOQ_KERNEL=1``) ``available()`` is False after one warning and
``linear`` computes the same function with ``woq_format.reference_linear`` (slowly).
"""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.kernels.woq_format import Int4Weight, Int8Weight, reference_linear

_SOURCE = Path(__file__).parent / "csrc" / "woq_linear.cpp"
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma"]
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")


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


@dataclass
class KernelWeight:
    """What the kernel reads besides the format's tensors, computed once at load."""
    weight: Int8Weight | Int4Weight
    init: torch.Tensor  # [N, K // G] int32: -128 * sum of each group's signed weights
    zeros: torch.Tensor  # [N, K // G] uint8 int4 zero points (empty for int8)
    supported: bool  # the kernel takes this shape (else the reference runs)

    @classmethod
    def prepare(cls, weight: Int8Weight | Int4Weight) -> "KernelWeight":
        n, k = weight.shape if isinstance(weight, Int4Weight) else weight.qweight.shape
        g = weight.group_size
        if isinstance(weight, Int4Weight):
            signed = weight.unpacked().to(torch.int32).view(n, k // g, g) - weight.zeros.to(torch.int32)[:, :, None]
            zeros = weight.zeros.to(torch.uint8).contiguous()
        else:
            signed = weight.qweight.to(torch.int32).view(n, k // g, g)
            zeros = torch.zeros(0, dtype=torch.uint8)
        init = (-128 * signed.sum(dim=-1)).to(torch.int32).contiguous()
        supported = k % 64 == 0 and (g == 32 or g % 64 == 0) and n % 2 == 0
        return cls(weight, init, zeros, supported)

    @property
    def nbytes_read(self) -> int:
        """Bytes one call streams: the integers, the scales, the group sums and zero points."""
        w = self.weight
        data = w.packed if isinstance(w, Int4Weight) else w.qweight
        zeros = self.zeros.numel() if isinstance(w, Int4Weight) else 0
        return data.numel() + 4 * w.scales.numel() + 4 * self.init.numel() + zeros


def linear(x: torch.Tensor, kw: KernelWeight) -> torch.Tensor:
    """``reference_linear(x, kw.weight)`` in x's dtype. x: [..., K] -> [..., N]."""
    ops = extension() if kw.supported and x.device.type == "cpu" else None
    if ops is None:
        return reference_linear(x, kw.weight)
    w = kw.weight
    data = w.packed if isinstance(w, Int4Weight) else w.qweight
    return ops.linear(x, data, w.scales, kw.init, kw.zeros, x.shape[-1])
