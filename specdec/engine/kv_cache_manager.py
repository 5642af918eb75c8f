"""Per-request KV slots on top of the BlockPool: allocate / append / truncate / free.

Check/act pairs: ``get_computed_blocks`` finds a prompt's cached prefix, ``allocate_slots``
reserves room for ``num_computed + num_new`` tokens (or returns False and changes nothing),
``cache_full_blocks`` registers blocks once all their tokens are committed, ``truncate``
gives back blocks past a length (speculation's rollback), ``free`` releases everything.

Sliding windows (``sliding_window=w``: every layer of every model reading these block tables
sees only the last w positions): a request's next query sits at ``num_computed_tokens`` or
later, so keys before ``num_computed_tokens - w + 1`` are never read again, and a block wholly
before that point goes back to the pool (its prefix-cache entry stays findable until evicted).
Its place in the request's table is kept by ``None`` (block id ``NULL_BLOCK_ID`` for the worker:
kernels never read those keys, they are outside every query's window).
"""
from __future__ import annotations

from specdec.engine.block_pool import BlockPool, KVBlock, hash_block_tokens
from specdec.engine.request import Request


NULL_BLOCK_ID = 0  # what the worker's table holds for a block freed behind the sliding window


def _root_hash(request: Request) -> int | None:
    """The chain's start: the base model's blocks and each adapter's never match each other (the
    same tokens have other keys and values under another adapter)."""
    lora = getattr(request, "lora_request", None)
    return None if lora is None else hash(("lora", lora.lora_int_id))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.req_blocks: dict[str, list[KVBlock | None]] = {}  # None: freed behind the window
        self.req_hashes: dict[str, list[int]] = {}  # chained hashes of the request's cached full blocks
        self.req_num_freed: dict[str, int] = {}  # leading blocks freed behind the window

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return [NULL_BLOCK_ID if b is None else b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's tokens, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return [], 0
        tokens = request.all_token_ids
        bs = self.block_size
        max_blocks = (len(tokens) - 1) // bs  # the last token must be computed to get logits
        blocks, parent = [], _root_hash(request)
        self.pool.num_cache_queries += 1
        for i in range(max_blocks):
            h = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs])
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            blocks.append(block)
            parent = h
        if blocks:
            self.pool.num_cache_hits += 1
        return blocks, len(blocks) * bs

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_new_computed_blocks: int = 0) -> int:
        have = len(self.req_blocks.get(request.request_id, ())) + num_new_computed_blocks
        total_tokens = request.num_computed_tokens + num_new_computed_blocks * self.block_size + num_new_tokens
        return max(0, -(-total_tokens // self.block_size) - have)

    def free_outside_window(self, request: Request) -> int:
        """Give back the request's blocks no query can read again (sliding window); -> how many."""
        blocks = self.req_blocks.get(request.request_id)
        if self.sliding_window is None or not blocks:
            return 0
        first_needed = request.num_computed_tokens - self.sliding_window + 1  # first key the next query sees
        num_dead = min(max(0, first_needed) // self.block_size, len(blocks))
        done = self.req_num_freed.get(request.request_id, 0)
        if num_dead <= done:
            return 0
        dead = blocks[done:num_dead]
        blocks[done:num_dead] = [None] * len(dead)
        self.req_num_freed[request.request_id] = num_dead
        self.pool.free_blocks(reversed(dead))
        return len(dead)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Room for ``num_new_tokens`` more, or False with nothing allocated (blocks behind the
        sliding window are given back first: that is always safe)."""
        self.free_outside_window(request)
        new_computed_blocks = new_computed_blocks or []
        needed = self.num_blocks_needed(request, num_new_tokens, len(new_computed_blocks))
        # touching a free cached block takes it out of the free queue
        num_free = self.pool.num_free_blocks - sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if needed > num_free:
            return False
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.req_hashes.setdefault(request.request_id, []).extend(b.block_hash for b in new_computed_blocks)
        blocks.extend(self.pool.get_new_blocks(needed))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register every block whose tokens all have committed KV (prefix-cache entries)."""
        if not self.enable_prefix_caching:
            return
        hashes = self.req_hashes.setdefault(request.request_id, [])
        blocks = self.req_blocks.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        if num_full <= len(hashes):
            return
        tokens = request.all_token_ids
        bs = self.block_size
        parent = hashes[-1] if hashes else _root_hash(request)
        for i in range(len(hashes), num_full):
            parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(parent)
            self.pool.cache_block(blocks[i], parent)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Give back blocks wholly past ``num_tokens`` (slots of rejected drafts)."""
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        keep = -(-num_tokens // self.block_size)
        if keep < len(blocks):
            tail = blocks[keep:]
            del blocks[keep:]
            self.pool.free_blocks(reversed(tail))

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_hashes.pop(request.request_id, None)
        self.req_num_freed.pop(request.request_id, None)
        self.pool.free_blocks(reversed([b for b in blocks if b is not None]))
