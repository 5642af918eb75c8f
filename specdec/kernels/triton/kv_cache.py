"""KV-cache write through the slot mapping (Triton; CUDA and ROCm).

Same contract as `specdec.layers.attention.write_kv_cache`: token t's key and value go to
slot slot_mapping[t] = block_id * block_size + offset of
`kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]`. One program per token copies
all its kv heads; a negative slot (padding rows of a CUDA-graph batch) is skipped. The copy
is bitwise: key/value must already have the cache's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels.triton.config import launch_options, next_power_of_2


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, kv_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kv, stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    dst = kv_cache_ptr + (slot // KV_BLOCK_SIZE) * stride_cb + (slot % KV_BLOCK_SIZE) * stride_cs + heads * stride_ch + dims
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(dst, key, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(dst + stride_kv, value, mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (or int32); < 0 => skip the token
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit kv_cache {tuple(kv_cache.shape)}")
    if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
        raise ValueError(f"key/value dtype {key.dtype}/{value.dtype} must equal the cache dtype {kv_cache.dtype}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("write_kv_cache_triton needs the head_dim axis of key, value and kv_cache contiguous")
    if num_tokens == 0:
        return
    heads_pad, dim_pad = next_power_of_2(num_kv_heads), next_power_of_2(head_dim)
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=heads_pad, HEAD_DIM_PAD=dim_pad,
        KV_BLOCK_SIZE=kv_cache.shape[2],
        **launch_options(key.device, threads=min(256, max(32, heads_pad * dim_pad // 8))),
    )
