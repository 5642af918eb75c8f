"""Refuse a model that cannot fit in host memory, before any weight is read.

What loading on CPU holds at its peak: every weight materialised at the load dtype (quantizing to
int8 / int4 happens after, module by module, so the load dtype is the peak), plus the smallest KV
cache the engine starts with (one max_model_len sequence). The checkpoint itself is read through
mmap one tensor at a time (``loader.iterate_weights``), so its pages are file-backed and
reclaimable: they are not counted. Integer tensors (kept-quantized blocks) count at their own size.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

_SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                         "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8}
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


def checkpoint_weight_bytes(files: list[Path], dtype: torch.dtype) -> int:
    """Bytes the checkpoint's tensors take once loaded: floating tensors at ``dtype``, the others
    as stored. Reads the safetensors headers only."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                numel = 1
                for d in tensor.get_shape():
                    numel *= d
                kind = tensor.get_dtype()
                total += numel * (itemsize if kind in _FLOAT_DTYPES else _SAFETENSORS_ITEMSIZE.get(kind, 1))
    return total


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what the kernel can hand out without swapping), or None
    where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits_in_memory(path: str, files: list[Path], dtype: torch.dtype, min_kv_bytes: int,
                         num_shards: int = 1) -> None:
    """A ``ValueError`` naming the bytes needed and available when ``path``'s weights at ``dtype``
    (split over ``num_shards`` tensor-parallel ranks) and ``min_kv_bytes`` of KV do not fit."""
    available = available_memory_bytes()
    if available is None:
        return
    weights = checkpoint_weight_bytes(files, dtype) // num_shards
    needed = weights + min_kv_bytes
    if needed > available:
        raise ValueError(
            f"model {path!r} does not fit in memory: it needs {needed} bytes ({weights} bytes of weights in "
            f"{str(dtype).removeprefix('torch.')} + {min_kv_bytes} bytes of KV cache for one max_model_len "
            f"sequence) and {available} bytes are available (MemAvailable): use a quantized checkpoint or "
            f"dtype, lower max_model_len, or free memory")
