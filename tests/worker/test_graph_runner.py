"""GraphRunner: bucket choice, padding of short inputs, slicing of outputs, eager fallback.
On CPU the same buffers run eagerly; the capture test needs a CUDA or ROCm GPU."""
import pytest
import torch

from specdec.worker.graph_runner import GraphRunner

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
WEIGHT = torch.arange(12.0, device=DEVICE).view(4, 3) / 10


def step(input_ids: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> dict:
    one_hot = ((input_ids % 4)[:, None] == torch.arange(4, device=input_ids.device)).float()  # F.one_hot syncs
    hidden = one_hot @ WEIGHT  # [B, 3]
    return {"logits": hidden + positions[:, None].float() + table.sum(1, keepdim=True), "hidden": hidden}


def static_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.zeros(batch_size, dtype=torch.int64, device=DEVICE),
        "positions": torch.zeros(batch_size, dtype=torch.int64, device=DEVICE),
        "table": torch.zeros(batch_size, 6, dtype=torch.float32, device=DEVICE),
    }


def make_runner(**kwargs) -> GraphRunner:
    runner = GraphRunner(step, static_inputs, [4, 1, 2, 8], DEVICE, pad_values={"positions": 7}, **kwargs)
    runner.capture()
    return runner


def test_padded_size_picks_the_smallest_captured_size_that_fits():
    runner = GraphRunner(step, static_inputs, [8, 1, 2, 4, 4], torch.device("cpu"))
    assert runner.batch_sizes == [1, 2, 4, 8]
    assert [runner.padded_size(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_run_equals_unpadded_call(batch_size):
    runner = make_runner()
    gen = torch.Generator().manual_seed(batch_size)
    inputs = {
        "input_ids": torch.randint(0, 100, (batch_size,), generator=gen).to(DEVICE),
        "positions": torch.randint(0, 50, (batch_size,), generator=gen).to(DEVICE),
        "table": torch.randn(batch_size, 4, generator=gen).to(DEVICE),  # narrower than the static 6 columns
    }
    out = runner.run(batch_size, **inputs)
    wide_table = torch.nn.functional.pad(inputs["table"], (0, 2))
    expected = step(inputs["input_ids"], inputs["positions"], wide_table)
    assert out["logits"].shape == (batch_size, 3)
    torch.testing.assert_close(out["logits"], expected["logits"])
    torch.testing.assert_close(out["hidden"], expected["hidden"])


def test_padding_rows_get_pad_values_and_stale_values_are_cleared():
    runner = make_runner()
    runner.run(4, input_ids=torch.ones(4, dtype=torch.int64, device=DEVICE),
               positions=torch.full((4,), 3, device=DEVICE), table=torch.ones(4, 6, device=DEVICE))
    runner.run(3, input_ids=torch.ones(3, dtype=torch.int64, device=DEVICE),
               positions=torch.full((3,), 3, device=DEVICE), table=torch.ones(3, 6, device=DEVICE))
    static = runner._captured[4].inputs
    assert static["positions"].tolist() == [3, 3, 3, 7]
    assert static["table"][3].abs().sum() == 0


def test_larger_than_any_graph_runs_eagerly():
    runner = make_runner()
    inputs = {"input_ids": torch.arange(10, device=DEVICE), "positions": torch.arange(10, device=DEVICE),
              "table": torch.zeros(10, 6, device=DEVICE)}
    out = runner.run(10, **inputs)
    torch.testing.assert_close(out["logits"], step(**inputs)["logits"])


def test_input_errors_name_the_input():
    runner = make_runner()
    with pytest.raises(ValueError, match="missing inputs \\['table'\\]"):
        runner.run(2, input_ids=torch.zeros(2, dtype=torch.int64), positions=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="'table'"):
        runner.run(2, input_ids=torch.zeros(2, dtype=torch.int64), positions=torch.zeros(2, dtype=torch.int64),
                   table=torch.zeros(2, 9))
    with pytest.raises(ValueError, match="batch sizes >= 1"):
        GraphRunner(step, static_inputs, [], torch.device("cpu"))


def test_graphs_need_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="needs a CUDA or ROCm GPU"):
        GraphRunner(step, static_inputs, [1], torch.device("cpu"), use_graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA/HIP graph capture needs a GPU")
def test_replay_reads_new_inputs_on_gpu():
    runner = make_runner()
    assert runner._captured[8].graph is not None
    for value in (1, 2):
        ids = torch.full((5,), value, dtype=torch.int64, device=DEVICE)
        out = runner.run(5, input_ids=ids, positions=torch.zeros(5, dtype=torch.int64, device=DEVICE),
                         table=torch.zeros(5, 6, device=DEVICE))
        torch.testing.assert_close(out["hidden"], WEIGHT[value].expand(5, 3))
