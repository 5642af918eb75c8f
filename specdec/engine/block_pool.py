"""Paged KV blocks: a free queue with LRU eviction, reference counts and the prefix-cache map.

Pure Python, no tensors: the block ids it hands out index the per-layer cache tensors.
A block with ``ref_cnt == 0`` sits in the free queue; if it also has a hash it stays
findable in the prefix cache until it is reused for something else (evicted).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained block hash: a block's identity is its tokens *and* everything before them."""
    return hash((parent_hash, tuple(token_ids)))


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # insertion order = eviction order (least recently freed first)
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, KVBlock] = {}
        self.num_cache_hits = 0
        self.num_cache_queries = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} KV blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits (pulling free ones out of the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; pass a request's blocks tail-first so its tail is evicted first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if self.enable_caching and block.block_hash is not None:
                    self.free_queue[block.block_id] = block
                else:
                    block.block_hash = None
                    # uncached blocks are worthless: reuse them first
                    self.free_queue[block.block_id] = block
                    self.free_queue.move_to_end(block.block_id, last=False)

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def cache_block(self, block: KVBlock, block_hash: int) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
