"""Per-request KV slots over the KV cache groups: allocate / append / truncate / free.

Check/act pairs: ``get_computed_blocks`` finds a prompt's cached prefix, ``allocate_slots``
reserves room for ``num_computed + num_new`` tokens in every group (or returns False and changes
nothing), ``cache_full_blocks`` registers blocks once all their tokens are committed, ``truncate``
gives back blocks past a length (speculation's rollback), ``free`` releases everything.

One ``GroupBlockTable`` per KV cache group (``engine/kv_layout.py``), each on its own pool: the
primary group's (the widest window) block ids are ``get_block_ids``, the others'
``get_group_block_ids``. A sliding group frees its blocks behind the window as the request
advances. Prefix caching: every group caches its full blocks under the same chained hashes; a
prefix hit is the longest prefix every group can resume from, which for a sliding group needs only
the blocks the window after the prefix reads (so its freed blocks serve as prefix until evicted).

Usage, as vLLM defines ``kv_cache_usage_perc`` (the fraction of the KV cache's memory in use; vLLM
keeps every group in one pool): the groups' blocks in use weighted by their bytes per block;
``group_usage`` reports each group's pool.
"""
from __future__ import annotations

from dataclasses import dataclass

from specdec.engine.block_pool import BlockPool, KVBlock, hash_block_tokens
from specdec.engine.group_block_table import NULL_BLOCK_ID, GroupBlockTable  # noqa: F401 (re-exported)
from specdec.engine.kv_layout import KVLayout
from specdec.engine.request import Request


def _root_hash(request: Request) -> int | None:
    """The chain's start: the base model's blocks and each adapter's never match each other (the
    same tokens have other keys and values under another adapter)."""
    lora = getattr(request, "lora_request", None)
    return None if lora is None else hash(("lora", lora.lora_int_id))


@dataclass(frozen=True)
class KVGroupUsage:
    name: str  # ``KVGroup.name``: full_attention, sliding_window_<w>
    num_blocks: int
    num_free_blocks: int

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None):
        """One group of ``num_blocks`` blocks; ``from_layout`` for several."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = [GroupBlockTable(num_blocks, block_size, enable_prefix_caching, sliding_window)]
        self.group_names = ["full_attention" if sliding_window is None else f"sliding_window_{sliding_window}"]
        self.bytes_per_block = [1]  # per group: what one block of its pool weighs in ``usage``

    @classmethod
    def from_layout(cls, layout: KVLayout, enable_prefix_caching: bool = True) -> KVCacheManager:
        manager = cls(layout.groups[0].num_blocks, layout.block_size, enable_prefix_caching, layout.groups[0].window)
        manager.groups = [GroupBlockTable(g.num_blocks, layout.block_size, enable_prefix_caching, g.window,
                                          holds_draft=bool(g.draft_layers)) for g in layout.groups]
        manager.group_names = [g.name for g in layout.groups]
        manager.bytes_per_block = [max(1, g.bytes_per_block) for g in layout.groups]
        return manager

    # the primary group's state (the only group of a model without hybrid layers)
    @property
    def pool(self) -> BlockPool:
        return self.groups[0].pool

    @property
    def req_blocks(self) -> dict[str, list[KVBlock | None]]:
        return self.groups[0].req_blocks

    @property
    def req_hashes(self) -> dict[str, list[int]]:
        return self.groups[0].req_hashes

    @property
    def sliding_window(self) -> int | None:
        return self.groups[0].sliding_window

    @sliding_window.setter
    def sliding_window(self, window: int | None) -> None:
        self.groups[0].sliding_window = window

    @property
    def usage(self) -> float:
        """The fraction of the KV cache's bytes in blocks in use (every group's pool)."""
        total = sum(g.pool.num_blocks * b for g, b in zip(self.groups, self.bytes_per_block))
        used = sum((g.pool.num_blocks - g.pool.num_free_blocks) * b for g, b in zip(self.groups, self.bytes_per_block))
        return used / total

    def group_usage(self) -> list[KVGroupUsage]:
        """Each group's pool, the primary group first."""
        return [KVGroupUsage(name, g.pool.num_blocks, g.pool.num_free_blocks)
                for name, g in zip(self.group_names, self.groups)]

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.groups[0].get_block_ids(request_id)

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The other groups' block ids, in group order (() with one group)."""
        if len(self.groups) == 1:
            return ()
        return tuple(g.get_block_ids(request_id) for g in self.groups[1:])

    def _hashes(self, request: Request, start: int, stop: int, parent: int | None = None) -> list[int]:
        """Chained hashes of the request's blocks ``start .. stop - 1`` (``parent``: block start - 1's)."""
        tokens, bs = request.all_token_ids, self.block_size
        parent = _root_hash(request) if start == 0 else parent
        out = []
        for i in range(start, stop):
            parent = hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs])
            out.append(parent)
        return out

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVBlock | None]], int]:
        """Longest cached prefix of the request's tokens, leaving at least one token to compute:
        (per group, the request's first blocks; the number of tokens they hold)."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.groups], 0
        max_blocks = (len(request.all_token_ids) - 1) // self.block_size  # the last token must be computed
        hashes = self._hashes(request, 0, max_blocks)
        self.pool.num_cache_queries += 1
        found = [g.cached_prefix(hashes, max_blocks) for g in self.groups]
        num_hit = min(len(f) for f in found)
        found = [g.cached_prefix(hashes, num_hit) if len(f) > num_hit else f for g, f in zip(self.groups, found)]
        if num_hit:
            self.pool.num_cache_hits += 1
        return found, num_hit * self.block_size

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_new_computed_blocks: int = 0) -> int:
        """Blocks the primary group still needs."""
        return self.groups[0].num_blocks_needed(request, num_new_tokens, num_new_computed_blocks)

    def free_outside_window(self, request: Request) -> int:
        """Give back the request's blocks no query can read again, in every group; -> how many."""
        return sum(g.free_outside_window(request) for g in self.groups)

    def mark_draft_caught_up(self, request: Request) -> None:
        """The draft model has seen the request's computed tokens: the groups holding draft layers
        may free behind them (``GroupBlockTable.holds_draft``)."""
        for g in self.groups:
            g.mark_draft_caught_up(request)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list | None = None) -> bool:
        """Room for ``num_new_tokens`` more in every group, or False with nothing allocated (blocks
        behind a sliding window are given back first: that is always safe). ``new_computed_blocks``:
        ``get_computed_blocks``'s per-group lists (a flat list: the primary group's alone)."""
        for g in self.groups:
            g.free_outside_window(request)
        computed = new_computed_blocks or []
        if computed and not isinstance(computed[0], list):
            computed = [computed]
        computed = computed + [[] for _ in range(len(self.groups) - len(computed))]
        if not all(g.can_allocate(request, num_new_tokens, c) for g, c in zip(self.groups, computed)):
            return False
        num_hit = len(computed[0])
        hashes = self._hashes(request, 0, num_hit) if num_hit and self.enable_prefix_caching else []
        for g, c in zip(self.groups, computed):
            g.allocate(request, num_new_tokens, c, hashes)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register every block whose tokens all have committed KV (prefix-cache entries)."""
        for g in self.groups:
            g.cache_full_blocks(request, lambda start, stop, parent: self._hashes(request, start, stop, parent))

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Give back blocks wholly past ``num_tokens`` (slots of rejected drafts)."""
        for g in self.groups:
            g.truncate(request, num_tokens)

    def free(self, request: Request) -> None:
        for g in self.groups:
            g.free(request)
