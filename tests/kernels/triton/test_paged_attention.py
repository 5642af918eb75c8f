"""paged_attention_triton and write_kv_cache_triton against the torch references, on random
ragged mixed batches (prefill chunks, K+1 verification rows, decode rows in one launch).

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported); scripts/gpu_check.sh runs this file compiled with SPECDEC_KERNEL_DEVICE=cuda."""
import os

DEVICE = os.environ.get("SPECDEC_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton; it is in the 'test' extra)")

import torch

from specdec.kernels.triton import load
from specdec.layers.attention import AttentionMetadata, paged_attention_reference, write_kv_cache

paged_attention = load("paged_attention")
from specdec.layers.attention_triton import attend_triton  # noqa: E402 (after the mode is checked)
kv_cache_kernels = load("kv_cache")

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def make_batch(q_lens, seq_lens, *, block_size, num_kv_heads, group, head_dim, dtype, seed):
    """Random cache, a scattered block table per request and random queries."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req)
    num_blocks = sum(blocks_per_req) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int64)
    used = 0
    for r, n in enumerate(blocks_per_req):
        block_tables[r, :n] = perm[used:used + n]
        used += n
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(qsl[-1], num_kv_heads * group, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64, device=DEVICE),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
        block_size=block_size,
    )
    return query.to(DEVICE), kv_cache.to(DEVICE), meta


def mixed_lengths(k: int, seed: int) -> tuple[list[int], list[int]]:
    """A prefill chunk with context, a fresh prompt, K+1 verify rows, decodes (one at position 0)."""
    gen = torch.Generator().manual_seed(seed)
    ctx = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    q_lens = [ctx(9, 24), ctx(2, 12), k + 1, 1, 1, k + 1]
    seq_lens = [q_lens[0] + ctx(1, 40), q_lens[1], q_lens[2] + ctx(0, 50), ctx(20, 90), 1, q_lens[5] + ctx(30, 70)]
    return q_lens, seq_lens


OPTIONS = ("sliding_window", "sinks", "softcap")  # the per-layer options (specdec.layers.attention)


def assert_matches_reference(query, kv_cache, meta, **kwargs):
    scale = query.shape[-1] ** -0.5
    options = {k: v for k, v in kwargs.items() if k in OPTIONS}
    ref_options = {k: v.cpu() if torch.is_tensor(v) else v for k, v in options.items()}
    expected = paged_attention_reference(query.float().cpu(), kv_cache.float().cpu(), _cpu(meta), scale,
                                         **ref_options)
    out = attend_triton(query, kv_cache, meta, scale, **kwargs)
    assert out.shape == query.shape and out.dtype == query.dtype
    rows = meta.query_start_loc_cpu[-1]
    tol = TOLERANCE[query.dtype]
    torch.testing.assert_close(out[:rows].float().cpu(), expected[:rows], atol=tol, rtol=tol)


def _cpu(meta):
    trees = None if meta.tree_masks is None else [t if t is None else (t[0], t[1].cpu()) for t in meta.tree_masks]
    return AttentionMetadata(meta.query_start_loc.cpu(), meta.seq_lens.cpu(), meta.block_tables.cpu(),
                             meta.slot_mapping.cpu(), meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.block_size,
                             trees)


def random_parents(num_nodes: int, gen: torch.Generator) -> list[int]:
    """A random tree in topological order: each node's parent is the root (-1) or an earlier node."""
    return [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(num_nodes)]


