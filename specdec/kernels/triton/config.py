"""Launch options sized for the hardware's warp width.

Triton's `num_warps` counts warps of 32 threads on NVIDIA and RDNA but wavefronts of 64 on
AMD CDNA (MI200/MI300), so a fixed `num_warps` doubles the threads per program on an MI300X.
Kernels here ask for a thread budget per tile instead and this module converts it.
The interpreter ignores these options; they only matter when compiling for a GPU.
"""
from __future__ import annotations

import functools

import torch

from specdec.kernels.hardware import is_rocm, warp_size


@functools.cache
def _warp_size_of(device_type: str, index: int | None) -> int:
    if device_type != "cuda":
        return 32
    return warp_size(torch.device(device_type, index if index is not None else torch.cuda.current_device()))


def launch_options(device: torch.device, threads: int, num_stages: int | None = None) -> dict:
    """`num_warps` / `num_stages` for a program that wants about `threads` threads.

    CDNA gets half the warps (64-wide wavefronts) and 1-2 pipeline stages: AMD's Triton
    backend software-pipelines through LDS and gains little past two stages, while more stages
    cost LDS that limits occupancy. NVIDIA keeps `num_stages` (default 2; 3 for big tiles)."""
    width = _warp_size_of(device.type, device.index)
    num_warps = max(1, min(16, threads // width))
    num_warps = 1 << (num_warps.bit_length() - 1)  # Triton wants a power of two
    if num_stages is None:
        num_stages = 2
    if device.type == "cuda" and is_rocm():
        num_stages = min(num_stages, 2)
    return {"num_warps": num_warps, "num_stages": num_stages}


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def num_compute_units(device: torch.device) -> int:
    """SMs (NVIDIA) or CUs (AMD); a nominal 64 on CPU so heuristics stay deterministic in tests."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 64
