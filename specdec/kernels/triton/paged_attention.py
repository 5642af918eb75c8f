"""Paged attention for mixed batches in one launch (Triton; CUDA and ROCm).

Same contract as `specdec.layers.attention.paged_attention_reference`: the batch is flat,
request r owns query rows query_start_loc[r]:query_start_loc[r+1] (a prefill chunk, K+1
verification rows or one decode row), and query row j of a request with q_len rows sits at
position seq_len - q_len + j and sees keys 0..that position (bottom-right causal). Keys and
values are gathered through the block table, so any KV block size works.

Grid: (query tiles, kv heads, kv splits). A query tile is BLOCK_Q query tokens of one request
times the GROUP query heads that share a kv head (GQA), so K and V are read once per group.
Tiles are numbered without a host sync: request r's tiles start at
query_start_loc[r] // BLOCK_Q + r, which leaves at most one idle tile per request, and a
program finds its request by binary search over query_start_loc. With kv splits > 1
(flash-decoding) each split covers a slice of the keys and writes a partial result plus its
log-sum-exp, merged by a second small kernel; this fills the GPU when a few long decodes
would otherwise give one program per kv head.

Token trees take the same kernel: with ``HAS_TREE`` each program also reads its request's
first tree key (``tree_base``) and, per query row, one bit per tree key
(``specdec.layers.tree_mask``), so a row sees key n iff n is causal for it and (n < base or its
bit is set). A causal request's base is its seq_len, so chain rows, decode rows and prefill
chunks share a launch with tree rows.

Per-layer options (``specdec.layers.attention``): ``HAS_WINDOW`` hides keys before base at or
before pos - window (a row's pos is its slot, or base - 1 + depth for a tree node, its depth
counted from its mask bits) and starts the key loop at the tile's first visible key, so a
sliding layer reads only its window; ``HAS_SINKS`` adds each head's sink logit to the softmax
denominator (in the merge kernel when the keys are split); ``SOFTCAP`` > 0 soft-caps the scores.

``paged_attention_triton`` takes tensors and host lists; the attention backend
(``specdec.layers.attention_triton``) passes them from the step's ``AttentionMetadata``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels.triton import interpreting
from specdec.kernels.triton.config import launch_options, next_power_of_2, num_compute_units

_LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max: keeps exp2(m_old - m_new) finite
_MAX_KV_SPLITS = 16

DEFINED_FOR_INTERPRETER = interpreting()  # the mode the kernels below are bound to (Triton decides at definition)


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    """Largest r with query_start_loc[r] // BLOCK_Q + r <= tile (the left side is increasing)."""
    lo = 0
    hi = num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_tile <= tile, mid, lo)
        hi = tl.where(first_tile <= tile, hi, mid)
    return lo


