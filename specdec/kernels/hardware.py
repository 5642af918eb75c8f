"""GPU probes the kernels size their launches by, below every other layer (the worker's device
selection re-uses them)."""
from __future__ import annotations

import torch


def is_rocm() -> bool:
    return torch.version.hip is not None


def warp_size(device: torch.device | None = None) -> int:
    """Threads per warp (NVIDIA, RDNA: 32) or wavefront (AMD CDNA/GCN, gfx9xx: 64).

    Triton's `num_warps` counts these units, so the same `num_warps` means twice the threads
    on an MI300X as on an H100; kernel configs divide a thread budget by this instead."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return 32  # CPU / Triton interpreter: the value only shapes launch options
    props = torch.cuda.get_device_properties(device)
    size = getattr(props, "warp_size", None)
    if size:
        return int(size)
    if is_rocm():
        arch = getattr(props, "gcnArchName", "")
        return 64 if arch.startswith("gfx9") else 32
    return 32
