"""Sliding windows, attention sinks and logit soft-capping in every CPU attention path, against a
dense per-row oracle written from the definitions (transformers' masking: a query at position p
sees keys at positions p - w + 1 .. p): decode rows, K+1 verification rows, prefill chunks and
token trees in one ragged call."""
from __future__ import annotations

import pytest
import torch

from specdec.layers import attention_rows
from specdec.layers.attention import AttentionMetadata, paged_attention_reference, paged_attention_torch
from specdec.spec_decode import tree as tree_lib

PARENTS = [-1, -1, 0, 0, 2, 1]  # a token tree: node i's parent (-1: the root row)


def make_case(q_lens, seq_lens, *, heads=4, kv_heads=2, head_dim=16, block_size=4, tree_req=None, seed=0):
    """Random cache and queries; request ``tree_req`` (if set) verifies the PARENTS tree after its
    root row (its q_len must be 1 + len(PARENTS)). -> (query, cache, meta, rows) where rows[t] =
    (request, last visible slot, position, None or (its tree's base, the tree keys it may see)))."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 5
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, cursor = [], 0
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(perm[cursor:cursor + n])
        cursor += n
    width = max(len(t) for t in tables)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    trees = None
    rows = []
    for r, (q, s) in enumerate(zip(q_lens, seq_lens)):
        for j in range(q):
            rows.append((r, s - q + j, s - q + j, None))
    if tree_req is not None:
        n = len(PARENTS)
        base = seq_lens[tree_req] - n
        mask = tree_lib.ancestor_mask(PARENTS, rows_before=1)  # [1 + n, n]
        trees = [None] * len(q_lens)
        trees[tree_req] = (base, mask)
        for j in range(1, 1 + n):
            t = qsl[tree_req] + j
            depth = int(mask[j].sum())
            rows[t] = (tree_req, base + j - 1, base - 1 + depth, (base, [base + c for c in range(n) if mask[j, c]]))
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    query = torch.randn(qsl[-1], heads, head_dim, generator=gen)
    meta = AttentionMetadata(torch.tensor(qsl), torch.tensor(seq_lens),
                             torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                             torch.zeros(qsl[-1], dtype=torch.int64), qsl, list(seq_lens), block_size, trees)
    return query, cache, meta, rows, tables


def oracle(query, cache, rows, tables, block_size, scale, window=None, sinks=None, softcap=None):
    heads, kv_heads = query.shape[1], cache.shape[3]
    out = torch.empty_like(query)
    for t, (r, last, pos, tree_keys) in enumerate(rows):
        base, tree_keys = tree_keys or (None, ())
        keys = [n for n in range(last + 1) if base is None or n < base or n in tree_keys]
        if window is not None:  # the window on positions; tree keys are ancestors inside it
            keys = [n for n in keys if (base is not None and n >= base) or n > pos - window]
        slots = [tables[r][n // block_size] * block_size + n % block_size for n in keys]
        flat = cache.view(2, -1, kv_heads, cache.shape[4])
        k = flat[0, slots].repeat_interleave(heads // kv_heads, 1).double()  # [L, H, D]
        v = flat[1, slots].repeat_interleave(heads // kv_heads, 1).double()
        s = torch.einsum("hd,lhd->hl", query[t].double(), k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if sinks is not None:
            s = torch.cat([s, sinks.double().view(-1, 1)], dim=1)
        p = torch.softmax(s, dim=-1)[:, :len(keys)]
        out[t] = torch.einsum("hl,lhd->hd", p, v).float()
    return out


def rows_kernel(query, cache, meta, scale, **options):
    if attention_rows.extension() is None:
        pytest.skip("the rows kernel did not build here")
    return attention_rows.paged_attention_rows(query, cache, meta, scale, **options)


PATHS = {"reference": paged_attention_reference, "torch": paged_attention_torch, "rows": rows_kernel}
OPTIONS = {
    "window": dict(sliding_window=8),
    "window_1": dict(sliding_window=1),
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 2.0, 3.0])),
    "softcap": dict(softcap=2.0),
    "all": dict(sliding_window=11, sinks=torch.tensor([1.0, 0.0, -2.0, 4.0]), softcap=3.0),
}
CASES = {
    "decode": ([1, 1, 1], [5, 30, 17]),
    "verify": ([6, 6], [6, 40]),
    "mixed": ([13, 1, 4, 1], [13, 29, 22, 3]),  # a prefill chunk, decode, K+1 rows, a short decode
    "chunks": ([20, 1, 6], [45, 9, 26]),  # a long chunk: one call per query length in the torch path
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("case", list(CASES))
def test_options_match_the_oracle(path, option, case):
    q_lens, seq_lens = CASES[case]
    query, cache, meta, rows, tables = make_case(q_lens, seq_lens)
    opts = OPTIONS[option]
    expected = oracle(query, cache, rows, tables, 4, 0.3, opts.get("sliding_window"), opts.get("sinks"),
                      opts.get("softcap"))
    out = PATHS[path](query, cache, meta, 0.3, **opts)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-5)
    if "sliding_window" in opts:  # the window really cuts: full attention differs
        plain = PATHS[path](query, cache, meta, 0.3)
        assert (plain - out).abs().max() > 1e-3


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("option", ["window", "all"])
def test_token_trees_position_their_nodes_by_depth(path, option):
    """Request 1 verifies a tree: a node's window starts from its depth's position, not its slot."""
    q_lens = [1, 1 + len(PARENTS), 3]
    seq_lens = [12, 30, 16]
    query, cache, meta, rows, tables = make_case(q_lens, seq_lens, tree_req=1)
    opts = OPTIONS[option]
    expected = oracle(query, cache, rows, tables, 4, 0.3, opts.get("sliding_window"), opts.get("sinks"),
                      opts.get("softcap"))
    torch.testing.assert_close(PATHS[path](query, cache, meta, 0.3, **opts), expected, rtol=1e-5, atol=2e-5)
    # deeper nodes at later slots see further back than a slot-based window would let them
    slot_based = [(r, last, last, keys) for r, last, _, keys in rows]
    assert not torch.allclose(expected, oracle(query, cache, slot_based, tables, 4, 0.3, opts.get("sliding_window"),
                                               opts.get("sinks"), opts.get("softcap")))


def test_a_tree_deeper_than_the_window_is_refused():
    query, cache, meta, _, _ = make_case([1 + len(PARENTS)], [20], tree_req=0)
    with pytest.raises(ValueError, match="sliding window"):
        paged_attention_torch(query, cache, meta, 0.3, sliding_window=2)


def test_every_layer_of_a_step_keeps_its_own_window():
    """The torch path caches the step's masks per window: a full layer after a sliding one (and
    the other way round) must not reuse the other's mask."""
    query, cache, meta, rows, tables = make_case([1, 5], [30, 25])
    sliding = paged_attention_torch(query, cache, meta, 0.3, sliding_window=6)
    full = paged_attention_torch(query, cache, meta, 0.3)
    again = paged_attention_torch(query, cache, meta, 0.3, sliding_window=6)
    torch.testing.assert_close(full, oracle(query, cache, rows, tables, 4, 0.3), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(sliding, again, rtol=0, atol=0)
    torch.testing.assert_close(sliding, oracle(query, cache, rows, tables, 4, 0.3, 6), rtol=1e-5, atol=2e-5)
