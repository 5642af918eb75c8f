"""The batched SDPA path and the KV write agree with the per-request reference."""
import pytest
import torch

from specdec.layers.attention import (
    AttentionMetadata, paged_attention_reference, paged_attention_torch, write_kv_cache,
)


def _meta(q_lens, seq_lens, tables, block_size, slot_mapping=None):
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    slots = slot_mapping if slot_mapping is not None else torch.zeros(qsl[-1], dtype=torch.long)
    return AttentionMetadata(torch.tensor(qsl), torch.tensor(seq_lens), torch.tensor(padded), slots,
                             qsl, list(seq_lens), block_size)


def _naive(query, keys, values, q_lens, seq_lens, scale):
    """Dense causal attention per request from contiguous K/V (no paging at all)."""
    outs, start = [], 0
    for r, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        q = query[start:start + q_len]
        k, v = keys[r][:seq_len], values[r][:seq_len]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        pos_q = torch.arange(seq_len - q_len, seq_len).view(-1, 1)
        scores = scores.masked_fill(torch.arange(seq_len).view(1, -1) > pos_q, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += q_len
    return torch.cat(outs)


@pytest.mark.parametrize("q_lens,heads,kv_heads,block_size", [
    ([1, 1, 1], 4, 2, 4),        # decode rows, GQA
    ([6, 6], 8, 2, 16),          # K+1 verification rows
    ([7, 1, 4], 4, 4, 8),        # mixed: prefill chunk, decode, verify (one padded call)
    ([1, 3, 6, 1], 4, 2, 4),     # decode rows beside verification rows of different K (padded)
    ([20, 1, 6], 4, 2, 8),       # a long prefill chunk among them: one call per query length
    ([1], 4, 1, 4),              # one request, MQA
])
def test_paged_attention_matches_dense(q_lens, heads, kv_heads, block_size):
    torch.manual_seed(0)
    head_dim, num_blocks = 16, 64
    seq_lens = [q + extra for q, extra in zip(q_lens, [9, 0, 21, 3][: len(q_lens)])]
    kv_cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim)
    perm = torch.randperm(num_blocks).tolist()
    tables, keys, values, cursor = [], [], [], 0
    for seq_len in seq_lens:
        n = -(-seq_len // block_size)
        table = perm[cursor:cursor + n]
        cursor += n
        tables.append(table)
        k, v = torch.randn(seq_len, kv_heads, head_dim), torch.randn(seq_len, kv_heads, head_dim)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        write_kv_cache(k, v, kv_cache, slots)
        keys.append(k)
        values.append(v)
    query = torch.randn(sum(q_lens), heads, head_dim)
    meta = _meta(q_lens, seq_lens, tables, block_size)
    expected = _naive(query, keys, values, q_lens, seq_lens, 0.25)
    ref = paged_attention_reference(query, kv_cache, meta, 0.25)
    fast = paged_attention_torch(query, kv_cache, meta, 0.25)
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, expected, rtol=1e-5, atol=1e-5)
    # the next layer of the same step reuses the step's buffers: neither result may change
    other_cache, other_query = torch.randn_like(kv_cache), torch.randn_like(query)
    second = paged_attention_torch(other_query, other_cache, meta, 0.25)
    torch.testing.assert_close(second, paged_attention_reference(other_query, other_cache, meta, 0.25),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, expected, rtol=1e-5, atol=1e-5)


def test_write_kv_cache_places_tokens_at_their_slots():
    kv_cache = torch.zeros(2, 4, 2, 1, 3)
    key = torch.arange(9.0).view(3, 1, 3)
    slots = torch.tensor([5, 0, 3])  # block 2 offset 1, block 0 offset 0, block 1 offset 1
    write_kv_cache(key, -key, kv_cache, slots)
    assert torch.equal(kv_cache[0, 2, 1, 0], key[0, 0])
    assert torch.equal(kv_cache[0, 0, 0, 0], key[1, 0])
    assert torch.equal(kv_cache[1, 1, 1, 0], -key[2, 0])
    assert kv_cache[0, 3].abs().sum() == 0  # untouched block


def test_each_backend_builds_its_plan_once_per_step_and_keeps_it_apart():
    """``AttentionMetadata.plan_for``: the torch backend's plan (one per sliding window) is built by
    the step's first layer and reused by the next; a new step's metadata starts without plans."""
    torch.manual_seed(0)
    tables = [[0, 1], [2, 3]]
    meta = _meta([1, 1], [20, 9], tables, 16)
    query = torch.randn(2, 4, 8)
    cache = torch.randn(2, 4, 16, 2, 8)
    assert meta.backend_plans == {}
    first = paged_attention_torch(query, cache, meta, 0.3)
    plans = meta.backend_plans["torch"]
    full = plans.by_window[None]
    again = paged_attention_torch(query, cache, meta, 0.3)
    assert meta.backend_plans["torch"] is plans and plans.by_window[None] is full and torch.equal(first, again)
    paged_attention_torch(query, cache, meta, 0.3, sliding_window=4)  # a sliding layer: its own plan
    assert set(plans.by_window) == {None, 4}
    built = []
    assert meta.plan_for("other", lambda m: built.append(m) or "plan") == "plan"
    assert meta.plan_for("other", lambda m: built.append(m) or "not rebuilt") == "plan" and built == [meta]
    assert meta.backend_plans["torch"] is plans  # another backend's plan sits apart
    assert _meta([1, 1], [20, 9], tables, 16).backend_plans == {}
