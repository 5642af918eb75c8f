"""KVCacheManager: slots per request on the block pool, prefix-cache hits, truncate, free."""
import pytest

from specdec.engine.block_pool import hash_block_tokens
from specdec.engine.kv_cache_manager import KVCacheManager
from specdec.engine.request import Request
from specdec.sampling_params import SamplingParams

BS = 4  # block size


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams())


def admit(kv: KVCacheManager, r: Request) -> int:
    """What the scheduler does on admission: look up the prefix, allocate the rest, compute it."""
    blocks, num_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - num_hit, blocks)
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)
    return num_hit


def snapshot(kv: KVCacheManager):
    pool = kv.pool
    return (list(pool.free_queue), [b.ref_cnt for b in pool.blocks], dict(pool.cached),
            {k: list(v) for k, v in kv.req_blocks.items()}, {k: list(v) for k, v in kv.req_hashes.items()})


def test_allocate_rounds_up_to_whole_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r = req("a", range(10))
    assert kv.num_blocks_needed(r, 10) == 3
    assert kv.allocate_slots(r, 10)
    assert len(kv.get_block_ids("a")) == 3 and kv.pool.num_free_blocks == 5
    r.num_computed_tokens = 10
    assert kv.num_blocks_needed(r, 2) == 0  # room left in the third block
    assert kv.num_blocks_needed(r, 3) == 1
    assert kv.allocate_slots(r, 3)
    assert len(kv.get_block_ids("a")) == 4


def test_allocate_fails_cleanly_when_out_of_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", range(100, 108))
    admit(kv, a)  # 2 blocks, both cached
    kv.free(a)  # free but still cached
    b = req("b", range(12))
    assert kv.allocate_slots(b, 12)  # 3 blocks: evicts one of a's
    before = snapshot(kv)
    c = req("c", range(200, 208))
    assert not kv.allocate_slots(c, 8)  # needs 2, only 1 free
    assert snapshot(kv) == before and "c" not in kv.req_blocks
    # a prefix hit on a free cached block counts against the free blocks too
    d = req("d", list(range(100, 108)) + [1])
    blocks, num_hit = kv.get_computed_blocks(d)
    assert num_hit == BS  # a's first block survived (its tail was evicted for b)
    before = snapshot(kv)
    assert not kv.allocate_slots(d, d.num_tokens - num_hit, blocks)  # 2 new blocks, 0 really free
    assert snapshot(kv) == before and blocks[0][0].ref_cnt == 0  # [group][block]


def test_shared_prefix_shares_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prefix = [5, 6, 7, 8, 9, 10, 11, 12]
    a = req("a", prefix + [1, 2, 3])
    assert admit(kv, a) == 0
    b = req("b", prefix + [4])
    assert admit(kv, b) == 8
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[2] != kv.get_block_ids("a")[2]
    assert [kv.pool.blocks[i].ref_cnt for i in kv.get_block_ids("a")[:2]] == [2, 2]
    assert kv.pool.num_cache_hits == 1 and kv.pool.num_cache_queries == 2
    # the hashes b records for its shared blocks are the chained hashes of its own tokens
    h0 = hash_block_tokens(None, prefix[:4])
    assert kv.req_hashes["b"][:2] == [h0, hash_block_tokens(h0, prefix[4:])]


def test_a_different_earlier_block_means_no_hit():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    b = req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])  # same second block, different first block
    assert kv.get_computed_blocks(b) == ([[]], 0)


def test_a_hit_leaves_at_least_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = list(range(8))
    admit(kv, req("a", tokens))
    blocks, num_hit = kv.get_computed_blocks(req("b", tokens))  # identical, block-aligned prompt
    assert num_hit == 4 and len(blocks[0]) == 1  # the last block is recomputed to get its logits


def test_hit_on_freed_blocks_revives_them():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(9)))
    admit(kv, a)
    shared = kv.get_block_ids("a")[:2]
    kv.free(a)
    assert kv.pool.num_free_blocks == 4
    b = req("b", list(range(8)) + [50, 51, 52, 53, 54, 55, 56, 57])
    assert admit(kv, b) == 8  # needs 2 hit blocks + 2 new: fits exactly
    assert kv.get_block_ids("b")[:2] == shared and kv.pool.num_free_blocks == 0


def test_free_returns_the_tail_first_so_it_is_evicted_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(12)))
    admit(kv, a)  # 3 full cached blocks
    kv.free(a)
    kv.allocate_slots(req("x", [0]), 2 * BS)  # the spare block, then evicts exactly one cached block
    blocks, num_hit = kv.get_computed_blocks(req("b", list(range(12)) + [99]))
    assert num_hit == 2 * BS  # a's first two blocks survived; its tail was evicted


