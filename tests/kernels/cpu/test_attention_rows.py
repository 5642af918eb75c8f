"""The row-consistent CPU attention (specdec.layers.attention_rows) against the per-request SDPA
reference, and bit for bit against itself: a row's output does not depend on the rest of the call."""
import pytest
import torch

from specdec.layers import attention_rows
from specdec.layers.attention import AttentionMetadata, paged_attention_reference

needs_kernel = pytest.mark.skipif("attention_rows.extension() is None", reason="no AVX-512 or AVX2 kernel here")
pytestmark = pytest.mark.usefixtures("kernel_isa")


def make_cache(num_kv_heads, head_dim, block_size=16, num_blocks=80, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)


def meta_for(q_lens, seq_lens, tables, block_size=16, trees=None):
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return AttentionMetadata(torch.tensor(qsl), torch.tensor(seq_lens), table, torch.zeros(qsl[-1], dtype=torch.int64),
                             qsl, list(seq_lens), block_size, trees)


TABLES = [list(range(3, 15)), list(range(40, 52)), [70, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], list(range(55, 67))]


@needs_kernel
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(3, 3, 64), (2, 2, 32), (1, 4, 80), (4, 1, 16)])
def test_matches_the_reference(num_kv_heads, group, head_dim):
    cache = make_cache(num_kv_heads, head_dim)
    q_lens, seq_lens = [1, 5, 20, 1], [50, 100, 120, 1]
    meta = meta_for(q_lens, seq_lens, TABLES)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(1))
    out = attention_rows.paged_attention_rows(query, cache, meta, head_dim ** -0.5)
    torch.testing.assert_close(out, paged_attention_reference(query, cache, meta, head_dim ** -0.5),
                               rtol=1e-5, atol=2e-6)


@needs_kernel
def test_token_trees_match_the_reference():
    cache = make_cache(3, 64)
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    mask[3, 1:3] = False  # node 3 hangs off node 0
    meta = meta_for([1, 5, 20], [50, 100, 120], TABLES[:3], trees=[None, (95, mask), None])
    query = torch.randn(26, 9, 64, generator=torch.Generator().manual_seed(2))
    out = attention_rows.paged_attention_rows(query, cache, meta, 0.125)
    torch.testing.assert_close(out, paged_attention_reference(query, cache, meta, 0.125), rtol=1e-5, atol=2e-6)
    causal = meta_for([1, 5, 20], [50, 100, 120], TABLES[:3])
    assert not torch.equal(out[1:6], attention_rows.paged_attention_rows(query, cache, causal, 0.125)[1:6])


@needs_kernel
def test_a_row_is_the_same_whatever_else_the_call_holds():
    cache = make_cache(3, 64)
    query = torch.randn(26, 9, 64, generator=torch.Generator().manual_seed(3))
    full = attention_rows.paged_attention_rows(query, cache, meta_for([1, 5, 20], [50, 100, 120], TABLES[:3]), 0.125)
    # request 1 alone, and its rows one at a time as decode steps over the same keys
    alone = attention_rows.paged_attention_rows(query[1:6].clone(), cache, meta_for([5], [100], TABLES[1:2]), 0.125)
    assert torch.equal(alone, full[1:6])
    for j in range(5):
        row = attention_rows.paged_attention_rows(query[1 + j:2 + j].clone(), cache,
                                                  meta_for([1], [96 + j], TABLES[1:2]), 0.125)
        assert torch.equal(row[0], full[1 + j])
    # next to a request with a longer context and query
    other = torch.cat([query[1:6], torch.randn(17, 9, 64)])
    beside = attention_rows.paged_attention_rows(other, cache, meta_for([5, 17], [100, 180], [TABLES[1], TABLES[3]]),
                                                 0.125)
    assert torch.equal(beside[:5], full[1:6])


def test_auto_picks_the_rows_backend_for_float32_on_cpu_and_torch_for_bf16():
    from specdec.config import EngineConfig
    from specdec.worker.plan import Machine, attention_backend_name

    if attention_rows.extension() is None:
        pytest.skip("the rows kernel did not build here")
    cpu = Machine(torch.device("cpu"))  # the rows kernel's availability probed here
    cfg = EngineConfig(model="unused")
    assert attention_backend_name(cfg, cpu, torch.float32) == "rows"
    assert attention_backend_name(cfg, cpu, torch.bfloat16) == "torch"
    assert attention_backend_name(EngineConfig(model="unused", quantization="w4a8"), cpu, torch.bfloat16) == "rows"
    assert attention_backend_name(EngineConfig(model="unused", attention_backend="torch"), cpu, torch.float32) == "torch"


@needs_kernel
@pytest.mark.parametrize("num_kv_heads,group,head_dim,options", [
    (2, 7, 64, {}), (3, 3, 64, {}), (1, 4, 80, {}),
    (2, 2, 64, {"sliding_window": 30, "sinks": torch.linspace(-1.0, 2.0, 4), "softcap": 4.0}),  # gpt-oss-like
])
def test_fused_qkv_attention_equals_rotary_then_cache_write_then_attention(num_kv_heads, group, head_dim, options):
    from specdec.layers.attention import write_kv_cache
    from specdec.layers.rotary import RotaryEmbedding, rotate

    num_heads = num_kv_heads * group
    q_lens, seq_lens = [1, 5, 20], [50, 100, 120]
    meta = meta_for(q_lens, seq_lens, TABLES[:3])
    slots = []
    for r, (q, s) in enumerate(zip(q_lens, seq_lens)):
        slots += [TABLES[r][p // 16] * 16 + p % 16 for p in range(s - q, s)]
    meta.slot_mapping = torch.tensor(slots)
    positions = torch.tensor([p for q, s in zip(q_lens, seq_lens) for p in range(s - q, s)])
    cos, sin = RotaryEmbedding(head_dim, 256, 10000.0).lookup(positions)
    qkv = torch.randn(len(slots), (num_heads + 2 * num_kv_heads) * head_dim, generator=torch.Generator().manual_seed(2))
    cache_a, cache_b = make_cache(num_kv_heads, head_dim), make_cache(num_kv_heads, head_dim)
    fused = attention_rows.qkv_attention_rows(qkv, cos, sin, cache_a, meta, 0.125, num_heads, **options)
    qk, v = qkv.split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], dim=-1)
    qk = rotate(qk.view(-1, num_heads + num_kv_heads, head_dim), cos, sin)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    write_kv_cache(k, v.view(-1, num_kv_heads, head_dim), cache_b, meta.slot_mapping)
    separate = attention_rows.paged_attention_rows(q.contiguous(), cache_b, meta, 0.125, **options)
    torch.testing.assert_close(cache_a, cache_b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=2e-6)
    if options:  # and the options reach the kernel: the reference agrees, plain attention does not
        torch.testing.assert_close(fused, paged_attention_reference(q.contiguous(), cache_b, meta, 0.125, **options),
                                   rtol=1e-5, atol=2e-5)
        assert (fused - attention_rows.paged_attention_rows(q.contiguous(), cache_b, meta, 0.125)).abs().max() > 1e-3
    # a slot outside the cache is an error, not a write
    meta.slot_mapping = torch.tensor([10 ** 6] + slots[1:])
    with pytest.raises(RuntimeError, match="outside the cache"):
        attention_rows.qkv_attention_rows(qkv, cos, sin, cache_a, meta, 0.125, num_heads)
