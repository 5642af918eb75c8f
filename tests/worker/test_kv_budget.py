"""The start-up KV check: one max_model_len sequence must fit, a sliding window counting only the
blocks it keeps; the budget split between KV cache groups."""
import pytest
import torch

from specdec.config import EngineConfig
from specdec.engine.kv_layout import KVGroup
from specdec.worker.kv_budget import blocks_per_sequence, kv_layout, num_kv_blocks

CPU = torch.device("cpu")


def config(**kw) -> EngineConfig:
    return EngineConfig(model="unused", max_model_len=4096, max_num_batched_tokens=256, block_size=16, **kw)


def test_an_all_sliding_model_needs_its_window_per_sequence():
    full = blocks_per_sequence(config(), 4096, 3)
    window = blocks_per_sequence(config(), 4096, 3, window=512)
    assert full == -(-(4096 + 4) // 16) and window == -(-(511 + 256 + 4) // 16) + 1 < full
    # a budget of one windowed sequence is accepted where one full-length sequence would not fit
    assert num_kv_blocks(config(kv_cache_memory=window * 1000), CPU, 1000, 4096, 3, window=512) == window
    with pytest.raises(ValueError, match=f"holds {full - 1} blocks .* needs {full}: raise kv_cache_memory"):
        num_kv_blocks(config(kv_cache_memory=(full - 1) * 1000), CPU, 1000, 4096, 3)
    with pytest.raises(ValueError, match=f"needs {window}"):
        num_kv_blocks(config(kv_cache_memory=(window - 1) * 1000), CPU, 1000, 4096, 3, window=512)


def test_hybrid_groups_each_count_their_own_need():
    groups = (KVGroup(None, (1,)), KVGroup(512, (0,)))
    full, window = blocks_per_sequence(config(), 4096, 0), blocks_per_sequence(config(), 4096, 0, 512)
    exact = full * 300 + window * 100
    layout = kv_layout(config(kv_cache_memory=exact), CPU, groups, [300, 100], 4096, 0)
    assert [g.num_blocks for g in layout.groups] == [full, window] and layout.num_bytes == exact
    with pytest.raises(ValueError, match=rf"cannot hold one sequence: it needs {exact} bytes .*: raise kv_cache_memory"):
        kv_layout(config(kv_cache_memory=exact - 1), CPU, groups, [300, 100], 4096, 0)
    # the CPU default: max_num_seqs sequences of each group's need
    layout = kv_layout(config(max_num_seqs=8), CPU, groups, [300, 100], 4096, 0)
    assert [g.num_blocks for g in layout.groups] == [8 * full, 8 * window]
