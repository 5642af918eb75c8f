"""TokenizerPool: parsing, tokenizing and chat templating off the event loop, bounded.

A request's CPU work before admission (strict JSON, validation, the chat template, the
tokenizer) runs on one of ``num_workers`` threads, each with its own tokenizer copy (an HF
fast tokenizer is not safe to share between threads), so /health and every running stream
keep their latency while a large request is prepared. At most ``max_pending`` jobs run or
wait at once; more are a 503 rather than an unbounded backlog of parsed bodies.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from specdec.server.protocol import APIError

logger = logging.getLogger("specdec.server")
T = TypeVar("T")


def own_copy(tokenizer):
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001 - share it; encode/decode are read-mostly
        logger.warning("could not copy the tokenizer; threads share one")
        return tokenizer


class TokenizerPool:
    def __init__(self, tokenizer, num_workers: int = 2, max_pending: int = 64):
        if num_workers < 1 or max_pending < 1:
            raise ValueError(f"--tokenizer-workers and --max-pending-prepares must be >= 1, "
                             f"got {num_workers} and {max_pending}")
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(num_workers):
            self._free.put(own_copy(tokenizer))
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="specdec-prepare")
        self.max_pending = max_pending
        self.num_pending = 0  # event-loop thread only

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(tokenizer, *args)`` on a worker thread, with a tokenizer no other thread is using."""
        if self.num_pending >= self.max_pending:
            raise APIError(503, f"{self.num_pending} requests are already being prepared "
                                f"(--max-pending-prepares {self.max_pending}); retry later", code="queue_full")
        self.num_pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._call, fn, args)
        finally:
            self.num_pending -= 1

    def _call(self, fn, args):
        tokenizer = self._free.get()
        try:
            return fn(tokenizer, *args)
        finally:
            self._free.put(tokenizer)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
