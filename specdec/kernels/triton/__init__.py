"""Triton kernels: one source for CUDA and ROCm, each tested against its pure-torch reference
(on CPU under TRITON_INTERPRET=1). Importing this package does not import Triton; the CPU
engine never needs it. Kernel modules (`paged_attention`, `kv_cache`, `rejection_sampler`,
`top_k_top_p`, `fused_moe`) import Triton themselves."""
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
    """Import `specdec.kernels.triton.<name>` for the mode now set (TRITON_INTERPRET=1 or compiled),
    with a clear error when Triton was already imported in the other mode: Triton binds every
    @jit function, its own library (tl.max, tl.sum, ...) included, to the mode set when it was
    defined, so one process cannot switch. The kernel tests import kernels through this."""
    import importlib
    import sys

    standard = sys.modules.get("triton.language.standard")
    if standard is not None:
        from triton.runtime.interpreter import InterpretedFunction

        if isinstance(standard.max, InterpretedFunction) != interpreting():
            raise RuntimeError(
                f"Triton was imported with TRITON_INTERPRET={'0' if interpreting() else '1'} before it was "
                f"{'set' if interpreting() else 'unset'}; its kernels cannot switch mode in this process. Run "
                "the kernel tests in their own process (pytest tests/kernels/triton) or export TRITON_INTERPRET=1 first."
            )
    return importlib.import_module(f"{__name__}.{name}")
