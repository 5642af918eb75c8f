"""ModelRunner.prepare: the flat int64 inputs of one ragged forward (ids, positions, KV slots,
logits rows, query starts, sequence lengths, the padded block table), built in one host buffer."""
import torch

from specdec.worker.model_runner import ModelRunner, int64_tensor


def bare_runner(block_size: int) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # prepare reads the block size, the device, the KV groups
    runner.block_size, runner.device, runner.kv_groups = block_size, torch.device("cpu"), ()
    return runner


def test_prepare_lays_out_every_request():
    runner = bare_runner(block_size=4)
    # request 0: a 3-token chunk from position 2 crossing into its second block; request 1: one
    # decode token at position 9 (third block); request 2: two tree nodes at depth positions 5, 5
    batch = runner.prepare([[11, 12, 13], [21], [31, 32]], [2, 9, 6], [[7, 3], [1, 2, 5], [4, 6]],
                           [[2], [0], [0, 1]], tree_positions=[None, None, [5, 5]])
    assert batch.input_ids.tolist() == [11, 12, 13, 21, 31, 32]
    assert batch.positions.tolist() == [2, 3, 4, 9, 5, 5]
    # slot = block_ids[p // 4] * 4 + p % 4, at each row's slot position (not its tree position)
    assert batch.attn.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 3 * 4 + 0, 5 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3]
    assert [runner.slot_of(b, p) for b, p in [([7, 3], 2), ([1, 2, 5], 9), ([4, 6], 7)]] == [30, 21, 27]
    assert batch.logits_indices.tolist() == [2, 3, 4, 5]
    assert batch.attn.query_start_loc.tolist() == [0, 3, 4, 6] == batch.attn.query_start_loc_cpu
    assert batch.attn.seq_lens.tolist() == [5, 10, 8] == batch.attn.seq_lens_cpu
    assert batch.attn.block_tables.tolist() == [[7, 3, 0], [1, 2, 5], [4, 6, 0]]
    assert batch.attn.block_tables.dtype == batch.input_ids.dtype == torch.int64


def test_int64_tensor_matches_torch_tensor():
    values = [0, -1, 2**40, 7]
    assert torch.equal(int64_tensor(values, torch.device("cpu")), torch.tensor(values, dtype=torch.int64))
    assert int64_tensor([], torch.device("cpu")).shape == (0,)
    kept = int64_tensor(list(range(1000)), torch.device("cpu"))  # the array behind it stays alive
    assert kept.sum().item() == sum(range(1000))