@triton.jit
def _paged_attention_kernel(
    out_ptr, query_ptr, kv_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    partial_out_ptr, partial_lse_ptr,  # [T, H, NUM_SPLITS, HEAD_DIM_PAD] f32, [T, H, NUM_SPLITS] f32
    tree_base_ptr, tree_bits_ptr,  # [num_reqs] int64, [T, num_words] int32 (read only with HAS_TREE)
    sinks_ptr,  # [num_heads] float32 (read only with HAS_SINKS)
    scale_log2e, num_reqs, num_heads, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kv, stride_kb, stride_ks, stride_kh, stride_bt, stride_tree, num_tree_words,
    HAS_TREE: tl.constexpr, TREE_WORDS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, SOFTCAP: tl.constexpr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr, IEEE_FP32_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = _find_request(query_start_loc_ptr, num_reqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + req)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_pos = q_tile * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] row within this request
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_pos < q_len)
    d_valid = offs_d < HEAD_DIM
    token = q_start + q_pos  # [BLOCK_M] int64
    q = tl.load(query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this tile can see at all: up to its last valid row's causal limit.
    last_q_pos = tl.minimum((q_tile + 1) * BLOCK_Q, q_len) - 1
    kv_end = context_len + last_q_pos + 1
    num_tiles = (kv_end + BLOCK_N - 1) // BLOCK_N
    causal_limit = context_len + q_pos  # [BLOCK_M] last visible key position per row
    if HAS_TREE:
        tree_base = tl.load(tree_base_ptr + req)
    first_tile = 0
    if HAS_WINDOW:
        row_pos = causal_limit  # [BLOCK_M] the row's position: its slot, or base - 1 + depth in a tree
        if HAS_TREE:
            depth = tl.zeros([BLOCK_M], dtype=tl.int32)
            for w in range(0, num_tree_words):
                word = tl.load(tree_bits_ptr + token * stride_tree + w, mask=row_valid, other=0)
                for b in tl.static_range(32):
                    depth += (word >> b) & 1
            row_pos = tl.where(depth > 0, tree_base - 1 + depth, row_pos)
        window_first = row_pos - window + 1  # [BLOCK_M] first key the window lets each row see
        first_key = tl.min(tl.where(row_valid, window_first, kv_end), axis=0)
        if HAS_TREE:
            first_key = tl.minimum(first_key, tree_base)  # tree keys are seen through the mask alone
        first_tile = tl.maximum(first_key, 0) // BLOCK_N
    tiles_per_split = (num_tiles - first_tile + NUM_SPLITS - 1) // NUM_SPLITS
    tile_begin = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.full([BLOCK_M], 0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0, tl.float32)
    block_table = block_tables_ptr + req * stride_bt
    for kv_tile in range(tile_begin, tile_end):
        offs_n = kv_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_valid = offs_n < kv_end
        block_id = tl.load(block_table + offs_n // KV_BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        slot = block_id * stride_kb + (offs_n % KV_BLOCK_SIZE) * stride_ks + kv_head * stride_kh  # [BLOCK_N]
        k = tl.load(kv_cache_ptr + slot[None, :] + offs_d[:, None],
                    mask=n_valid[None, :] & d_valid[:, None], other=0.0)  # [HEAD_DIM_PAD, BLOCK_N] = K^T
        v = tl.load(kv_cache_ptr + stride_kv + slot[:, None] + offs_d[None, :],
                    mask=n_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE_FP32_DOT:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        if SOFTCAP > 0:  # c * tanh(x / c) on the scaled scores, tanh(y) = 2 sigmoid(2 y) - 1
            s = SOFTCAP * (2.0 * tl.sigmoid(s * (scale_log2e / 1.4426950408889634 * 2.0 / SOFTCAP)) - 1.0)
            s = s * 1.4426950408889634
        else:
            s = s * scale_log2e  # [BLOCK_M, BLOCK_N], log2 domain
        visible = n_valid[None, :] & (offs_n[None, :] <= causal_limit[:, None])
        if HAS_WINDOW:
            in_window = offs_n[None, :] >= window_first[:, None]
            if HAS_TREE:
                in_window = in_window | (offs_n[None, :] >= tree_base)
            visible = visible & in_window
        if HAS_TREE:
            if kv_tile * BLOCK_N + BLOCK_N > tree_base:  # the tile holds tree keys
                # bits are aligned to absolute key positions (specdec.layers.tree_mask), so this
                # tile's keys are bits of TREE_WORDS consecutive words per row: vector loads, not
                # a [BLOCK_M, BLOCK_N] gather, whose pointers alone would spill registers
                in_tree = n_valid & (offs_n >= tree_base)  # [BLOCK_N]
                first_word = kv_tile * TREE_WORDS - tree_base // 32  # the tile's first word (< 0: before base)
                seen = ~in_tree[None, :]  # [1, BLOCK_N] keys before base: the causal rule alone
                for w in tl.static_range(TREE_WORDS):
                    word_index = token * 0 + first_word + w  # [BLOCK_M]
                    row_word = tl.load(tree_bits_ptr + token * stride_tree + word_index, other=0,
                                       mask=row_valid & (word_index >= 0) & (word_index < num_tree_words))
                    bit = ((row_word[:, None] >> (offs_n % 32)[None, :]) & 1) != 0  # [BLOCK_M, BLOCK_N]
                    seen = seen | (bit & ((offs_n % BLOCK_N) // 32 == w)[None, :])
                visible = visible & seen
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if UPCAST:
            acc += tl.dot(p, v)
        elif IEEE_FP32_DOT:
            acc += tl.dot(p, v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if NUM_SPLITS == 1:
        if HAS_SINKS:  # the sink joins the max and the denominator
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
            m_f = tl.maximum(m_i, sink)
            rescale = tl.exp2(m_i - m_f)
            l_i = l_i * rescale + tl.exp2(sink - m_f)
            acc = acc * rescale[:, None]
        out = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])
    else:
        has_keys = l_i > 0  # a split can hold no visible key for some rows
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), _NEG_BIG)
        part = (token * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(partial_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], out, mask=row_valid[:, None])
        tl.store(partial_lse_ptr + part, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr, partial_out_ptr, partial_lse_ptr, query_start_loc_ptr, sinks_ptr, num_reqs, num_heads,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    out_ptrs = out_ptr + token * stride_ot + head * stride_oh + offs_d
    if token >= tl.load(query_start_loc_ptr + num_reqs):  # padding row past the last request
        return
    offs_s = tl.arange(0, SPLITS_PAD)
    s_valid = offs_s < NUM_SPLITS
    part = (token.to(tl.int64) * num_heads + head) * NUM_SPLITS + offs_s  # [SPLITS_PAD]
    lse = tl.load(partial_lse_ptr + part, mask=s_valid, other=_NEG_BIG)
    m = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    weight = tl.where(s_valid, tl.exp2(lse - m), 0.0)  # [SPLITS_PAD]
    parts = tl.load(partial_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                    mask=s_valid[:, None], other=0.0)  # [SPLITS_PAD, HEAD_DIM_PAD]
    denominator = tl.sum(weight, axis=0)
    if HAS_SINKS:
        denominator += tl.exp2(sink - m)
    out = tl.sum(parts * weight[:, None], axis=0) / denominator
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_valid)


def choose_num_kv_splits(num_tiles: int, num_kv_heads: int, max_seq_len: int, block_n: int,
                         device: torch.device) -> int:
    """Split the keys only when the (query tile, kv head) grid leaves most compute units idle
    and the sequences are long enough that each split still gets a few key tiles."""
    programs = num_tiles * num_kv_heads
    target = 2 * num_compute_units(device)
    if programs >= target:
        return 1
    by_occupancy = triton.cdiv(target, programs)
    by_length = max(1, max_seq_len // (4 * block_n))  # >= 4 key tiles per split
    return max(1, min(_MAX_KV_SPLITS, by_occupancy, by_length))


def tile_sizes(max_query_len: int, group: int, head_dim: int, tree: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, BLOCK_N). BLOCK_M rows = BLOCK_Q query tokens x GROUP heads; 16 rows
    (the smallest tl.dot tile) for decode and verification, up to 128 for prefill. A tree step's
    128-row tiles take 32 keys at a time: the mask's per-key work at 64 spills registers on gfx942."""
    block_m = min(128, max(16, next_power_of_2(max(1, max_query_len) * group)))
    block_m = max(block_m, next_power_of_2(group))
    block_n = 64 if head_dim <= 128 and not (tree and block_m > 64) else 32
    return block_m, block_m // group, block_n


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int64
    seq_lens: torch.Tensor,  # [num_reqs] int64, context length after this step's tokens
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int64
    scale: float,
    *,
    query_start_loc_cpu: list[int],  # host copies: tile counts and the split choice need no device sync
    seq_lens_cpu: list[int],
    tree_base: torch.Tensor | None = None,  # [num_reqs] int64 (``specdec.layers.tree_mask.PackedTreeMask``)
    tree_bits: torch.Tensor | None = None,  # [num_tokens, num_words] int32; both or neither
    num_kv_splits: int | None = None,  # None: chosen from the host copies; fix it for CUDA graphs
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; rows past query_start_loc[-1] are not written
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if num_heads % num_kv_heads or kv_cache.shape[4] != head_dim:
        raise ValueError(f"query heads/dim {tuple(query.shape[1:])} do not fit kv_cache {tuple(kv_cache.shape)}")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("paged_attention_triton needs the head_dim axis of query and kv_cache contiguous")
    if (tree_base is None) != (tree_bits is None):
        raise ValueError("paged_attention_triton takes tree_base and tree_bits together")
    group = num_heads // num_kv_heads
    num_reqs = len(seq_lens_cpu)
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_reqs == 0:
        return out
    qsl = query_start_loc_cpu
    tree = tree_bits is not None
    max_query_len = max(qsl[i + 1] - qsl[i] for i in range(num_reqs))
    block_m, block_q, block_n = tile_sizes(max_query_len, group, head_dim, tree)
    grid_tiles = num_tokens // block_q + num_reqs  # upper bound, no host sync
    if num_kv_splits is None:
        num_tiles = sum(triton.cdiv(qsl[i + 1] - qsl[i], block_q) for i in range(num_reqs))
        keys = max(seq_lens_cpu) if sliding_window is None else min(max(seq_lens_cpu), sliding_window)
        num_kv_splits = choose_num_kv_splits(num_tiles, num_kv_heads, keys, block_n, query.device)
    head_dim_pad = next_power_of_2(max(16, head_dim))
    if num_kv_splits > 1:
        partial_out = torch.empty(num_tokens, num_heads, num_kv_splits, head_dim_pad,
                                  dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(num_tokens, num_heads, num_kv_splits, dtype=torch.float32, device=query.device)
    else:
        partial_out = partial_lse = out  # unused
    if not tree:  # pointers the kernel never reads
        tree_base, tree_bits, stride_tree, num_tree_words = seq_lens, seq_lens, 0, 0
    else:
        stride_tree, num_tree_words = tree_bits.stride(0), tree_bits.shape[1]
    upcast = DEFINED_FOR_INTERPRETER  # the interpreter cannot do bf16 arithmetic or bf16 tl.dot
    sinks_arg = seq_lens if sinks is None else sinks.float().contiguous()  # never read without sinks
    _paged_attention_kernel[(grid_tiles, num_kv_heads, num_kv_splits)](
        out, query, kv_cache, block_tables, seq_lens, query_start_loc,
        partial_out, partial_lse, tree_base, tree_bits, sinks_arg,
        scale * _LOG2E, num_reqs, num_heads, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        stride_tree, num_tree_words, HAS_TREE=tree, TREE_WORDS=block_n // 32,
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None, SOFTCAP=float(softcap or 0.0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, KV_BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, NUM_SPLITS=num_kv_splits,
        UPCAST=upcast, IEEE_FP32_DOT=query.dtype == torch.float32,
        **launch_options(query.device, threads=max(128, block_m * block_n // 32)),
    )
    if num_kv_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, partial_out, partial_lse, query_start_loc, sinks_arg, num_reqs, num_heads,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_kv_splits,
            SPLITS_PAD=next_power_of_2(num_kv_splits), HAS_SINKS=sinks is not None,
            **launch_options(query.device, threads=64),
        )
    return out