def test_truncate_gives_back_whole_blocks_past_the_length():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r = req("a", range(5))
    kv.allocate_slots(r, 5 + 6)  # 11 tokens incl. 6 draft slots -> 3 blocks
    ids = kv.get_block_ids("a")
    kv.truncate(r, 8)
    assert kv.get_block_ids("a") == ids[:2] and kv.pool.blocks[ids[2]].ref_cnt == 0
    assert kv.pool.num_free_blocks == 6
    kv.truncate(r, 5)
    assert kv.get_block_ids("a") == ids[:2]
    kv.truncate(r, 100)  # past the end: nothing to give back
    assert kv.get_block_ids("a") == ids[:2]
    kv.truncate(req("unknown", [1]), 0)  # no blocks: no-op


def test_free_releases_everything_and_is_idempotent_per_request():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a, b = req("a", range(6)), req("b", range(6))
    admit(kv, a)
    admit(kv, b)  # shares a's first block
    kv.free(a)
    assert kv.pool.num_free_blocks == 8 - 2  # b still holds the shared block and its own
    kv.free(b)
    assert kv.pool.num_free_blocks == 8
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    kv.free(b)  # the request holds nothing any more: no double free
    assert kv.pool.num_free_blocks == 8 and kv.req_blocks == {}


def test_freeing_a_block_twice_through_the_pool_raises():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    r = req("a", range(3))
    kv.allocate_slots(r, 3)
    blocks = list(kv.req_blocks["a"])
    kv.free(r)
    with pytest.raises(RuntimeError, match="double free"):
        kv.pool.free_blocks(blocks)


def test_cache_full_blocks_registers_only_committed_full_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r = req("a", range(10))
    kv.allocate_slots(r, 10)
    r.num_computed_tokens = 7
    kv.cache_full_blocks(r)
    assert len(kv.req_hashes["a"]) == 1 and len(kv.pool.cached) == 1
    r.num_computed_tokens = 10
    kv.cache_full_blocks(r)
    assert len(kv.req_hashes["a"]) == 2 and len(kv.pool.cached) == 2


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    admit(kv, req("a", range(9)))
    assert kv.get_computed_blocks(req("b", range(9))) == ([[]], 0)
    assert kv.pool.cached == {}


# ---- sliding windows: blocks no query can read again go back to the pool ----

def decode(kv: KVCacheManager, r: Request, token: int) -> None:
    """One decode step as the scheduler and the commit run it."""
    assert kv.allocate_slots(r, 1)
    r.append_output_token(token)
    r.num_computed_tokens += 1
    kv.cache_full_blocks(r)


