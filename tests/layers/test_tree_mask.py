"""Packed tree masks (the bits kernels read) and the reference's tree rule."""
import pytest
import torch

from specdec.layers.attention import AttentionMetadata, paged_attention_reference, paged_attention_torch
from specdec.layers.tree_mask import num_words_for, pack_rows, pack_tree_masks, unpack_rows
from specdec.spec_decode.tree import ancestor_mask


@pytest.mark.parametrize("width, offset", [(1, 0), (31, 1), (32, 0), (33, 31), (70, 5)])
def test_pack_rows_round_trips_every_bit(width, offset):
    gen = torch.Generator().manual_seed(width)
    mask = torch.rand(5, width, generator=gen) < 0.5
    mask[0] = True  # bit 31 set: the word is negative in int32
    num_words = num_words_for(width)
    bits = pack_rows(mask, num_words, offset)
    assert bits.dtype == torch.int32 and bits.shape == (5, num_words)
    assert torch.equal(unpack_rows(bits, width, offset), mask)
    assert not unpack_rows(bits, offset).any()  # nothing below the offset
    if offset + width >= 32:
        assert int(bits[0, 0]) < 0


def test_pack_tree_masks_aligns_bits_to_key_positions_and_bases_causal_requests_at_seq_len():
    mask = ancestor_mask([-1, 0, 0])  # [4, 3]
    packed = pack_tree_masks([None, (30, mask)], [0, 2, 6], [7, 33], torch.device("cpu"))
    assert packed.base.tolist() == [7, 30]
    assert packed.bits.shape == (6, 2) and not packed.bits[:2].any()
    # keys 30..32: bits 30, 31 of word 0 and bit 0 of word 1
    assert torch.equal(unpack_rows(packed.bits[2:], 3, offset=30), mask)


def test_pack_tree_masks_names_a_mask_that_does_not_fit():
    with pytest.raises(ValueError, match=r"tree_masks\[0\]"):
        pack_tree_masks([(10, torch.ones(4, 2, dtype=torch.bool))], [0, 4], [13], torch.device("cpu"))
    with pytest.raises(ValueError, match="does not fit 1 words"):
        pack_rows(torch.ones(1, 33, dtype=torch.bool), 1)


def test_rows_before_a_tree_stay_causal():
    """A tree fed behind 3 real rows: those rows see no later real token (the torch path agrees)."""
    gen = torch.Generator().manual_seed(0)
    block_size, context, rows_before, parents = 4, 5, 3, [-1, 0, -1]
    seq_len = context + rows_before + len(parents)
    kv_cache = torch.randn(2, 4, block_size, 1, 8, generator=gen)
    query = torch.randn(rows_before + len(parents), 2, 8, generator=gen)
    meta = AttentionMetadata(torch.tensor([0, 6]), torch.tensor([seq_len]), torch.tensor([[0, 1, 2, 3]]),
                             torch.zeros(6, dtype=torch.int64), [0, 6], [seq_len], block_size,
                             [(context + rows_before, ancestor_mask(parents, rows_before))])
    out = paged_attention_reference(query, kv_cache, meta, 0.5)
    # real row 0 sits at slot `context`: it sees keys 0..context, as a causal row would
    keys = kv_cache[0].reshape(-1, 1, 8)[:context + 1, 0]
    values = kv_cache[1].reshape(-1, 1, 8)[:context + 1, 0]
    expected = torch.softmax(query[0] @ keys.T * 0.5, dim=-1) @ values
    torch.testing.assert_close(out[0], expected)
    # node 1 (parent node 0) sees the context, the real rows, node 0 and itself, not node 2
    allowed = list(range(context + rows_before)) + [context + rows_before, context + rows_before + 1]
    expected = torch.softmax(query[4] @ kv_cache[0].reshape(-1, 1, 8)[allowed, 0].T * 0.5, dim=-1) \
        @ kv_cache[1].reshape(-1, 1, 8)[allowed, 0]
    torch.testing.assert_close(out[4], expected)
    torch.testing.assert_close(paged_attention_torch(query, kv_cache, meta, 0.5), out, atol=1e-5, rtol=1e-5)
