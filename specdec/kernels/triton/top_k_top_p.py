"""Top-k / top-p masking without sorting the vocabulary (Triton; CUDA and ROCm).

Same result as the sampler's sort-based `_apply_top_k_top_p_sorted` (vLLM's algorithm): top-k
keeps logits >= the k-th largest (ties kept), then top-p, on the top-k renormalised
distribution, keeps a token iff the probability mass strictly above it is < p (so the largest
token always stays). Both cut-offs are thresholds, so each row searches for its threshold
instead of sorting: floats map to int32 keys with the same order, and a multi-pivot search
over the key range narrows [lo, hi) by NUM_PIVOTS per pass over the row (32 bits / log2(16)
= 8 passes), keeping lo = the largest key whose count (top-k) or mass (top-p) of elements
>= it still reaches k (p * Z). The threshold is then an exact element of the row, so top-k is
exact; top-p can differ from the sort only where the mass above a token is within float
rounding of p, or among tokens with exactly equal logits (here all or none are kept).

One program per row and no host sync. Each pass re-reads the row, which L2 holds for
vocabularies up to ~256k; for a handful of rows the single program per row leaves most of
the GPU idle and a torch sort can be faster, so the sampler should choose by batch size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels.triton.config import launch_options

_NUM_PIVOTS = 16


@triton.jit
def _order_key(x):
    """float32 -> int32 with the same order (negative floats: flip the magnitude bits)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _search_threshold(row_ptr, vocab_size, lo, hi, floor_key, row_max, need_count, need_mass,
                      BY_MASS: tl.constexpr, BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """Largest key t in [lo, hi) with count(key >= t) >= need_count (or, BY_MASS, with
    sum(exp(x - row_max) over key >= max(t, floor_key)) >= need_mass). lo must satisfy it and
    hi must not."""
    steps = tl.arange(0, NUM_PIVOTS).to(tl.int64)
    while hi - lo > 1:
        pivots = lo + ((hi - lo) * steps) // NUM_PIVOTS  # [NUM_PIVOTS] int64, pivots[0] = lo
        pivots32 = pivots.to(tl.int32)  # lo <= pivot < hi <= 2**31, so it fits
        if BY_MASS:
            found = tl.full([NUM_PIVOTS], 0, tl.float32)
        else:
            found = tl.full([NUM_PIVOTS], 0, tl.int32)
        for v0 in range(0, vocab_size, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            valid = offs < vocab_size
            x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
            key = _order_key(x)
            above = (key[:, None] >= pivots32[None, :]) & valid[:, None]  # [BLOCK_V, NUM_PIVOTS]
            if BY_MASS:
                weight = tl.where(valid & (key >= floor_key), tl.exp(x - row_max), 0.0)
                found += tl.sum(tl.where(above, weight[:, None], 0.0), axis=0)
            else:
                found += tl.sum(above.to(tl.int32), axis=0)
        if BY_MASS:
            ok = found >= need_mass
        else:
            ok = found >= need_count
        ok = ok | (steps == 0)  # lo satisfies by invariant, whatever a differently ordered sum says
        new_lo = tl.max(tl.where(ok, pivots, lo), axis=0)
        hi = tl.min(tl.where(ok, hi, pivots), axis=0)
        lo = new_lo
    return lo


@triton.jit
def _top_k_top_p_kernel(
    logits_ptr, top_k_ptr, top_p_ptr, vocab_size, stride_row,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row).to(tl.int32)
    else:
        k = vocab_size * 0
    if HAS_TOP_P:
        p = tl.load(top_p_ptr + row).to(tl.float32)
    else:
        p = vocab_size * 0.0 + 1.0
    use_k = (k > 0) & (k < vocab_size)
    use_p = p < 1.0
    if use_k | use_p:
        # pass 1: key range and row max
        min_key = tl.full([BLOCK_V], 2147483647, tl.int32)
        max_key = tl.full([BLOCK_V], -2147483648, tl.int32)
        row_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
        for v0 in range(0, vocab_size, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            valid = offs < vocab_size
            x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
            key = _order_key(x)
            min_key = tl.where(valid, tl.minimum(min_key, key), min_key)
            max_key = tl.where(valid, tl.maximum(max_key, key), max_key)
            row_max = tl.maximum(row_max, x)
        lo = tl.min(min_key, axis=0).to(tl.int64)
        hi = tl.max(max_key, axis=0).to(tl.int64) + 1
        m = tl.max(row_max, axis=0)
        threshold = lo
        if use_k:
            threshold = _search_threshold(row_ptr, vocab_size, lo, hi, lo, m, k, 0.0,
                                          False, BLOCK_V, NUM_PIVOTS)
        if use_p:
            floor_key = threshold.to(tl.int32)
            z = tl.full([BLOCK_V], 0, tl.float32)
            for v0 in range(0, vocab_size, BLOCK_V):
                offs = v0 + tl.arange(0, BLOCK_V)
                valid = offs < vocab_size
                x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
                z += tl.where(valid & (_order_key(x) >= floor_key), tl.exp(x - m), 0.0)
            need_mass = p * tl.sum(z, axis=0)
            threshold = _search_threshold(row_ptr, vocab_size, threshold, hi, floor_key, m, 0, need_mass,
                                          True, BLOCK_V, NUM_PIVOTS)
        cut = threshold.to(tl.int32)
        for v0 in range(0, vocab_size, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            valid = offs < vocab_size
            x = tl.load(row_ptr + offs, mask=valid, other=0.0)
            keep = _order_key(x.to(tl.float32)) >= cut
            tl.store(row_ptr + offs, tl.where(keep, x, float("-inf")), mask=valid & ~keep)


def apply_top_k_top_p_triton(
    logits: torch.Tensor,  # [N, V] float32, modified in place
    top_k: torch.Tensor | None,  # [N] int; <= 0 or >= V => no top-k for that row
    top_p: torch.Tensor | None,  # [N] float32; 1.0 => no top-p for that row
) -> torch.Tensor:  # logits, with dropped tokens set to -inf
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"apply_top_k_top_p_triton needs [N, V] logits with a contiguous vocab axis, got {tuple(logits.shape)}")
    if logits.dtype != torch.float32:
        raise ValueError(f"apply_top_k_top_p_triton needs float32 logits, got {logits.dtype}")
    num_rows, vocab_size = logits.shape
    if num_rows == 0 or (top_k is None and top_p is None):
        return logits
    _top_k_top_p_kernel[(num_rows,)](
        logits, logits if top_k is None else top_k, logits if top_p is None else top_p,
        vocab_size, logits.stride(0),
        HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None, BLOCK_V=1024, NUM_PIVOTS=_NUM_PIVOTS,
        **launch_options(logits.device, threads=256),
    )
    return logits
