"""Fused mixture-of-experts (Triton; CUDA and ROCm): all experts of a layer in two launches.

The step's (row, choice) pairs are sorted by expert and each expert's run padded to a multiple
of ``BLOCK_M`` (``align_pairs``, pure torch, no host sync: the padded length is bounded by
P + E * (BLOCK_M - 1) and blocks past the end carry expert -1). Then

1. ``_gate_up_kernel``: one program per (block of BLOCK_M pairs, BLOCK_N intermediate columns):
   silu(x W_gate^T) * (x W_up^T) for the pairs' rows against their one expert, written in sorted
   order to ``inter`` [P_padded, I];
2. ``_down_kernel``: one program per (block of pairs, BLOCK_N hidden columns): inter W_down^T
   times each pair's routing weight, written to the pair's own row of ``pair_out`` [P, H]; the
   k choices of a row are then summed (``pair_out.view(T, k, H).sum(1)``): no atomics, and the
   result does not depend on the launch order.

A block holds pairs of one expert, so each expert's weights are read by the blocks of its pairs
only: a K+1-row verification reads the union of its rows' experts, as ``layers.moe`` does.
Weights are stacked per layer: ``w13`` [E, 2I, H] (gate rows then up rows, as ``Expert.gate_up_proj``)
and ``w2`` [E, H, I]. ``reference_fused_moe`` is the pure-torch reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


def align_pairs(expert_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """expert_ids [T, k] -> (sorted_pairs [P_pad] int32: pair ids grouped by expert, each group
    padded to ``block_m`` with the sentinel P; block_expert [P_pad / block_m] int32, -1 past the end)."""
    flat = expert_ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(counts, 0) - counts
    padded_starts = torch.cumsum(padded, 0) - padded
    sorted_experts = flat[order]
    dest = padded_starts[sorted_experts] + torch.arange(num_pairs, device=flat.device) - starts[sorted_experts]
    capacity = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_expert = torch.full((capacity // block_m,), -1, dtype=torch.int32, device=flat.device)
    blocks_per_expert = padded // block_m
    first_block = (padded_starts // block_m).to(torch.int64)
    # block b belongs to expert e when first_block[e] <= b < first_block[e] + blocks_per_expert[e]
    block_ids = torch.arange(capacity // block_m, device=flat.device)
    owner = torch.searchsorted(first_block + blocks_per_expert, block_ids, right=True)
    valid = owner < num_experts
    block_expert[valid] = owner[valid].to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, sorted_pairs_ptr, block_expert_ptr, inter_ptr, num_pairs, top_k,
                    hidden, inter_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + slots)
    live = pairs < num_pairs
    rows = tl.where(live, pairs // top_k, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter_size
    w_base = w13_ptr + expert.to(tl.int64) * 2 * inter_size * hidden
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        x = tl.load(x_ptr + rows[:, None] * hidden + ks[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(w_base + cols[None, :] * hidden + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        wu = tl.load(w_base + (cols[None, :] + inter_size) * hidden + ks[:, None],
                     mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc_gate += tl.dot(x, wg)
        acc_up += tl.dot(x, wu)
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    tl.store(inter_ptr + slots.to(tl.int64)[:, None] * inter_size + cols[None, :], act.to(inter_ptr.dtype.element_ty),
             mask=live[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(inter_ptr, w2_ptr, sorted_pairs_ptr, block_expert_ptr, weights_ptr, out_ptr, num_pairs,
                 hidden, inter_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + slots)
    live = pairs < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_base = w2_ptr + expert.to(tl.int64) * hidden * inter_size
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter_size
        a = tl.load(inter_ptr + slots.to(tl.int64)[:, None] * inter_size + ks[None, :],
                    mask=live[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * inter_size + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(a, w)
    weight = tl.load(weights_ptr + tl.where(live, pairs, 0), mask=live, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    safe_pairs = tl.where(live, pairs, 0).to(tl.int64)
    tl.store(out_ptr + safe_pairs[:, None] * hidden + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=live[:, None] & col_ok[None, :])


def fused_moe(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """x [T, H], weights / expert_ids [T, k] (the router's), w13 [E, 2I, H], w2 [E, H, I] -> [T, H]."""
    num_rows, top_k = expert_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter_size = two_inter // 2
    sorted_pairs, block_expert = align_pairs(expert_ids, num_experts)
    num_pairs = num_rows * top_k
    inter = torch.empty(sorted_pairs.numel(), inter_size, dtype=x.dtype, device=x.device)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    _gate_up_kernel[(block_expert.numel(), triton.cdiv(inter_size, block_n))](
        x, w13, sorted_pairs, block_expert, inter, num_pairs, top_k, hidden, inter_size,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(block_expert.numel(), triton.cdiv(hidden, block_n))](
        inter, w2, sorted_pairs, block_expert, weights.reshape(-1).contiguous(), pair_out, num_pairs, hidden,
        inter_size, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
    return pair_out.view(num_rows, top_k, hidden).sum(dim=1)


def reference_fused_moe(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor,
                        w2: torch.Tensor) -> torch.Tensor:
    """Each (row, choice) pair on its own: sum_j w[t, j] * W2_e (silu(W1_e x) * W3_e x), e = ids[t, j]."""
    out = torch.zeros_like(x, dtype=torch.float32)
    inter_size = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(expert_ids.shape[1]):
            e = int(expert_ids[t, j])
            gate_up = w13[e].float() @ x[t].float()
            h = torch.nn.functional.silu(gate_up[:inter_size]) * gate_up[inter_size:]
            out[t] += weights[t, j].float() * (w2[e].float() @ h)
    return out.to(x.dtype)
