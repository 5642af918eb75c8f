"""Attention over the paged KV cache (pure-torch reference).

Cache layout, per layer: ``kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = keys, 1 = values). A token's *slot* is ``block_id * block_size + offset``.

A step's batch is flat: requests are concatenated along the token axis, each contributing
``q_len`` query tokens (a prefill chunk, the K+1 verification rows, or one decode row).
Query token ``j`` of request ``r`` sits at position ``seq_len[r] - q_len[r] + j`` and attends
to every key at positions ``0 ..`` that position (causal, bottom-right aligned), so prefill
chunks, verification rows and decode rows mix in one call. This stays the oracle that
faster kernels (``specdec.kernels``) are tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int64, context length after this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int64 (padded with 0)
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token
    # host copies, so the reference loop does not synchronise with the device
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        q = self.query_start_loc_cpu
        return max((q[i + 1] - q[i] for i in range(len(q) - 1)), default=0)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    kv_cache[0].view(num_slots, *kv_cache.shape[3:]).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(num_slots, *kv_cache.shape[3:]).index_copy_(0, slot_mapping, value)


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each request's query rows over its cached keys/values."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    block_size = meta.block_size
    out = torch.empty_like(query)
    qsl = meta.query_start_loc_cpu
    for r, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = qsl[r], qsl[r + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = meta.block_tables[r, :num_blocks]
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [seq_len, Hkv, D]
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        q = query[start:end].transpose(0, 1)  # [H, q_len, D]
        k = k.transpose(0, 1)  # [Hkv, seq_len, D]
        v = v.transpose(0, 1)
        if group > 1:
            k = k.repeat_interleave(group, dim=0)
            v = v.repeat_interleave(group, dim=0)
        mask = None
        if q_len > 1:
            # bottom-right causal: row j sees keys <= seq_len - q_len + j
            rows = torch.arange(q_len, device=query.device).unsqueeze(1) + (seq_len - q_len)
            cols = torch.arange(seq_len, device=query.device).unsqueeze(0)
            mask = cols <= rows  # [q_len, seq_len]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out
