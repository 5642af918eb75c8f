"""Float32 CPU products whose every row comes out the same however many rows the call has.

A float32 CPU GEMM does not promise that: BLAS picks its kernel and blocking from the call's
shape, so one row alone and the same row among 16 can differ in the last bits. Where a step
function of that row follows (a top-k router choice, an int8-quantized activation, a greedy
argmax near a tie), a one-row decode and a K+1-row verification of the same token could then
disagree, and speculative output would differ from plain decoding. These products run in
float64 and the caller rounds the result to float32 once: the float64 paths' differences
(about 1e-16 relative) vanish in that rounding, but for a value within that distance of a
float32 rounding boundary. Other dtypes and devices compute as they are (no promise there).
"""
from __future__ import annotations

import torch


def wanted(x: torch.Tensor) -> bool:
    """Whether ``x``'s products take the float64 path: float32 on a CPU."""
    return x.device.type == "cpu" and x.dtype == torch.float32


def float64_of(weight: torch.Tensor) -> torch.Tensor:
    """A float64 copy of ``weight`` (a parameter: read, not written, by forwards), made once and
    kept on the tensor; made again after the tensor is written in place (its version changes)."""
    cached = getattr(weight, "_specdec_float64", None)
    if cached is None or cached[0] != weight._version:
        cached = (weight._version, weight.detach().double())
        weight._specdec_float64 = cached
    return cached[1]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype to multiply ``x`` in: float64 for float32 on CPU, else its own."""
    return torch.float64 if wanted(x) else x.dtype
