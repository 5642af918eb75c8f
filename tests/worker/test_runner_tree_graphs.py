"""ModelRunner's tree graph (token-tree steps replayed at a padded maximum shape) gives the eager
path's logits and KV cache, and the torch path's logits. On CPU the graph runs eagerly on the
same padded static buffers with the Triton kernels in the interpreter; on a GPU
(SPECDEC_KERNEL_DEVICE=cuda, as scripts/gpu_check.sh runs it) it is captured and replayed."""
import os

DEVICE = os.environ.get("SPECDEC_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton; it is in the 'test' extra)")

import torch

from specdec.kernels.triton import load
from specdec.layers.attention import TORCH_BACKEND
from specdec.models.loader import load_config, load_model
from specdec.worker.model_runner import ModelRunner
from specdec.spec_decode.tree import ancestor_mask, depths

BLOCK_SIZE, NUM_BLOCKS = 4, 24
MAX_QUERY_LEN, MAX_TREE_KEYS, MAX_ROWS = 8, 7, 16  # the batch-4 graph holds 16 rows, not 4 x 8


@pytest.fixture(scope="module")
def runners(llama_path):
    device = torch.device(DEVICE)
    load("paged_attention")  # the mode check, before the backend imports the kernels
    from specdec.layers.attention_triton import TRITON_BACKEND as triton

    config = load_config(llama_path)
    model = load_model(llama_path, torch.float32, device, triton, config)
    eager = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, device, torch.float32)
    graphed = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, device, torch.float32)
    graphed.enable_tree_graphs([1, 4], MAX_QUERY_LEN, MAX_TREE_KEYS, max_blocks_per_seq=6,
                               use_graphs=DEVICE != "cpu", max_rows=MAX_ROWS)
    torch_model = load_model(llama_path, torch.float32, device, TORCH_BACKEND, config)
    reference = ModelRunner(torch_model, NUM_BLOCKS, BLOCK_SIZE, device, torch.float32)
    return eager, graphed, reference


def step(runners, feeds, starts, tables, trees, expect_graph: bool):
    """trees[i]: None (causal rows) or the parents of the nodes fed after one real row."""
    positions, masks = [], []
    for feed, start, parents in zip(feeds, starts, trees):
        if parents is None:
            positions.append(None)
            masks.append(None)
        else:
            assert len(feed) == 1 + len(parents)
            positions.append([start] + [start + d for d in depths(parents)])
            masks.append((start + 1, ancestor_mask(parents)))
    rows = [list(range(len(f))) for f in feeds]
    results = []
    for runner in runners:
        batch = runner.prepare(feeds, starts, tables, rows, positions, masks)
        if runner is runners[1]:
            assert (runner._graph_for(batch) is not None) == expect_graph
        results.append(runner.forward(batch).clone())
    eager, graphed, reference = results
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(graphed, reference, rtol=1e-4, atol=1e-4)


def test_tree_steps_replay_the_padded_graph(runners):
    gen = torch.Generator().manual_seed(0)
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    prompts = [torch.randint(3, 60, (n,), generator=gen).tolist() for n in (5, 7, 2)]
    step(runners, prompts, [0, 0, 0], tables, [None] * 3, expect_graph=False)  # prefill: no tree
    lens = [len(p) for p in prompts]
    # a 6-node tree, a chain of K = 2 and a decode row in one tree step (batch-4 graph, 3 requests)
    parents = [-1, -1, 0, 0, 2, 1]
    feeds = [[7] + torch.randint(3, 60, (6,), generator=gen).tolist(), [8, 9, 10], [11]]
    step(runners, feeds, lens, tables, [parents, None, None], expect_graph=True)
    # two trees of different shapes next: the rows are ragged inside the padded graph
    lens = [lens[0] + 7, lens[1] + 3, lens[2] + 1]
    step(runners, [[12, 13, 14], [15, 16, 17, 18, 19]], lens[:2], tables[:2], [[-1, 0], [-1, -1, 1, 1]],
         expect_graph=True)
    eager, graphed, _ = runners
    for a, b in zip(eager.kv_caches, graphed.kv_caches):  # padding rows wrote nothing
        torch.testing.assert_close(a, b)


def test_trees_past_the_captured_shape_run_eagerly(runners):
    # 8 tree keys > MAX_TREE_KEYS (and 9 rows > MAX_QUERY_LEN): the step goes eager
    step(runners, [[3] + list(range(4, 12))], [0], [[12, 13, 14]], [[-1] * 8], expect_graph=False)
    # three 7-row trees: 21 rows, more than the batch-4 graph's 16
    step(runners, [[3, 4, 5, 6, 7, 8, 9]] * 3, [0] * 3, [[15, 16], [17, 18], [19, 20]], [[-1, 0, 1, 2, 3, 4]] * 3,
         expect_graph=False)
    # five requests: more than the largest captured batch
    step(runners, [[3, 4]] * 5, [0] * 5, [[15 + i] for i in range(5)], [[-1]] * 5, expect_graph=False)


def test_tree_graphs_refuse_a_backend_that_reads_host_layouts(runners):
    reference = runners[2]
    with pytest.raises(ValueError, match="attention_backend 'triton'"):
        reference.enable_tree_graphs([1], 4, 3, max_blocks_per_seq=2, use_graphs=False)
