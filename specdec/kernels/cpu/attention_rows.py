"""Row-consistent paged attention for CPUs (``csrc/attention_rows.cpp``, AVX-512 or AVX2, float32).

Each (query row, head) is computed on its own over exactly the keys it may see, in key order, so
a token's attention output does not depend on the rest of the step: not on how many rows its
request has (a one-row decode or K+1 verification rows), nor on the other requests and the
padding ``paged_attention_torch`` gives them (its batched matmuls sum a row differently when the
step's longest context or query length changes). The int8-activation linears ("w8a8" / "w4a8")
need this: they round their inputs to int8, so one ulp of difference could change the output.
Built on first use like ``woq_cpu``; without it (no AVX2, a failed build,
``SPECDEC_DISABLE_WOQ_KERNEL=1``) or for other dtypes ``paged_attention_rows`` runs
``paged_attention_torch``, and speculation with int8 activations is then no longer guaranteed to
reproduce plain decoding (warned once).
"""
from __future__ import annotations

import functools
import warnings

import torch

from specdec.kernels.cpu import cpp_build, woq_cpu
from specdec.layers.attention import AttentionBackend, AttentionMetadata, paged_attention_torch, write_kv_cache

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


def _tree_inputs(meta: AttentionMetadata):
    """(tree_base [R], tree_mask [T, width] uint8) for a step with token trees, else (None, None);
    cached on the metadata (every layer of the step reuses them)."""
    if meta.tree_masks is None:
        return None, None
    if meta._rows_plan is None:
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        width = max((lens[r] - tree[0] for r, tree in enumerate(meta.tree_masks) if tree is not None), default=1)
        base = torch.tensor([lens[r] if tree is None else tree[0] for r, tree in enumerate(meta.tree_masks)])
        mask = torch.zeros(qsl[-1], max(1, width), dtype=torch.uint8)
        for r, tree in enumerate(meta.tree_masks):
            if tree is not None:
                node_mask = tree[1].to(torch.uint8).cpu()
                mask[qsl[r]:qsl[r] + node_mask.shape[0], :node_mask.shape[1]] = node_mask
        meta._rows_plan = (base, mask)
    return meta._rows_plan


@functools.lru_cache(maxsize=None)
def _warn_batched_once(dtype: torch.dtype, head_dim: int) -> None:
    if extension() is not None:  # the kernel exists: it is the dtype or head size it does not take
        warnings.warn(f"specdec: row-consistent attention takes float32 and head_dim <= 256, not {dtype} / "
                      f"{head_dim}: the batched torch path runs instead", stacklevel=4)


def _options(meta: AttentionMetadata, sliding_window: int | None, sinks: torch.Tensor | None,
             softcap: float | None) -> tuple:
    """The kernel's (window, sinks, softcap) arguments: 0 / None / 0 for an option not set."""
    if sliding_window is not None and meta.tree_masks is not None:
        depth = max((int(tree[1].sum(-1).max()) for tree in meta.tree_masks if tree is not None), default=0)
        if depth > sliding_window:
            raise ValueError(f"a token tree of depth {depth} exceeds the sliding window of {sliding_window} positions")
    return (sliding_window or 0, None if sinks is None else sinks.float(), float(softcap or 0.0))


def paged_attention_rows(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """The options (``specdec.layers.attention``) run in the kernel too."""
    ops = extension() if query.device.type == "cpu" else None
    if ops is None or query.dtype != torch.float32 or kv_cache.dtype != torch.float32 or query.shape[-1] > 256:
        _warn_batched_once(query.dtype, query.shape[-1])
        return paged_attention_torch(query, kv_cache, meta, scale, sliding_window=sliding_window, sinks=sinks,
                                     softcap=softcap)
    base, mask = _tree_inputs(meta)
    return ops.attention_rows(query.contiguous(), kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                              scale, base, mask, *_options(meta, sliding_window, sinks, softcap))


def qkv_attention_rows(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, num_heads: int, *, sliding_window: int | None = None,
                       sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor | None:
    """Rotary, KV-cache write and ``paged_attention_rows`` in one kernel call from the fused QKV
    projection's output [T, (H + 2 Hkv) D] -> [T, H, D]; None where the kernel does not apply."""
    ops = extension() if qkv.device.type == "cpu" else None
    if ops is None or qkv.dtype != torch.float32 or kv_cache.dtype != torch.float32 or kv_cache.shape[-1] > 256 \
            or cos.dtype != torch.float32 or qkv.dim() != 2 or qkv.stride(1) != 1:
        return None
    base, mask = _tree_inputs(meta)
    return ops.qkv_attention_rows(qkv, cos, sin, kv_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                  meta.query_start_loc, scale, num_heads, base, mask,
                                  *_options(meta, sliding_window, sinks, softcap))


ROWS_BACKEND = AttentionBackend("rows", write_kv_cache, paged_attention_rows, qkv_attention_rows)
