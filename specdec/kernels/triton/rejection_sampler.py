"""Rejection sampling core in one launch, one program per request, no host sync (Triton).

`rejection_sample_core_triton` takes plain tensors; `specdec.spec_decode.rejection_sampler_triton`
adapts it to the torch reference's signature and result (see
`specdec.spec_decode.rejection_sampler.rejection_sample` for accepted / recovered / bonus tokens).
Everything random is drawn beforehand in torch, in the reference's order, so
the kernel is a deterministic function of (probabilities, drafts, uniforms, exponentials) and
equals the reference exactly given the same generators:

- request r accepts draft x_i while uniforms[r, i] * q_i(x_i) < p_i(x_i) (q = 1 for one-hot
  drafts), the multiplication form of u < p/q;
- its one recovered-or-bonus token is argmax_v w_v / noise[r, v] (the exponential race), with
  w = max(0, p_j - q_j) at the first rejection j (falling back to p_j if that is all zero)
  or w = p_{K+1} when all K drafts were accepted. Only one of the two is ever emitted, so one
  row of noise per request serves both.

Greedy requests compare drafts with target_argmax and emit argmax at the first mismatch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels.triton import interpreting
from specdec.kernels.triton.config import launch_options

DEFINED_FOR_INTERPRETER = interpreting()  # the mode the kernels below are bound to (Triton decides at definition)


@triton.jit
def _divide(x, y, IEEE_DIV: tl.constexpr):
    # Correctly rounded division, as torch computes it; the interpreter's numpy `/` already is.
    if IEEE_DIV:
        return tl.math.div_rn(x, y)
    else:
        return x / y


@triton.jit
def _greedy_request(out_row, draft_ids_ptr, target_argmax_ptr, draft_start, row_start, num_drafts):
    num_accepted = num_drafts * 0
    alive = num_drafts >= 0  # True, typed like the loop below needs
    for i in range(0, num_drafts):
        target = tl.load(target_argmax_ptr + row_start + i)
        match = tl.load(draft_ids_ptr + draft_start + i) == target
        tl.store(out_row + i, target, mask=alive)  # accepted draft (== target) or the recovered token
        num_accepted += (alive & match).to(num_accepted.dtype)
        alive = alive & match
    bonus = tl.load(target_argmax_ptr + row_start + num_drafts, mask=alive, other=0)
    tl.store(out_row + num_drafts, bonus, mask=alive)
    return num_accepted


@triton.jit
def _random_request(
    out_row, draft_ids_ptr, target_probs_ptr, draft_probs_ptr, uniforms_row, noise_row,
    draft_start, row_start, num_drafts, vocab_size, stride_tp, stride_dp,
    HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr, IEEE_DIV: tl.constexpr,
):
    num_accepted = num_drafts * 0
    alive = num_drafts >= 0
    for i in range(0, num_drafts):
        draft = tl.load(draft_ids_ptr + draft_start + i)
        p = tl.load(target_probs_ptr + (row_start + i) * stride_tp + draft)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_ptr + (draft_start + i) * stride_dp + draft).to(tl.float32)
        else:
            q = 1.0
        accept = tl.load(uniforms_row + i) * q < p
        tl.store(out_row + i, draft, mask=alive & accept)
        num_accepted += (alive & accept).to(num_accepted.dtype)
        alive = alive & accept

    # One exponential race over the vocabulary for the recovered (rejected) or bonus token.
    rejected = num_accepted < num_drafts
    final_row = target_probs_ptr + (row_start + num_accepted) * stride_tp
    rejected_at = tl.minimum(num_accepted, tl.maximum(num_drafts - 1, 0))  # a valid index either way
    rejected_draft = tl.load(draft_ids_ptr + draft_start + rejected_at, mask=rejected, other=-1)
    q_row = draft_probs_ptr + (draft_start + rejected_at) * stride_dp
    best_residual = -1.0
    best_residual_id = num_drafts * 0
    best_p = -1.0
    best_p_id = num_drafts * 0
    residual_nonzero = num_drafts < 0  # False
    for v0 in range(0, vocab_size, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        valid = offs < vocab_size
        p = tl.load(final_row + offs, mask=valid, other=0.0)
        if HAS_DRAFT_PROBS:
            # tl.where, not `valid & rejected`: the interpreter turns scalar & vector into int32
            q = tl.load(q_row + offs, mask=tl.where(rejected, valid, False), other=0.0).to(tl.float32)
        else:
            q = tl.where(offs == rejected_draft, 1.0, 0.0)  # rejected_draft is -1 unless rejected
        residual = tl.maximum(p - q, 0.0)
        noise = tl.load(noise_row + offs, mask=valid, other=1.0)
        score = tl.where(valid, _divide(residual, noise, IEEE_DIV), -1.0)
        chunk_best = tl.max(score, axis=0)
        chunk_id = v0 + tl.argmax(score, axis=0)  # first maximum, like torch.argmax
        best_residual_id = tl.where(chunk_best > best_residual, chunk_id, best_residual_id)
        best_residual = tl.maximum(best_residual, chunk_best)
        score = tl.where(valid, _divide(p, noise, IEEE_DIV), -1.0)
        chunk_best = tl.max(score, axis=0)
        chunk_id = v0 + tl.argmax(score, axis=0)
        best_p_id = tl.where(chunk_best > best_p, chunk_id, best_p_id)
        best_p = tl.maximum(best_p, chunk_best)
        residual_nonzero = residual_nonzero | (tl.max(residual, axis=0) > 0)
    final_token = tl.where(residual_nonzero, best_residual_id, best_p_id)
    tl.store(out_row + num_accepted, final_token.to(tl.int64))
    return num_accepted


@triton.jit
def _rejection_sample_kernel(
    output_ptr,  # [R, max_k + 1] int64
    num_accepted_ptr,  # [R] int64
    draft_ids_ptr,  # [num_draft_total] int64
    cu_num_draft_ptr,  # [R + 1] int64, exclusive prefix sum of num_draft_tokens
    target_argmax_ptr,  # [num_rows] int64 (greedy requests)
    target_probs_ptr,  # [num_rows, V] float32 (random requests)
    draft_probs_ptr,  # [num_draft_total, V]
    uniforms_ptr,  # [R, >= max_k] float32
    noise_ptr,  # [R, V] float32, Exp(1) draws floored at the smallest normal float
    is_greedy_ptr,  # [R] bool
    max_k, vocab_size, stride_out, stride_tp, stride_dp, stride_u, stride_noise,
    ALL_GREEDY: tl.constexpr, ALL_RANDOM: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr, IEEE_DIV: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    draft_start = tl.load(cu_num_draft_ptr + req)
    num_drafts = tl.load(cu_num_draft_ptr + req + 1) - draft_start
    row_start = draft_start + req  # request r owns num_drafts + 1 target rows
    out_row = output_ptr + req * stride_out
    if ALL_GREEDY:
        num_accepted = _greedy_request(out_row, draft_ids_ptr, target_argmax_ptr, draft_start, row_start, num_drafts)
    elif ALL_RANDOM:
        num_accepted = _random_request(
            out_row, draft_ids_ptr, target_probs_ptr, draft_probs_ptr, uniforms_ptr + req * stride_u,
            noise_ptr + req * stride_noise, draft_start, row_start, num_drafts, vocab_size, stride_tp, stride_dp,
            HAS_DRAFT_PROBS, BLOCK_V, IEEE_DIV)
    else:
        if tl.load(is_greedy_ptr + req) != 0:
            num_accepted = _greedy_request(out_row, draft_ids_ptr, target_argmax_ptr, draft_start, row_start, num_drafts)
        else:
            num_accepted = _random_request(
                out_row, draft_ids_ptr, target_probs_ptr, draft_probs_ptr, uniforms_ptr + req * stride_u,
                noise_ptr + req * stride_noise, draft_start, row_start, num_drafts, vocab_size, stride_tp, stride_dp,
                HAS_DRAFT_PROBS, BLOCK_V, IEEE_DIV)
    tl.store(num_accepted_ptr + req, num_accepted)
    for j in range(num_accepted + 1, max_k + 1):
        tl.store(out_row + j, -1)


def rejection_sample_core_triton(
    draft_token_ids: torch.Tensor,  # [num_draft_total] int64
    cu_num_draft_tokens: torch.Tensor,  # [R + 1] int64 on the device
    max_k: int,  # max(num_draft_tokens): the output width is max_k + 1
    *,
    target_argmax: torch.Tensor | None = None,  # [num_rows] int64; needed unless all requests are random
    target_probs: torch.Tensor | None = None,  # [num_rows, V] float32; needed unless all are greedy
    draft_probs: torch.Tensor | None = None,  # [num_draft_total, V]; None => one-hot q (n-gram drafts)
    uniforms: torch.Tensor | None = None,  # [R, max_k] float32 U[0, 1)
    exponential_noise: torch.Tensor | None = None,  # [R, V] float32 Exp(1), floored at finfo.tiny
    is_greedy: torch.Tensor | None = None,  # [R] bool; None => decided by which of argmax / probs is given
) -> tuple[torch.Tensor, torch.Tensor]:  # output_token_ids [R, max_k + 1] (-1 padded), num_accepted [R]
    """The kernel entry with every random number supplied, for exact comparison with a torch
    re-implementation fed the same numbers."""
    num_reqs = cu_num_draft_tokens.shape[0] - 1
    device = draft_token_ids.device
    all_greedy = target_probs is None
    all_random = target_argmax is None
    if all_greedy and all_random:
        raise ValueError("rejection_sample_core_triton needs target_argmax, target_probs or both")
    if not (all_greedy or all_random) and is_greedy is None:
        raise ValueError("rejection_sample_core_triton: mixed batches need is_greedy")
    if not all_greedy and (uniforms is None or exponential_noise is None):
        raise ValueError("rejection_sample_core_triton: random requests need uniforms and exponential_noise")
    output = torch.empty(num_reqs, max_k + 1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(num_reqs, dtype=torch.int64, device=device)
    if num_reqs == 0:
        return output, num_accepted
    dummy = output  # stands in for pointers a specialisation never reads
    vocab_size = 1 if target_probs is None else target_probs.shape[1]
    _rejection_sample_kernel[(num_reqs,)](
        output, num_accepted, draft_token_ids, cu_num_draft_tokens,
        dummy if target_argmax is None else target_argmax,
        dummy if target_probs is None else target_probs,
        dummy if draft_probs is None else draft_probs,
        dummy if uniforms is None else uniforms,
        dummy if exponential_noise is None else exponential_noise,
        dummy if is_greedy is None else is_greedy,
        max_k, vocab_size, output.stride(0),
        0 if target_probs is None else target_probs.stride(0),
        0 if draft_probs is None else draft_probs.stride(0),
        0 if uniforms is None else uniforms.stride(0),
        0 if exponential_noise is None else exponential_noise.stride(0),
        ALL_GREEDY=all_greedy, ALL_RANDOM=all_random, HAS_DRAFT_PROBS=draft_probs is not None,
        BLOCK_V=1024, IEEE_DIV=not DEFINED_FOR_INTERPRETER,
        enable_fp_fusion=False,  # keep every product and difference rounded exactly as torch rounds it
        **launch_options(device, threads=256),
    )
    return output, num_accepted
