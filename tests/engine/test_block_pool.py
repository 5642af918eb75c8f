"""BlockPool: reference counts, the free queue's LRU eviction order, the prefix-cache map."""
import pytest

from specdec.engine.block_pool import BlockPool, hash_block_tokens


def free_ids(pool: BlockPool) -> list[int]:
    return list(pool.free_queue)


def test_new_pool_is_all_free_in_id_order():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 5 and pool.usage == 0.0
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_pool_needs_a_block(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks)


def test_get_new_blocks_takes_from_the_head_with_one_reference():
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.num_free_blocks == 1 and pool.usage == 0.75


def test_asking_for_too_many_blocks_fails_without_side_effects():
    pool = BlockPool(4)
    held = pool.get_new_blocks(2)
    pool.cache_block(held[0], 123)
    pool.free_blocks([held[0]])  # cached and free: must stay cached after the failed call
    before = (free_ids(pool), [b.ref_cnt for b in pool.blocks], dict(pool.cached))
    with pytest.raises(RuntimeError, match="only 3 free"):
        pool.get_new_blocks(4)
    assert (free_ids(pool), [b.ref_cnt for b in pool.blocks], dict(pool.cached)) == before


def test_free_drops_one_reference_and_double_free_raises():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])  # a second holder (a prefix-cache hit)
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and block.block_id not in pool.free_queue
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and block.block_id in pool.free_queue
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 3


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_block(a, hash_block_tokens(None, [1, 2]))
    pool.cache_block(b, hash_block_tokens(a.block_hash, [3, 4]))
    pool.free_blocks([b, a])  # cached: to the tail, in this order
    pool.free_blocks([c, d])  # uncached: worthless, to the head
    assert free_ids(pool)[:2] in ([c.block_id, d.block_id], [d.block_id, c.block_id])
    assert free_ids(pool)[2:] == [b.block_id, a.block_id]
    got = pool.get_new_blocks(2)
    assert {x.block_id for x in got} == {c.block_id, d.block_id}
    assert pool.get_cached_block(a.block_hash) is a and pool.get_cached_block(b.block_hash) is b


def test_lru_eviction_removes_the_least_recently_freed_cached_block():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    hashes = [hash_block_tokens(None, [i]) for i in range(3)]
    for block, h in zip(blocks, hashes):
        pool.cache_block(block, h)
    for block in (blocks[1], blocks[0], blocks[2]):  # free order = eviction order
        pool.free_blocks([block])
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is blocks[1]
    assert evicted.block_hash is None and pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0] and pool.get_cached_block(hashes[2]) is blocks[2]
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is blocks[0] and pool.get_cached_block(hashes[0]) is None


def test_touching_a_free_cached_block_revives_it():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [7, 7])
    pool.cache_block(block, h)
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2
    hit = pool.get_cached_block(h)
    assert hit is block
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 1 and hit.block_id not in pool.free_queue
    (other,) = pool.get_new_blocks(1)  # must not hand out the revived block
    assert other is not block and pool.get_cached_block(h) is block


def test_chained_hash_depends_on_everything_before():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(first, [5, 6]) == hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6])
    assert hash_block_tokens(first, [5, 6]) != hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 9]), [5, 6])
    assert hash_block_tokens(first, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])


def test_duplicate_content_keeps_the_first_block_findable():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1])
    pool.cache_block(a, h)
    pool.cache_block(b, h)  # same content computed twice (two requests in one step)
    assert pool.get_cached_block(h) is a
    pool.free_blocks([b, a])
    pool.get_new_blocks(2)  # the uncached spare first, then b: evicting b must not drop a's entry
    assert pool.get_cached_block(h) is a


def test_caching_disabled_never_hits():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_block(block, h)
    assert block.block_hash is None and pool.get_cached_block(h) is None
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2


def test_reset_prefix_cache_forgets_every_hash():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    for i, block in enumerate(blocks):
        pool.cache_block(block, hash_block_tokens(None, [i]))
    pool.free_blocks(blocks[:1])
    pool.reset_prefix_cache()
    assert pool.cached == {} and all(b.block_hash is None for b in pool.blocks)
    assert pool.get_cached_block(hash_block_tokens(None, [0])) is None
    assert blocks[1].ref_cnt == 1  # held blocks stay held
