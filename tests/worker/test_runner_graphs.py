"""ModelRunner's graph path (decode / verify steps replayed from per-batch-size graphs) gives the
eager path's logits and KV cache. On CPU the graphs run eagerly on the same padded static buffers
with the Triton kernels in the interpreter; on a GPU (SPECDEC_KERNEL_DEVICE=cuda, as
scripts/gpu_check.sh runs it) they are captured and replayed."""
import os

DEVICE = os.environ.get("SPECDEC_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton; it is in the 'test' extra)")

import torch

from specdec.kernels.triton import load
from specdec.models.loader import load_config, load_model
from specdec.worker.model_runner import ModelRunner

BLOCK_SIZE, NUM_BLOCKS = 4, 24


@pytest.fixture(scope="module")
def runners(llama_path):
    device = torch.device(DEVICE)
    load("paged_attention")  # the mode check, before the backend imports the kernels
    from specdec.layers.attention_triton import TRITON_BACKEND as backend

    model = load_model(llama_path, torch.float32, device, backend, load_config(llama_path))
    eager = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, device, torch.float32)
    graphed = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, device, torch.float32)
    graphed.enable_graphs([1, 2, 4], [1, 3], max_blocks_per_seq=6, use_graphs=DEVICE != "cpu")
    return eager, graphed


def step(runners, feeds, starts, tables, expect_graph: bool):
    eager, graphed = runners
    rows = [list(range(len(f))) for f in feeds]
    batch = graphed.prepare(feeds, starts, tables, rows)
    assert (graphed._graph_for(batch) is not None) == expect_graph
    expected, expected_hidden = eager.forward_with_hidden(eager.prepare(feeds, starts, tables, rows))
    got, hidden = graphed.forward_with_hidden(batch)  # the hidden states an EAGLE head reads, from the graph too
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden, expected_hidden, rtol=1e-4, atol=1e-4)
    return expected


def test_graph_steps_match_eager_logits_and_cache(runners):
    gen = torch.Generator().manual_seed(0)
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # 3 requests, room for 12 tokens each
    prompts = [torch.randint(3, 60, (n,), generator=gen).tolist() for n in (5, 7, 2)]
    # prefill: ragged query lengths, so both runners go eager
    step(runners, prompts, [0, 0, 0], tables, expect_graph=False)
    lens = [len(p) for p in prompts]
    # verification: 3 rows per request (K = 2), 3 requests padded to the batch-4 graph
    verify = [torch.randint(3, 60, (3,), generator=gen).tolist() for _ in range(3)]
    step(runners, verify, lens, tables, expect_graph=True)
    lens = [n + 3 for n in lens]
    # decode: one row each, two requests (batch-2 graph), a narrower block table than captured
    step(runners, [[11], [12]], lens[:2], [t[:3] for t in tables[:2]], expect_graph=True)
    eager, graphed = runners
    for a, b in zip(eager.kv_caches, graphed.kv_caches):  # pad rows wrote nothing
        torch.testing.assert_close(a, b)


def test_steps_without_a_graph_run_eagerly(runners):
    five = [[i + 3] for i in range(5)]  # more requests than the largest captured batch (4)
    step(runners, five, [0] * 5, [[9 + i] for i in range(5)], expect_graph=False)
    step(runners, [[3, 4]], [0], [[20]], expect_graph=False)  # q = 2: no graph captured for it


@pytest.fixture(scope="module")
def head_runners(llama_path, eagle_head_path):
    from specdec.models.eagle import load_head

    device = torch.device(DEVICE)
    load("paged_attention")  # the mode check, before the backend imports the kernels
    from specdec.layers.attention_triton import TRITON_BACKEND as backend

    target = load_model(llama_path, torch.float32, device, backend, load_config(llama_path))
    head = load_head(eagle_head_path, target, torch.float32, device, backend)
    eager = ModelRunner(head, NUM_BLOCKS, BLOCK_SIZE, device, torch.float32)
    graphed = ModelRunner(head, NUM_BLOCKS, BLOCK_SIZE, device, torch.float32)
    graphed.enable_graphs([1, 2, 4], [1], max_blocks_per_seq=6, use_graphs=DEVICE != "cpu",
                          feature_size=target.config.hidden_size)
    return eager, graphed, target.config.hidden_size


