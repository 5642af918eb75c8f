"""The block tables of one KV cache group (``engine/kv_layout.py``) on the group's own BlockPool.

Sliding windows (``sliding_window=w``: every layer reading this group's tables sees only the last
w positions): a request's next query sits at ``num_computed_tokens`` or later, so keys before
``num_computed_tokens - w + 1`` are never read again, and a block wholly before that point goes
back to the pool (its prefix-cache entry stays findable until evicted). Its place in the request's
table is kept by ``None`` (block id ``NULL_BLOCK_ID`` for the worker: kernels never read those
keys, they are outside every query's window).

A group that also holds a draft model's layers (``holds_draft``) frees behind the draft's progress
instead: the draft catches up on every token it has not seen the next time it drafts, reading the
window of each, so what it may still read starts at ``min(num_computed_tokens, draft mark)``, the
mark being the request's ``num_computed_tokens`` when the draft last caught up (``mark_draft_caught_up``;
0 until then, and after a preemption; a request with ``use_speculation`` off is never drafted for).
A prefix hit there needs every block (the draft starts over from the first token).
"""
from __future__ import annotations

from specdec.engine.block_pool import BlockPool, KVBlock
from specdec.engine.request import Request

NULL_BLOCK_ID = 0  # what the worker's table holds for a block freed behind the sliding window


class GroupBlockTable:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, holds_draft: bool = False):
        self.block_size = block_size
        self.holds_draft = holds_draft
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.req_blocks: dict[str, list[KVBlock | None]] = {}  # None: freed behind the window
        self.req_hashes: dict[str, list[int]] = {}  # chained hashes of the request's cached full blocks
        self.req_num_freed: dict[str, int] = {}  # leading blocks freed behind the window
        self.req_draft_mark: dict[str, int] = {}  # holds_draft: num_computed_tokens when the draft last caught up

    def get_block_ids(self, request_id: str) -> list[int]:
        return [NULL_BLOCK_ID if b is None else b.block_id for b in self.req_blocks.get(request_id, ())]

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """The first block a query at ``num_computed_tokens`` or later can read."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def mark_draft_caught_up(self, request: Request) -> None:
        """The draft has seen every token before ``request.num_computed_tokens`` (it just drafted)."""
        if self.holds_draft:
            self.req_draft_mark[request.request_id] = request.num_computed_tokens

    def _still_read_from(self, request: Request) -> int:
        """The first position a query of the request (the target's, or the draft's catch-up) can be at."""
        if not self.holds_draft or not request.sampling_params.use_speculation:  # the latter: never drafted for
            return request.num_computed_tokens
        return min(request.num_computed_tokens, self.req_draft_mark.get(request.request_id, 0))

    def cached_prefix(self, hashes: list[int], max_blocks: int) -> list[KVBlock | None]:
        """The request's blocks for the longest prefix of ``hashes`` (at most ``max_blocks``) this
        group can resume from: every block a query after the prefix reads is cached; the blocks
        before the window are None (not taken)."""
        found = [self.pool.get_cached_block(h) for h in hashes[:max_blocks]]
        for n in range(len(found), 0, -1):
            first = 0 if self.holds_draft else self.first_needed_block(n * self.block_size)
            if all(b is not None for b in found[first:n]):
                return [None] * first + found[first:n]
        return []

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_new_computed_blocks: int = 0) -> int:
        have = len(self.req_blocks.get(request.request_id, ())) + num_new_computed_blocks
        total_tokens = request.num_computed_tokens + num_new_computed_blocks * self.block_size + num_new_tokens
        return max(0, -(-total_tokens // self.block_size) - have)

    def free_outside_window(self, request: Request) -> int:
        """Give back the request's blocks no query can read again (sliding window); -> how many."""
        blocks = self.req_blocks.get(request.request_id)
        if self.sliding_window is None or not blocks:
            return 0
        num_dead = min(self.first_needed_block(self._still_read_from(request)), len(blocks))
        done = self.req_num_freed.get(request.request_id, 0)
        if num_dead <= done:
            return 0
        dead = [b for b in blocks[done:num_dead] if b is not None]
        blocks[done:num_dead] = [None] * (num_dead - done)
        self.req_num_freed[request.request_id] = num_dead
        self.pool.free_blocks(reversed(dead))
        return len(dead)

    def can_allocate(self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock | None]) -> bool:
        needed = self.num_blocks_needed(request, num_new_tokens, len(new_computed_blocks))
        # touching a free cached block takes it out of the free queue
        num_free = self.pool.num_free_blocks - sum(1 for b in new_computed_blocks if b is not None and b.ref_cnt == 0)
        return needed <= num_free

    def allocate(self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock | None],
                 new_computed_hashes: list[int]) -> None:
        """After ``can_allocate``: take the prefix hits (None: before the window) and new blocks."""
        needed = self.num_blocks_needed(request, num_new_tokens, len(new_computed_blocks))
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.pool.touch([b for b in new_computed_blocks if b is not None])
            if not blocks:
                self.req_num_freed[request.request_id] = sum(1 for b in new_computed_blocks if b is None)
            blocks.extend(new_computed_blocks)
            self.req_hashes.setdefault(request.request_id, []).extend(new_computed_hashes)
        blocks.extend(self.pool.get_new_blocks(needed))

    def cache_full_blocks(self, request: Request, hashes_of) -> None:
        """Register every block whose tokens all have committed KV; ``hashes_of(start, stop)``: the
        request's chained block hashes."""
        if not self.enable_prefix_caching:
            return
        hashes = self.req_hashes.setdefault(request.request_id, [])
        blocks = self.req_blocks.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        if num_full <= len(hashes):
            return
        for i, h in enumerate(hashes_of(len(hashes), num_full, hashes[-1] if hashes else None), start=len(hashes)):
            hashes.append(h)
            if blocks[i] is not None:
                self.pool.cache_block(blocks[i], h)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Give back blocks wholly past ``num_tokens`` (slots of rejected drafts)."""
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        keep = -(-num_tokens // self.block_size)
        if keep < len(blocks):
            tail = [b for b in blocks[keep:] if b is not None]
            del blocks[keep:]
            self.pool.free_blocks(reversed(tail))

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_hashes.pop(request.request_id, None)
        self.req_num_freed.pop(request.request_id, None)
        self.req_draft_mark.pop(request.request_id, None)
        self.pool.free_blocks(reversed([b for b in blocks if b is not None]))
