"""The row-consistent attention backend (``ROWS_BACKEND``): the step's ``AttentionMetadata`` passed
to the CPU kernel (``specdec.kernels.cpu.attention_rows``, which takes tensors), and the batched
torch path where the kernel does not run. Speculation with int8 activations is then no longer
guaranteed to reproduce plain decoding (warned once)."""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

from specdec.kernels.cpu.attention_rows import MAX_HEAD_DIM, attention_rows, extension, qkv_applies
from specdec.layers.attention import AttentionBackend, AttentionMetadata, paged_attention_torch, write_kv_cache


@dataclass
class RowsPlan:
    """The rows backend's per-step plan (``AttentionMetadata.plan_for("rows", ...)``): the step's
    token trees in the kernel's form."""
    tree_base: torch.Tensor  # [R] int64 first tree key (seq_len for a causal request)
    tree_mask: torch.Tensor  # [T, width] uint8, row t's tree keys from its request's base on


def build_rows_plan(meta: AttentionMetadata) -> RowsPlan:
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    width = max((lens[r] - tree[0] for r, tree in enumerate(meta.tree_masks) if tree is not None), default=1)
    base = torch.tensor([lens[r] if tree is None else tree[0] for r, tree in enumerate(meta.tree_masks)])
    mask = torch.zeros(qsl[-1], max(1, width), dtype=torch.uint8)
    for r, tree in enumerate(meta.tree_masks):
        if tree is not None:
            node_mask = tree[1].to(torch.uint8).cpu()
            mask[qsl[r]:qsl[r] + node_mask.shape[0], :node_mask.shape[1]] = node_mask
    return RowsPlan(base, mask)


def _tree_inputs(meta: AttentionMetadata) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(tree_base, tree_mask) for a step with token trees, else (None, None)."""
    if meta.tree_masks is None:
        return None, None
    plan = meta.plan_for("rows", build_rows_plan)
    return plan.tree_base, plan.tree_mask


@functools.lru_cache(maxsize=None)
def _warn_batched_once(dtype: torch.dtype, head_dim: int) -> None:
    if extension() is not None:  # the kernel exists: it is the dtype or head size it does not take
        warnings.warn(f"specdec: row-consistent attention takes float32 and head_dim <= 256, not {dtype} / "
                      f"{head_dim}: the batched torch path runs instead", stacklevel=4)


def _options(meta: AttentionMetadata, sliding_window: int | None, sinks: torch.Tensor | None,
             softcap: float | None) -> tuple:
    """The kernel's (window, sinks, softcap) arguments: 0 / None / 0 for an option not set."""
    if sliding_window is not None and meta.tree_masks is not None:
        _check_tree_depth(meta, sliding_window)
    return (sliding_window or 0, None if sinks is None else sinks.float(), float(softcap or 0.0))


def _check_tree_depth(meta: AttentionMetadata, sliding_window: int) -> None:
    depth = max((int(tree[1].sum(-1).max()) for tree in meta.tree_masks if tree is not None), default=0)
    if depth > sliding_window:
        raise ValueError(f"a token tree of depth {depth} exceeds the sliding window of {sliding_window} positions")


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
    out = None
    if query.device.type == "cpu" and query.dtype == torch.float32 and kv_cache.dtype == torch.float32 \
            and query.shape[-1] <= MAX_HEAD_DIM and extension() is not None:
        out = attention_rows(query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                             *_tree_inputs(meta), *_options(meta, sliding_window, sinks, softcap))
    if out is None:
        _warn_batched_once(query.dtype, query.shape[-1])
        return paged_attention_torch(query, kv_cache, meta, scale, sliding_window=sliding_window, sinks=sinks,
                                     softcap=softcap)
    return out


def qkv_attention_rows(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, num_heads: int, *, sliding_window: int | None = None,
                       sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor | None:
    """Rotary, KV-cache write and ``paged_attention_rows`` in one kernel call from the fused QKV
    projection's output [T, (H + 2 Hkv) D] -> [T, H, D]; None where the kernel does not apply."""
    attend = bind_qkv_attention_rows(scale, num_heads, sliding_window=sliding_window, sinks=sinks, softcap=softcap)
    return attend(qkv, cos, sin, kv_cache, meta)


def _not_applicable(*args) -> None:
    return None


def bind_qkv_attention_rows(scale: float, num_heads: int, *, sliding_window: int | None = None,
                            sinks: torch.Tensor | None = None, softcap: float | None = None):
    """``qkv_attention_rows`` for one layer: ``(qkv, cos, sin, kv_cache, meta) -> [T, H, D] or None``
    with the kernel op and the layer's constants found once (the kernel reads ``sinks`` when it runs,
    so a later in-place load of its values is seen). Per call: the checks on the call's tensors and
    the step's metadata only."""
    ops = extension()
    if ops is None:
        return _not_applicable
    op = ops.qkv_attention_rows.default
    window, cap = sliding_window or 0, float(softcap or 0.0)

    def attend(qkv, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor | None:
        if not qkv_applies(qkv, cos, kv_cache):
            return None
        tree_base = tree_mask = None
        if meta.tree_masks is not None:
            tree_base, tree_mask = _tree_inputs(meta)
            if sliding_window is not None:
                _check_tree_depth(meta, sliding_window)
        return op(qkv, cos, sin, kv_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                  scale, num_heads, tree_base, tree_mask, window, sinks, cap)

    return attend


ROWS_BACKEND = AttentionBackend("rows", write_kv_cache, paged_attention_rows, bind_qkv_attention_rows)
