"""Timed forwards for the adaptive cost model (run at start-up, before any request owns a block)."""
from __future__ import annotations

import time

import torch

from specdec.worker.device import synchronize


def probe_tokens(runner, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token ids for timed rows: pseudo-random over the model's vocabulary (fixed seed). One token
    repeated would send every row of a mixture-of-experts target to the same experts, timing a
    K+1-row verification at one row's experts; distinct tokens route as real rows do, so the
    measurement reads the union of the experts they choose (dense models: the same cost either way)."""
    vocab = getattr(getattr(runner.model, "config", None), "vocab_size", None) or 2
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def time_forward(runner, num_tokens: int, repeats: int = 2) -> float:
    """Median-ish (best of ``repeats``) seconds of one forward over ``num_tokens`` decode-like rows."""
    bs = runner.block_size
    num_tokens = min(num_tokens, runner.num_blocks * bs // 2)
    # one row per "request", each with a short context, the way verification batches look
    ctx = 32
    blocks_per_req = -(-(ctx + 1) // bs)
    num_reqs = max(1, min(num_tokens, runner.num_blocks // blocks_per_req))
    per_req = [num_tokens // num_reqs + (1 if i < num_tokens % num_reqs else 0) for i in range(num_reqs)]
    tables = [[(i * blocks_per_req + j) % runner.num_blocks for j in range(blocks_per_req + 1)] for i in range(num_reqs)]
    batch = runner.prepare(probe_tokens(runner, per_req), [ctx] * num_reqs, tables,
                           [list(range(n)) for n in per_req])
    return _best_time(runner, batch, repeats)


def time_verify_forward(runner, num_reqs: int, query_len: int, context: int, repeats: int = 5) -> float:
    """Best-of-``repeats`` seconds of one forward where each of ``num_reqs`` requests feeds
    ``query_len`` rows (1: decode; K + 1: verification) after ``context`` cached positions.
    Writes KV into blocks it does not own: call it before the engine serves any request."""
    bs = runner.block_size
    per_req = -(-(context + query_len) // bs)
    if num_reqs * per_req > runner.num_blocks:
        raise ValueError(f"{num_reqs} requests of {context + query_len} tokens need {num_reqs * per_req} KV blocks; "
                         f"the cache has {runner.num_blocks}")
    tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(num_reqs)]
    batch = runner.prepare(probe_tokens(runner, [query_len] * num_reqs), [context] * num_reqs, tables,
                           [list(range(query_len))] * num_reqs)
    return _best_time(runner, batch, repeats)


def verification_batch_sizes(runner, max_num_seqs: int, max_rows: int, context: int = 32,
                             largest: int = 8) -> tuple[int, ...]:
    """Batch sizes on which to time verification-shaped passes (``time_verify_forward``) for the
    cost model: powers of two up to ``largest`` and ``max_num_seqs`` whose ``max_rows`` rows per
    request fit the KV cache. () for a target without mixture-of-experts layers: a dense pass
    costs about the same per row whatever the batch's shape, and the token-count calibration
    prices it. A MoE pass reads the union of the experts its rows route to, so B requests of
    K + 1 rows cost what that union costs: measured, not extrapolated from one-row passes."""
    from specdec.layers.moe import moe_layers

    if not moe_layers(runner.model):
        return ()
    per_req = -(-(context + max_rows) // runner.block_size)
    sizes, batch = [], 1
    while batch <= min(largest, max_num_seqs) and batch * per_req <= runner.num_blocks:
        sizes.append(batch)
        batch *= 2
    return tuple(sizes)


def _best_time(runner, batch, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        t = time.perf_counter()
        runner.forward(batch)
        synchronize(runner.device)
        best = min(best, time.perf_counter() - t)
    return best