def test_eagle_head_passes_replay_with_their_features(head_runners):
    """An EAGLE head's passes after the first (one row per drafting request, fed the features the
    last pass predicted) run from the feature-fed graphs, padded, and give the eager path's
    logits, predicted features and KV cache; a pass without features runs eagerly."""
    eager, graphed, hidden_size = head_runners
    gen = torch.Generator().manual_seed(0)
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    feeds = [torch.randint(3, 60, (n,), generator=gen).tolist() for n in (5, 7, 2)]
    starts = [0, 0, 0]
    for expect_graph in (False, True, True):  # a ragged catch-up pass, then two drafting passes
        rows = [[len(f) - 1] for f in feeds]
        features = torch.randn(sum(len(f) for f in feeds), hidden_size, generator=gen).to(DEVICE)
        batches = [runner.prepare(feeds, starts, tables, rows) for runner in (eager, graphed)]
        for batch in batches:
            batch.features = features
        assert (graphed._graph_for(batches[1]) is not None) == expect_graph
        expected, expected_hidden = eager.forward_with_hidden(batches[0])
        got, hidden = graphed.forward_with_hidden(batches[1])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(hidden, expected_hidden, rtol=1e-4, atol=1e-4)
        starts = [s + len(f) for s, f in zip(starts, feeds)]
        feeds = [[int(t)] for t in expected.argmax(dim=-1).tolist()]
    for a, b in zip(eager.kv_caches, graphed.kv_caches):  # pad rows wrote nothing
        torch.testing.assert_close(a, b)
    no_features = graphed.prepare(feeds, starts, tables, [[0]] * 3)
    assert graphed._graph_for(no_features) is None


WINDOW = 8  # the hybrid model's sliding window


@pytest.fixture(scope="module")
def hybrid_runners(make_model):
    """Tiny Gemma 3 (layers 0 and 1 sliding, 2 global) with two KV cache groups, each its own pool."""
    from dataclasses import replace

    from specdec.engine.kv_layout import KVLayout, kv_groups

    path = make_model("graphs_gemma3", arch="gemma3", num_layers=3, head_dim=16, sliding_window=WINDOW,
                      sliding_window_pattern=3, query_pre_attn_scalar=24, initializer_range=0.05,
                      random_norms_and_biases=True)
    device = torch.device(DEVICE)
    load("paged_attention")
    from specdec.layers.attention_triton import TRITON_BACKEND as backend

    model = load_model(path, torch.float32, device, backend, load_config(path))
    layout = KVLayout(BLOCK_SIZE, tuple(replace(g, num_blocks=NUM_BLOCKS) for g in kv_groups([WINDOW, WINDOW, None])))
    eager, graphed = (ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, device, torch.float32, kv_layout=layout)
                      for _ in range(2))
    graphed.enable_graphs([1, 2, 4], [1, 3], max_blocks_per_seq=6, use_graphs=DEVICE != "cpu")
    return eager, graphed


def test_hybrid_graph_steps_read_each_groups_own_tables(hybrid_runners):
    """Each KV cache group's block table and slots go through its own static buffers: replayed
    steps give the eager logits and both pools' caches, with the sliding group's blocks behind the
    window freed (block id 0 in its table: no query reads there) and its other blocks elsewhere
    than the global group's."""
    eager, graphed = hybrid_runners
    gen = torch.Generator().manual_seed(0)
    full = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    sliding = [[20, 19, 18, 17], [16, 15, 14, 13], [2, 3, 1, 21]]

    def run(feeds, starts, full_tables, sliding_tables, expect_graph):
        rows = [list(range(len(f))) for f in feeds]
        groups = [(t,) for t in sliding_tables]
        batches = [r.prepare(feeds, starts, full_tables, rows, group_block_tables=groups) for r in (eager, graphed)]
        assert (graphed._graph_for(batches[1]) is not None) == expect_graph
        expected, expected_hidden = eager.forward_with_hidden(batches[0])
        got, hidden = graphed.forward_with_hidden(batches[1])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(hidden, expected_hidden, rtol=1e-4, atol=1e-4)

    prompts = [torch.randint(3, 60, (12,), generator=gen).tolist() for _ in range(3)]
    run(prompts, [0] * 3, [t[:3] for t in full], [t[:3] for t in sliding], expect_graph=False)  # prefill
    # positions 12..14 see keys 5.. in the sliding layers: block 0 is freed there (id 0)
    freed = [[0] + t[1:] for t in sliding]
    verify = [torch.randint(3, 60, (3,), generator=gen).tolist() for _ in range(3)]
    run(verify, [12] * 3, full, freed, expect_graph=True)  # 3 requests padded to the batch-4 graph
    run([[11], [12]], [15, 15], [t[:4] for t in full[:2]], [t[:4] for t in freed[:2]], expect_graph=True)  # decode
    for a, b in zip(eager.kv_caches, graphed.kv_caches):  # pad rows wrote nothing, in either pool
        torch.testing.assert_close(a, b)
    assert [c.shape[1] for c in graphed.kv_caches] == [NUM_BLOCKS] * 3
    assert graphed.kv_caches[0][:, 0].abs().sum() == 0  # nothing was written to the freed id
