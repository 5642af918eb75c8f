"""Timed forwards for the adaptive cost model (run at start-up, before any request owns a block)."""
from __future__ import annotations

import time

from specdec.worker.device import synchronize


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
    batch = runner.prepare([[1] * n for n in per_req], [ctx] * num_reqs, tables,
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
    batch = runner.prepare([[1] * query_len] * num_reqs, [context] * num_reqs, tables,
                           [list(range(query_len))] * num_reqs)
    return _best_time(runner, batch, repeats)


def _best_time(runner, batch, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        t = time.perf_counter()
        runner.forward(batch)
        synchronize(runner.device)
        best = min(best, time.perf_counter() - t)
    return best