def tree_batch(kinds, *, group, seed, num_kv_heads=2, head_dim=32, dtype=torch.float32, block_size=8):
    """A ragged step mixing ("tree", rows_before, nodes), ("chain", k), ("prefill", n) and
    ("decode",) requests, each with a random context; the tree requests get random trees."""
    from specdec.spec_decode.tree import ancestor_mask

    gen = torch.Generator().manual_seed(seed)
    q_lens, seq_lens, masks = [], [], []
    for kind in kinds:
        context = int(torch.randint(0, 70, (1,), generator=gen))
        if kind[0] == "tree":
            rows_before, nodes = kind[1], kind[2]
            q_lens.append(rows_before + nodes)
            seq_lens.append(context + rows_before + nodes)
            masks.append((context + rows_before, ancestor_mask(random_parents(nodes, gen), rows_before)))
        else:
            q = {"chain": lambda: kind[1] + 1, "prefill": lambda: kind[1], "decode": lambda: 1}[kind[0]]()
            q_lens.append(q)
            seq_lens.append(context + q)
            masks.append(None)
    query, kv_cache, meta = make_batch(q_lens, seq_lens, block_size=block_size, num_kv_heads=num_kv_heads,
                                       group=group, head_dim=head_dim, dtype=dtype, seed=seed)
    meta.tree_masks = [m if m is None else (m[0], m[1].to(DEVICE)) for m in masks]
    return query, kv_cache, meta


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_steps_in_a_ragged_batch_match_the_reference(group, seed):
    """Trees (one of 24 nodes, one behind 3 real rows), a chain, a prefill chunk and a decode row
    in one launch: every row's ancestor rule is applied by the kernel itself."""
    kinds = [("tree", 1, 24), ("chain", 4), ("tree", 3, 7), ("prefill", 19), ("decode",), ("tree", 1, 5)]
    assert_matches_reference(*tree_batch(kinds, group=group, seed=seed), num_kv_splits=1)


@pytest.mark.parametrize("num_kv_splits", [2, 3])
def test_tree_steps_through_split_kv_match_the_reference(num_kv_splits):
    # a 40-node tree spans two mask words; its keys fall into several splits
    kinds = [("tree", 1, 40), ("decode",), ("tree", 1, 9)]
    batch = tree_batch(kinds, group=2, seed=7 + num_kv_splits, dtype=torch.bfloat16, block_size=16)
    assert_matches_reference(*batch, num_kv_splits=num_kv_splits)


def test_the_tree_mask_changes_the_kernel_output():
    """Negative control: the same rows read causally differ from the tree result, so the
    kernel cannot pass the tree tests by ignoring the mask."""
    query, kv_cache, meta = tree_batch([("tree", 1, 12)], group=2, seed=3)
    scale = query.shape[-1] ** -0.5
    tree_out = attend_triton(query, kv_cache, meta, scale, num_kv_splits=1)
    meta_causal = _cpu(meta)
    meta_causal.tree_masks = None
    causal = paged_attention_reference(query.cpu(), kv_cache.cpu(), meta_causal, scale)
    assert (tree_out.cpu() - causal).abs().max() > 1e-2


def _sinks(num_heads: int, seed: int) -> torch.Tensor:
    return (2 * torch.randn(num_heads, generator=torch.Generator().manual_seed(seed))).to(DEVICE)


@pytest.mark.parametrize("num_kv_splits", [1, 3])
@pytest.mark.parametrize("options", ["window", "window_sinks", "all"])
def test_options_in_mixed_batches_and_trees_match_the_reference(options, num_kv_splits):
    """Sliding window (shorter than most contexts, so it cuts), sinks and soft-capping, over
    prefill chunks, K+1 rows, decodes and token trees in one launch, with and without split keys."""
    kinds = [("tree", 1, 9), ("chain", 4), ("prefill", 19), ("decode",), ("tree", 3, 5), ("decode",)]
    query, kv_cache, meta = tree_batch(kinds, group=2, seed=11, num_kv_heads=2)
    opts = {"sliding_window": 13}
    if options != "window":
        opts["sinks"] = _sinks(query.shape[1], 4)
    if options == "all":
        opts["softcap"] = 1.5
    assert_matches_reference(query, kv_cache, meta, num_kv_splits=num_kv_splits, **opts)
    if options == "window":  # negative control: the window changes rows with longer contexts
        scale = query.shape[-1] ** -0.5
        full = attend_triton(query, kv_cache, meta, scale, num_kv_splits=num_kv_splits)
        cut = attend_triton(query, kv_cache, meta, scale, num_kv_splits=num_kv_splits, **opts)
        assert (full - cut).abs().max() > 1e-2


@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_sinks_alone_on_long_decodes(num_kv_splits):
    q_lens, seq_lens = [1, 4, 1], [150, 90, 2]
    query, kv_cache, meta = make_batch(q_lens, seq_lens, block_size=16, num_kv_heads=2, group=2, head_dim=64,
                                       dtype=torch.float32, seed=9)
    assert_matches_reference(query, kv_cache, meta, num_kv_splits=num_kv_splits, sinks=_sinks(4, 1))


