"""Per-request KV slots on top of the BlockPool: allocate / append / truncate / free.

Check/act pairs: ``get_computed_blocks`` finds a prompt's cached prefix, ``allocate_slots``
reserves room for ``num_computed + num_new`` tokens (or returns False and changes nothing),
``cache_full_blocks`` registers blocks once all their tokens are committed, ``truncate``
gives back blocks past a length (speculation's rollback), ``free`` releases everything.
"""
from __future__ import annotations

from specdec.engine.block_pool import BlockPool, KVBlock, hash_block_tokens
from specdec.engine.request import Request


def _root_hash(request: Request) -> int | None:
    """The chain's start: the base model's blocks and each adapter's never match each other (the
    same tokens have other keys and values under another adapter)."""
    lora = getattr(request, "lora_request", None)
    return None if lora is None else hash(("lora", lora.lora_int_id))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[int]] = {}  # chained hashes of the request's cached full blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

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

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] | None = None
    ) -> bool:
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
        self.pool.free_blocks(reversed(blocks))