def test_blocks_behind_the_window_are_freed_as_the_request_advances():
    window = 6  # a query at position p sees keys p - 5 .. p
    kv = KVCacheManager(num_blocks=8, block_size=BS, sliding_window=window)
    r = req("a", range(10))
    admit(kv, r)  # positions 0..9: 3 blocks
    assert kv.free_outside_window(r) == 1  # the next query (position 10) sees keys 5..: block 0 (0..3) is dead
    ids = kv.get_block_ids("a")
    assert ids[0] == 0 and kv.req_blocks["a"][0] is None and kv.pool.num_free_blocks == 8 - 2
    for t in range(6):  # positions 10..15
        decode(kv, r, 100 + t)
        live = [b for b in kv.req_blocks["a"] if b is not None]
        first_needed = r.num_computed_tokens - window + 1
        assert all(b is not None for b in kv.req_blocks["a"][first_needed // BS:])  # what the window sees stays
        assert len(live) <= -(-(window + BS) // BS) + 1
    assert kv.free_outside_window(r) == 0  # idempotent
    kv.free(r)
    assert kv.pool.num_free_blocks == 8 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_window_freed_blocks_stay_findable_in_the_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=BS, sliding_window=4)
    a = req("a", range(12))
    admit(kv, a)
    first, _, last = kv.req_blocks["a"]
    assert kv.free_outside_window(a) == 2 and first.ref_cnt == 0  # free, still cached
    kv.free(a)
    b = req("b", list(range(12)) + [7])
    blocks, num_hit = kv.get_computed_blocks(b)
    # b's first query (position 12) reads keys 9..: only the last block is taken, the ones before
    # the window stay free
    assert num_hit == 12 and blocks == [[None, None, last]]
    assert kv.allocate_slots(b, b.num_tokens - num_hit, blocks)
    assert last.ref_cnt == 1 and first.ref_cnt == 0 and kv.req_blocks["b"][:2] == [None, None]
    assert kv.free_outside_window(b) == 0  # the hit's leading blocks count as freed
    kv.free(b)
    assert kv.pool.num_free_blocks == 8


def test_without_a_window_nothing_is_freed_early():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r = req("a", range(20))
    admit(kv, r)
    assert kv.free_outside_window(r) == 0 and None not in kv.req_blocks["a"]


# ---- KV cache groups: a full-attention group and a sliding one, each on its own pool ----

def hybrid(num_full: int, num_sliding: int, window: int, draft_layers: tuple[int, ...] = ()) -> KVCacheManager:
    """Bytes per block: 100 full, 300 sliding. ``draft_layers``: a draft's layers in the sliding group."""
    from specdec.engine.kv_layout import KVGroup, KVLayout

    return KVCacheManager.from_layout(KVLayout(BS, (KVGroup(None, (1,), num_full, 100),
                                                    KVGroup(window, (0,), num_sliding, 300, draft_layers))))


def test_only_the_sliding_group_frees_behind_its_window():
    kv = hybrid(num_full=16, num_sliding=16, window=6)
    r = req("a", range(10))
    admit(kv, r)
    full, sliding = kv.groups
    for _ in range(20):  # decode: one token per step
        assert kv.allocate_slots(r, 1)
        r.append_output_token(1)
        r.num_computed_tokens = r.num_tokens - 1
    assert len(kv.get_block_ids("a")) == len(kv.get_group_block_ids("a")[0]) == -(-r.num_tokens // BS)
    assert sum(b is not None for b in full.req_blocks["a"]) == -(-r.num_tokens // BS)  # everything kept
    assert sum(b is not None for b in sliding.req_blocks["a"]) <= -(-6 // BS) + 2  # the window's blocks
    assert full.pool.usage > sliding.pool.usage
    # vLLM's kv_cache_usage_perc: the bytes in use over all bytes, every group's blocks by their weight
    used = [g.pool.num_blocks - g.pool.num_free_blocks for g in kv.groups]
    assert kv.usage == pytest.approx((used[0] * 100 + used[1] * 300) / (16 * 100 + 16 * 300))
    assert [(u.name, u.num_blocks, u.num_free_blocks) for u in kv.group_usage()] == [
        ("full_attention", 16, 16 - used[0]), ("sliding_window_6", 16, 16 - used[1])]
    kv.free(r)
    assert full.pool.num_free_blocks == 16 and sliding.pool.num_free_blocks == 16


def test_allocation_needs_room_in_every_group_or_takes_nothing():
    kv = hybrid(num_full=16, num_sliding=2, window=8)
    a = req("a", range(12))
    before = [(g.pool.num_free_blocks, dict(g.req_blocks)) for g in kv.groups]
    assert not kv.allocate_slots(a, 12)  # 3 blocks: the full group has them, the sliding one does not
    assert [(g.pool.num_free_blocks, dict(g.req_blocks)) for g in kv.groups] == before


def test_a_prefix_hit_needs_every_group_to_resume_from_it():
    kv = hybrid(num_full=16, num_sliding=16, window=4)
    a = req("a", range(16))
    admit(kv, a)
    kv.free_outside_window(a)  # the sliding group keeps blocks 3 (its window) only
    b = req("b", list(range(16)) + [5])
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 16 and [len(g) for g in blocks] == [4, 4] and blocks[1][:3] == [None] * 3
    kv.free(a)
    sliding = kv.groups[1]
    sliding.pool.reset_prefix_cache()  # the sliding blocks are evicted: nothing to resume from
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 0 and blocks == [[], []]


def test_a_group_holding_draft_layers_frees_behind_what_the_draft_has_seen():
    """The draft catches up on unseen tokens only when it drafts: until then (a prompt, steps that
    draft nothing) its window's keys are kept; after, blocks behind its window are freed."""
    kv = hybrid(num_full=16, num_sliding=16, window=4, draft_layers=(0,))
    sliding = kv.groups[1]
    r = req("a", range(16))
    admit(kv, r)
    assert kv.free_outside_window(r) == 0  # the draft has seen nothing: all 4 blocks kept
    for step in range(8):  # decode; the draft drafts from step 4 on
        assert kv.allocate_slots(r, 1)
        r.append_output_token(1)
        r.num_computed_tokens = r.num_tokens - 1
        if step >= 4:
            kv.mark_draft_caught_up(r)
        live = sum(b is not None for b in sliding.req_blocks["a"])
        if step < 4:
            assert live == -(-r.num_tokens // BS)
    # what the draft may still read (from its last catch-up on, minus the window) stays
    mark = sliding.req_draft_mark["a"]
    assert mark == r.num_computed_tokens
    assert kv.free_outside_window(r) > 0
    assert all(b is not None for b in sliding.req_blocks["a"][(mark - 4 + 1) // BS:])
    assert sum(b is not None for b in sliding.req_blocks["a"]) <= -(-4 // BS) + 2
    kv.free(r)
    assert "a" not in sliding.req_draft_mark and sliding.pool.num_free_blocks == 16


def test_a_prefix_hit_in_a_group_holding_draft_layers_needs_every_block():
    kv = hybrid(num_full=16, num_sliding=16, window=4, draft_layers=(0,))
    a = req("a", range(16))
    admit(kv, a)
    kv.mark_draft_caught_up(a)
    assert kv.free_outside_window(a) == 3  # blocks 0..2, behind the window: free, still cached
    kv.free(a)
    b = req("b", list(range(16)) + [5])
    blocks, num_hit = kv.get_computed_blocks(b)
    # the draft starts b over from its first token: the hit takes every block back
    assert num_hit == 16 and None not in blocks[1] and len(blocks[1]) == 4
    kv.groups[1].pool.reset_prefix_cache()  # a sliding block evicted: no hit
    assert kv.get_computed_blocks(b)[1] == 0
