"""MLA over the latent cache: the batched path equals the per-request reference, and the absorbed
form equals attention with the keys and values expanded per head (what transformers computes)."""
import pytest
import torch

from specdec.layers.attention import AttentionMetadata
from specdec.layers.mla import (
    expanded_form_min_rows, latent_cache_shape, mla_attention, mla_attention_expanded, mla_attention_reference,
    write_latent,
)

HEADS, LATENT, ROPE, NOPE, V = 4, 16, 8, 8, 12


def _setup(q_lens, extra, block_size, tree_masks=None, seed=0):
    """A paged latent cache filled for requests of context q_len + extra, and their metadata."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + e for q, e in zip(q_lens, extra)]
    num_blocks = 64
    cache = torch.zeros(latent_cache_shape(num_blocks, block_size, LATENT, ROPE))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, rows, cursor = [], [], 0
    for seq_len in seq_lens:
        n = -(-seq_len // block_size)
        tables.append(perm[cursor:cursor + n])
        cursor += n
        latent = torch.randn(seq_len, LATENT + ROPE, generator=gen)
        slots = torch.tensor([tables[-1][p // block_size] * block_size + p % block_size for p in range(seq_len)])
        write_latent(latent, cache, slots)
        rows.append(latent)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(torch.tensor(qsl), torch.tensor(seq_lens),
                             torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                             torch.zeros(qsl[-1], dtype=torch.long), qsl, seq_lens, block_size, tree_masks)
    query = torch.randn(qsl[-1], HEADS, LATENT + ROPE, generator=gen)
    return query, cache, meta, rows


@pytest.mark.parametrize("q_lens,extra,block_size", [
    ([1, 1, 1], [9, 0, 21], 4),  # decode rows
    ([5, 5], [3, 17], 8),  # K+1 verification rows
    ([7, 1, 4, 1], [0, 12, 30, 2], 8),  # a prefill chunk beside decode and verification rows (padded)
    ([24, 1, 6], [8, 5, 0], 8),  # a prefill chunk after a prefix hit, longer than the padding limit
])
def test_batched_equals_reference(q_lens, extra, block_size):
    query, cache, meta, _ = _setup(q_lens, extra, block_size)
    ref = mla_attention_reference(query, cache, meta, 0.3, LATENT)
    torch.testing.assert_close(mla_attention(query, cache, meta, 0.3, LATENT), ref, rtol=1e-5, atol=1e-5)


def test_tree_masks():
    """Request 0 verifies a 4-node tree (root, two children, a grandchild under the second) from
    base 10; request 1 decodes beside it. A node sees its ancestors only."""
    node_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    query, cache, meta, _ = _setup([4, 1], [10, 6], 4, tree_masks=[(10, node_mask), None])
    out = mla_attention(query, cache, meta, 0.3, LATENT)
    ref = mla_attention_reference(query, cache, meta, 0.3, LATENT)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    causal = mla_attention_reference(query, cache, _setup([4, 1], [10, 6], 4)[2], 0.3, LATENT)
    assert not torch.allclose(causal[2], ref[2])  # negative control: node 2 does not see node 1


def test_absorbed_equals_expanded():
    """q_nope W_UK against c_kv then W_UV, versus keys [W_UK c_kv, k_rope] and values W_UV c_kv
    per head with q [q_nope, q_rope]: the same output (a causal prefill of one request)."""
    gen = torch.Generator().manual_seed(1)
    q_len, scale = 9, 0.25
    query, cache, meta, rows = _setup([q_len], [0], 4, seed=2)
    w_uk, w_uv = torch.randn(HEADS, NOPE, LATENT, generator=gen), torch.randn(HEADS, V, LATENT, generator=gen)
    q_nope, q_rope = torch.randn(q_len, HEADS, NOPE, generator=gen), torch.randn(q_len, HEADS, ROPE, generator=gen)
    query = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope], dim=-1)
    out = torch.einsum("thr,hvr->thv", mla_attention(query, cache, meta, scale, LATENT), w_uv)
    c_kv, k_rope = rows[0][:, :LATENT], rows[0][:, LATENT:]
    keys = torch.cat([torch.einsum("lr,hnr->hln", c_kv, w_uk), k_rope.expand(HEADS, -1, -1)], dim=-1)
    values = torch.einsum("lr,hvr->hlv", c_kv, w_uv)
    q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)
    mask = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    expected = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    torch.testing.assert_close(out, expected.transpose(0, 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tree", [False, True])
def test_expanded_equals_absorbed(tree):
    """The expanded form (long prefill chunks) gives the absorbed form's output on a mixed step:
    a long chunk after a prefix hit, decode rows, and a tree or a verification run."""
    node_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    masks = [None, None, (5, node_mask)] if tree else None
    gen = torch.Generator().manual_seed(3)
    _, cache, meta, _ = _setup([30, 1, 3], [6, 9, 5], 8, tree_masks=masks)
    w_uk, w_uv = torch.randn(HEADS, NOPE, LATENT, generator=gen), torch.randn(HEADS, V, LATENT, generator=gen)
    q_nope, q_rope = torch.randn(34, HEADS, NOPE, generator=gen), torch.randn(34, HEADS, ROPE, generator=gen)
    absorbed = mla_attention(torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope], -1), cache, meta,
                             0.3, LATENT)
    expected = torch.einsum("thr,hvr->thv", absorbed, w_uv)
    out = mla_attention_expanded(q_nope, q_rope, cache, meta, 0.3, w_uk, w_uv)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_expanded_form_threshold():
    assert expanded_form_min_rows(512, 64, 128, 128) == 171  # DeepSeek-V3: only prefill chunks
    assert expanded_form_min_rows(16, 8, 8, 12) == 27  # the tiny test model
    assert expanded_form_min_rows(4, 2, 16, 16) > 1 << 20  # bigger heads than the latent: never