@pytest.mark.parametrize(
    "block_size, num_kv_heads, group, head_dim, dtype, k",
    [
        (16, 2, 1, 64, torch.float32, 1),
        (16, 1, 4, 128, torch.bfloat16, 5),
        (32, 2, 2, 64, torch.bfloat16, 8),
        (32, 1, 4, 64, torch.float32, 3),
        (16, 2, 2, 128, torch.float16, 2),
    ],
)
def test_mixed_batch_matches_reference(block_size, num_kv_heads, group, head_dim, dtype, k):
    q_lens, seq_lens = mixed_lengths(k, seed=block_size + group + head_dim + k)
    batch = make_batch(q_lens, seq_lens, block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                       head_dim=head_dim, dtype=dtype, seed=k)
    assert_matches_reference(*batch, num_kv_splits=1)


@pytest.mark.parametrize("num_kv_splits", [2, 5])
def test_split_kv_matches_reference(num_kv_splits):
    # Decode and verify rows with long contexts: some splits see no key for some rows.
    q_lens, seq_lens = [1, 4, 1, 9], [300, 150, 2, 260]
    batch = make_batch(q_lens, seq_lens, block_size=16, num_kv_heads=2, group=4, head_dim=64,
                       dtype=torch.bfloat16, seed=num_kv_splits)
    assert_matches_reference(*batch, num_kv_splits=num_kv_splits)


def test_default_split_choice_runs_and_matches():
    q_lens, seq_lens = [1, 1], [700, 333]
    batch = make_batch(q_lens, seq_lens, block_size=16, num_kv_heads=1, group=2, head_dim=64,
                       dtype=torch.float32, seed=3)
    assert_matches_reference(*batch)  # num_kv_splits=None: chosen from host metadata


def test_block_size_not_a_power_of_two_and_odd_head_dim():
    q_lens, seq_lens = [3, 1], [29, 12]
    batch = make_batch(q_lens, seq_lens, block_size=12, num_kv_heads=2, group=3, head_dim=80,
                       dtype=torch.float32, seed=5)
    assert_matches_reference(*batch, num_kv_splits=1)


def test_empty_requests_and_padding_rows_are_tolerated():
    # q_len 0 for request 1, and 3 query rows past query_start_loc[-1] (a padded graph batch).
    q_lens, seq_lens = [2, 0, 1], [10, 5, 7]
    query, kv_cache, meta = make_batch(q_lens, seq_lens, block_size=16, num_kv_heads=2, group=2, head_dim=64,
                                       dtype=torch.float32, seed=7)
    padded = torch.cat([query, torch.zeros(3, *query.shape[1:], device=DEVICE)])
    for splits in (1, 2):
        out = attend_triton(padded, kv_cache, meta, 0.125, num_kv_splits=splits)
        expected = paged_attention_reference(query.cpu(), kv_cache.cpu(), _cpu(meta), 0.125)
        torch.testing.assert_close(out[:3].cpu(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_reference_bitwise(dtype):
    gen = torch.Generator().manual_seed(11)
    num_tokens, num_kv_heads, head_dim, num_blocks, block_size = 13, 4, 64, 6, 16
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    expected = kv_cache.clone()
    write_kv_cache(key, value, expected, slots)
    actual = kv_cache.to(DEVICE)
    kv_cache_kernels.write_kv_cache_triton(key.to(DEVICE), value.to(DEVICE), actual, slots.to(DEVICE))
    assert torch.equal(actual.cpu(), expected)


def test_write_kv_cache_skips_negative_slots_and_reads_strided_inputs():
    gen = torch.Generator().manual_seed(12)
    kv_cache = torch.zeros(2, 2, 16, 2, 64)
    qkv = torch.randn(4, 3, 2, 64, generator=gen)  # a fused projection: key/value are strided views
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([5, -1, 17, -1])
    actual = kv_cache.to(DEVICE)
    kv_cache_kernels.write_kv_cache_triton(key.to(DEVICE), value.to(DEVICE), actual, slots.to(DEVICE))
    expected = kv_cache.clone()
    write_kv_cache(key[[0, 2]], value[[0, 2]], expected, slots[[0, 2]])
    assert torch.equal(actual.cpu(), expected)


def test_write_kv_cache_rejects_dtype_mismatch():
    with pytest.raises(ValueError, match="cache dtype"):
        kv_cache_kernels.write_kv_cache_triton(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16),
                                               torch.zeros(2, 1, 16, 1, 16, dtype=torch.bfloat16),
                                               torch.zeros(1, dtype=torch.int64))
