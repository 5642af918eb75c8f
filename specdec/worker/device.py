"""Device and dtype selection: CUDA / ROCm (torch.version.hip) / CPU, and their defaults."""
from __future__ import annotations

import functools
import os

import torch

from specdec.kernels.hardware import is_rocm

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.startswith("cuda") or device == "rocm":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} requested but torch sees no CUDA/ROCm GPU")
        return torch.device("cuda" if device == "rocm" else device)
    if device == "cpu":
        return torch.device("cpu")
    raise ValueError(f"device must be 'auto', 'cpu', 'cuda[:N]' or 'rocm', got {device!r}")


# the /proc/cpuinfo flags specdec's CPU kernels (or the libraries they call: oneDNN, fbgemm) use
KERNEL_ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                    "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_info(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """The CPU as /proc/cpuinfo gives it (its first processor): vendor, family and model numbers, model
    name, and which of ``KERNEL_ISA_FLAGS`` it has, in that order. What a kernel costs differs between
    CPU kinds that share a name (a VM's may read just "AMD EPYC"): the family and model say which
    generation it is (AMD family 25 is Zen 3/4, 26 Zen 5; Intel family 6 with amx_tile is Sapphire
    Rapids or later)."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break  # the first processor's block is enough
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    as_int = lambda v: int(v) if v and v.isdigit() else None  # noqa: E731
    return {"vendor": fields.get("vendor_id"), "family": as_int(fields.get("cpu family")),
            "model": as_int(fields.get("model")), "model_name": fields.get("model name"),
            "isa": [flag for flag in KERNEL_ISA_FLAGS if flag in flags]}


def describe_cpu(info: dict) -> str:
    """One line: vendor, family / model, name, ISA features (``cpu_info``'s fields)."""
    isa = " ".join(info["isa"]) or "none of the kernels' sets"
    name = f"{info['vendor'] or '?'} family {info['family']} model {info['model']} ({info['model_name'] or '?'})"
    return f"{name}; ISA: {isa}"


@functools.cache
def cpu_supports_bf16() -> bool:
    """True when the CPU has native bf16 matmul (AMX or AVX512-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return any(flag in flags for flag in ("amx_bf16", "avx512_bf16"))


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_supports_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def apply_platform_defaults(device: torch.device) -> None:
    """Process-wide settings that matter for inference speed on each platform."""
    if device.type == "cuda" and is_rocm():
        # expandable segments avoid fragmentation from variable-length batches on ROCm too
        os.environ.setdefault("PYTORCH_HIP_ALLOC_CONF", "expandable_segments:True")
    if device.type == "cpu":
        keep_cpu_allocations_mapped()


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


@functools.cache
def keep_cpu_allocations_mapped(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Serve host tensors up to 32 MiB from malloc's heap and keep up to 256 MiB of freed heap
    mapped, instead of glibc's defaults (fresh mmap pages for large blocks, handed back on free).
    PyTorch has no caching allocator on the CPU, so a step's multi-MB activations and logits
    would be page-faulted in anew every step. Intel's guidance for PyTorch on CPUs (jemalloc /
    tcmalloc by LD_PRELOAD) fixes the same thing; this needs no preload. 32 MiB is the largest threshold glibc accepts on 64-bit; larger
    step buffers are reused by their owners (``ModelRunner.reuse_logits``). Returns whether it
    applied (glibc only; elsewhere nothing happens)."""
    if os.environ.get("SPECDEC_KEEP_CPU_ALLOCATIONS", "1") == "0":
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and \
            bool(libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    except (OSError, AttributeError):
        return False


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_cache_bytes_from_gpu_utilization(
    gpu_memory_utilization: float,
    non_kv_bytes: int,
    device: torch.device | None = None,
    *,
    total_bytes: int | None = None,
    free_bytes: int | None = None,
) -> int:
    """Bytes the KV cache may take (vLLM's meaning of gpu_memory_utilization): this engine may
    use `gpu_memory_utilization * total` bytes of the GPU; weights, peak activations and CUDA
    graphs (`non_kv_bytes`, measured by the caller after a profiling forward) come first, the
    KV cache gets the rest, but never more than is free right now (other processes count).
    `total_bytes` / `free_bytes` default to torch.cuda.mem_get_info(device)."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    if total_bytes is None or free_bytes is None:
        free_now, total_now = torch.cuda.mem_get_info(device)
        total_bytes = total_now if total_bytes is None else total_bytes
        free_bytes = free_now if free_bytes is None else free_bytes
    budget = int(total_bytes * gpu_memory_utilization) - int(non_kv_bytes)
    kv_bytes = min(budget, int(free_bytes))
    if kv_bytes <= 0:
        gib = 1 << 30
        raise ValueError(
            f"no memory left for the KV cache: gpu_memory_utilization={gpu_memory_utilization} of "
            f"{total_bytes / gib:.1f} GiB minus {non_kv_bytes / gib:.1f} GiB for weights/activations "
            f"(free now: {free_bytes / gib:.1f} GiB); raise gpu_memory_utilization, set kv_cache_memory or lower "
            f"max_model_len"
        )
    return kv_bytes
