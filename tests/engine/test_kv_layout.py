"""KV cache groups: layers grouped by window, each group's need per sequence, the budget split."""
import pytest

from specdec.engine.kv_layout import (KVGroup, KVLayout, group_blocks_per_sequence, kv_groups, split_kv_budget,
                                     with_draft_layers)

GEMMA3 = [512] * 5 + [None] + [512] * 5 + [None]  # five sliding layers to one global
GPT_OSS = [128, None] * 3


def test_layers_are_grouped_by_window_the_widest_first():
    assert kv_groups(GEMMA3) == (KVGroup(None, (5, 11)), KVGroup(512, (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)))
    assert kv_groups(GPT_OSS) == (KVGroup(None, (1, 3, 5)), KVGroup(128, (0, 2, 4)))
    assert kv_groups([64, 32, 64]) == (KVGroup(64, (0, 2)), KVGroup(32, (1,)))
    assert kv_groups([None, None]) == (KVGroup(None, (0, 1)),)
    assert kv_groups([16, 16]) == (KVGroup(16, (0, 1)),)  # all sliding: one group that frees


def test_a_draft_cache_widens_the_primary_group():
    assert kv_groups([16, 16], draft_window=None) == (KVGroup(None, (0, 1)),)  # a global draft: nothing freed
    assert kv_groups([16, 16], draft_window=32) == (KVGroup(32, (0, 1)),)
    assert kv_groups([64, 32], draft_window=None) == (KVGroup(None, (0,)), KVGroup(32, (1,)))
    assert kv_groups(GPT_OSS, draft_window=None) == kv_groups(GPT_OSS)


def test_a_draft_models_layers_join_the_group_of_their_window():
    # a Gemma 3 draft (two sliding layers around a global one) of a Gemma 3 target
    groups = with_draft_layers(kv_groups(GEMMA3, draft_window=None), [512, None, 512])
    assert groups == (KVGroup(None, (5, 11), draft_layers=(1,)), KVGroup(512, kv_groups(GEMMA3)[1].layers,
                                                                          draft_layers=(0, 2)))
    # a window no target group has: the primary group, which is at least as wide
    assert with_draft_layers(kv_groups(GPT_OSS, draft_window=None), [64, None]) == (
        KVGroup(None, (1, 3, 5), draft_layers=(0, 1)), KVGroup(128, (0, 2, 4)))
    assert with_draft_layers(kv_groups([16, 16], draft_window=16), [16]) == (KVGroup(16, (0, 1), draft_layers=(0,)),)
    # a group holding draft layers budgets a whole sequence: the draft catches up only when it drafts
    assert [g.blocks_per_sequence_window for g in groups] == [None, None]
    assert [g.blocks_per_sequence_window for g in kv_groups(GEMMA3)] == [None, 512]
    # what the draft's runner reads: the draft layers as each group's layers
    view = KVLayout(16, groups).draft_view()
    assert [(g.window, g.layers, g.draft_layers) for g in view.groups] == [(None, (1,), ()), (512, (0, 2), ())]
    assert view.layer_groups(3) == [1, 0, 1]


def test_group_names_are_metric_labels():
    assert [g.name for g in kv_groups(GEMMA3)] == ["full_attention", "sliding_window_512"]


def test_a_sliding_group_needs_its_window_and_a_step_per_sequence():
    full = group_blocks_per_sequence(None, 8192, 3, 2048, 16)
    assert full == -(-(8192 + 3 + 1) // 16)
    # 511 keys before the step, 2048 rows and the next drafts' 4 slots, one straddled block
    assert group_blocks_per_sequence(512, 8192, 3, 2048, 16) == -(-(511 + 2048 + 4) // 16) + 1 < full
    assert group_blocks_per_sequence(4096, 4096, 0, 2048, 16) == 257  # never more than the whole sequence


def test_the_budget_split():
    groups = (KVGroup(None, (5,)), KVGroup(512, (0, 1, 2, 3, 4)))
    bpb, per_seq = [100, 500], [513, 162]
    # roomy: the sliding group is capped at what max_num_seqs sequences hold, the rest is full attention's
    sized = split_kv_budget(10_000_000, groups, bpb, per_seq, max_num_seqs=4, block_size=16)
    assert sized[1].num_blocks == 4 * 162 and sized[0].num_blocks == (10_000_000 - 4 * 162 * 500) // 100
    assert [g.bytes_per_block for g in sized] == bpb
    # smaller: the share one table for all layers would give (5/6 of the bytes)
    sized = split_kv_budget(600_000, groups, bpb, per_seq, max_num_seqs=256, block_size=16)
    assert sized[1].num_blocks == 600_000 * 500 // 600 // 500 and sized[0].num_blocks == 1000
    # exactly one sequence: each group gets its own need
    exact = 513 * 100 + 162 * 500
    assert [g.num_blocks for g in split_kv_budget(exact, groups, bpb, per_seq, 256, 16)] == per_seq
    with pytest.raises(ValueError, match=rf"{exact - 1} bytes cannot hold one sequence: it needs {exact} bytes "
                                         r"\(513 blocks of 16 tokens for the full-attention layers, 162 blocks "
                                         r"of 16 tokens for the window-512 layers\)"):
        split_kv_budget(exact - 1, groups, bpb, per_seq, 256, 16)
