"""Triton kernels: one source for CUDA and ROCm, each tested against its pure-torch reference
(on CPU under TRITON_INTERPRET=1). Importing this package does not import Triton; the CPU
engine never needs it. Kernel modules (`paged_attention`, `kv_cache`, `rejection_sampler`,
`top_k_top_p`) import Triton themselves; `graphs` does not need it."""
from __future__ import annotations

import importlib.util
import os


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its numpy interpreter (TRITON_INTERPRET=1), the mode
    used to test kernels on CPU tensors. Decided when a kernel is defined, so set the variable
    before importing a kernel module."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def load(name: str):
    """Import `specdec.kernels.<name>`, re-importing it if its kernels were defined in the
    other mode (compiled vs TRITON_INTERPRET=1) than the one now set; the CPU kernel tests use
    this so they work whatever imported the module first."""
    import importlib
    import sys

    full_name = f"{__name__}.{name}"
    module = sys.modules.get(full_name)
    if module is None:
        return importlib.import_module(full_name)
    if getattr(module, "DEFINED_FOR_INTERPRETER", None) != interpreting():
        module = importlib.reload(module)
    return module
