"""Row-consistent paged attention for CPUs (``csrc/attention_rows.cpp``, AVX-512 or AVX2, float32).

Each (query row, head) is computed on its own over exactly the keys it may see, in key order, so
a token's attention output does not depend on the rest of the step: not on how many rows its
request has (a one-row decode or K+1 verification rows), nor on the other requests and the
padding the batched torch path gives them (its batched matmuls sum a row differently when the
step's longest context or query length changes). The int8-activation linears ("w8a8" / "w4a8")
need this: they round their inputs to int8, so one ulp of difference could change the output.
Built on first use like ``woq_cpu``. The functions take tensors and return None where the kernel
does not run (no AVX2, a failed build, ``SPECDEC_DISABLE_WOQ_KERNEL=1``, another dtype or device);
the attention backend (``specdec.layers.attention_rows``) falls back to the torch path then.
"""
from __future__ import annotations

import functools

import torch

from specdec.kernels.cpu import cpp_build, woq_cpu

MAX_HEAD_DIM = 256


def extension(isa: str | None = None):
    """``torch.ops.specdec_attention_rows_<isa>`` once built (``isa``: see ``woq_cpu.build_args``;
    AVX-512 or AVX2), or None (after one warning saying why)."""
    return _extension(*woq_cpu.build_args(isa))


@functools.lru_cache(maxsize=None)
def _extension(isa: str, flags: tuple[str, ...], needs: tuple[str, ...]):
    ns = f"specdec_attention_rows_{isa}"
    return cpp_build.load_ops(
        ns, "attention_rows.cpp", ns, ["-O3", *flags, f"-DSPECDEC_LIB={ns}"],
        needs=needs, what="the row-consistent attention kernel", disable_env=woq_cpu.DISABLE_ENV,
        warn_disabled=True, fallback="row-consistent attention runs the batched torch path; speculation with "
        "int8 activations (w8a8 / w4a8) may then differ from plain decoding")


def attention_rows(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] float32
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] float32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int64
    seq_lens: torch.Tensor,  # [num_reqs] int64
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int64
    scale: float,
    tree_base: torch.Tensor | None,  # [num_reqs] int64 first tree key (seq_len for a causal request)
    tree_mask: torch.Tensor | None,  # [num_tokens, width] uint8, row t's tree keys from its base on
    sliding_window: int,  # 0: none
    sinks: torch.Tensor | None,  # [num_heads] float32
    softcap: float,  # 0: none
) -> torch.Tensor | None:  # [num_tokens, num_heads, head_dim], or None where the kernel does not run
    ops = extension() if query.device.type == "cpu" else None
    if ops is None or query.dtype != torch.float32 or kv_cache.dtype != torch.float32 \
            or query.shape[-1] > MAX_HEAD_DIM:
        return None
    return ops.attention_rows(query.contiguous(), kv_cache, block_tables, seq_lens, query_start_loc, scale,
                              tree_base, tree_mask, sliding_window, sinks, softcap)


def qkv_attention_rows(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) D] float32, the fused QKV projection's output
    cos: torch.Tensor,  # the rotary tables of the step's rows
    sin: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim] float32
    slot_mapping: torch.Tensor,  # [T] int64
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    num_heads: int,
    tree_base: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    sliding_window: int,
    sinks: torch.Tensor | None,
    softcap: float,
) -> torch.Tensor | None:  # [T, H, D], or None where the kernel does not apply
    """Rotary, KV-cache write and ``attention_rows`` in one kernel call."""
    ops = extension() if qkv.is_cpu else None
    if ops is None or not qkv_applies(qkv, cos, kv_cache):
        return None
    return ops.qkv_attention_rows(qkv, cos, sin, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                                  scale, num_heads, tree_base, tree_mask, sliding_window, sinks, softcap)


def qkv_applies(qkv: torch.Tensor, cos: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether ``qkv_attention_rows`` takes these tensors (with the kernel built): float32 on the CPU,
    [T, (H + 2 Hkv) D] with unit stride along a row, head_dim <= ``MAX_HEAD_DIM``."""
    return (qkv.dtype == torch.float32 and qkv.is_cpu and kv_cache.dtype == torch.float32 and cos.dtype == torch.float32
            and qkv.dim() == 2 and qkv.stride(1) == 1 and kv_cache.shape[-1] <= MAX_HEAD_DIM)
