"""The Triton attention backend: the step's ``AttentionMetadata`` passed to the kernels
(``specdec.kernels.triton``), which take tensors. Importing this module imports Triton."""
from __future__ import annotations

import torch

from specdec.kernels.triton.kv_cache import write_kv_cache_triton
from specdec.kernels.triton.paged_attention import paged_attention_triton
from specdec.layers.attention import AttentionBackend, AttentionMetadata


def attend_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    *,
    num_kv_splits: int | None = None,  # None: chosen per step; fixed by captured graphs
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; rows past query_start_loc[-1] are not written
    tree = meta.packed_tree()
    return paged_attention_triton(
        query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
        query_start_loc_cpu=meta.query_start_loc_cpu, seq_lens_cpu=meta.seq_lens_cpu,
        tree_base=None if tree is None else tree.base, tree_bits=None if tree is None else tree.bits,
        num_kv_splits=num_kv_splits, out=out, sliding_window=sliding_window, sinks=sinks, softcap=softcap)


TRITON_BACKEND = AttentionBackend("triton", write_kv_cache_triton, attend_triton)
