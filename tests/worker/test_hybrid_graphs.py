"""A hybrid model (tiny Gemma 3: two sliding-window layers around a global one) on the graph path:
each KV cache group reads its own static block table and slots, so the sliding group still frees
its blocks behind the window. Replayed steps (decode, verification, a draft model's passes, token
trees) give the eager engine's greedy tokens in float32. On CPU the graphs run eagerly on the same
padded static buffers with the Triton kernels in the interpreter; on a GPU
(SPECDEC_KERNEL_DEVICE=cuda) the builder captures them."""
import os

DEVICE = os.environ.get("SPECDEC_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton; it is in the 'test' extra)")

from specdec import LLM, SamplingParams
from specdec.worker.setup import _enable_graphs

WINDOW, BS, NUM_NEW = 8, 4, 12
# prefill chunks of 16 tokens; a fixed KV cache (two engines share a GPU)
ENGINE = dict(dtype="float32", device=DEVICE, max_model_len=96, block_size=BS, max_num_batched_tokens=16,
              spec_cost_calibration=False, kv_cache_memory=16 << 20)


@pytest.fixture(scope="module")
def gemma3(make_model, make_perturbed_copy, tmp_path_factory):
    target = make_model("graphs_gemma3", arch="gemma3", num_layers=3, head_dim=16, sliding_window=WINDOW,
                        sliding_window_pattern=3, query_pre_attn_scalar=24, initializer_range=0.05,
                        random_norms_and_biases=True)
    draft = make_perturbed_copy(target, tmp_path_factory.mktemp("graphs_gemma3_noisy"), scale=0.1, seed=3)
    return target, draft


@pytest.fixture(scope="module")
def chosen(gemma3, prompts):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma3[0])
    encoded = [tokenizer.encode(p) for p in sorted(prompts, key=len)[-2:]]
    assert min(len(p) for p in encoded) > WINDOW + BS  # blocks fall behind the window during the prompt
    return encoded


@pytest.fixture(scope="module")
def expected(gemma3, chosen):
    plain = LLM(model=gemma3[0], **ENGINE)  # eager, the platform's default attention
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in plain.generate([list(p) for p in chosen], params, use_tqdm=False)]


def count_replays(runner, calls: dict, name: str) -> None:
    """Counts, under ``name``, the steps ``runner`` serves from a captured (or padded) graph."""
    graphs = list(runner.graphs.values()) + ([runner.tree_graph] if runner.tree_graph is not None else [])
    for graph in graphs:
        def counted(*args, _run=graph.run, **kwargs):
            calls[name] += 1
            return _run(*args, **kwargs)

        graph.run = counted


@pytest.mark.parametrize("spec", [None, "chain", "tree"])
def test_hybrid_steps_through_graphs_equal_eager_and_free_sliding_blocks(spec, gemma3, chosen, expected):
    target, draft = gemma3
    speculative = {None: None,
                   "chain": {"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
                   "tree": {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "tree_topk": 2,
                            "tree_nodes": 6}}[spec]
    llm = LLM(model=target, attention_backend="triton", speculative_config=speculative, **ENGINE)
    engine = llm.engine
    worker = engine.executor.driver_worker
    layout = engine.runtime_plan.kv_layout
    assert [(g.window, g.layers) for g in layout.groups] == [(None, (2,)), (WINDOW, (0, 1))]  # no fallback
    if DEVICE == "cpu":  # the builder captures graphs on GPUs only: add the same ones, run eagerly
        _enable_graphs(llm.config, worker.runner, worker.draft_runner, engine.max_model_len,
                       llm.config.speculative_config, worker.method)
    runners = {"target": worker.runner, "draft": worker.draft_runner}
    calls = {name: 0 for name, runner in runners.items() if runner is not None}
    for name in calls:
        assert runners[name].num_kv_groups == 2
        count_replays(runners[name], calls, name)
    full, sliding = engine.kv.groups
    for i, p in enumerate(chosen):
        engine.add_request(str(i), list(p), SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True))
    got, most_sliding, most_full = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        for r in engine.scheduler.running:
            if r.num_output_tokens > 4:  # decoding, and a draft has caught up
                most_sliding = max(most_sliding, sum(b is not None for b in sliding.req_blocks[r.request_id]))
                most_full = max(most_full, sum(b is not None for b in full.req_blocks[r.request_id]))
    assert [got[str(i)] for i in range(len(chosen))] == expected
    assert all(n > 0 for n in calls.values()), calls
    # the window's keys before the step, the step's rows (at most 1 + 6 tree nodes) and the next
    # step's slots (as many), one straddled block: however long the sequence
    assert 0 < most_sliding <= -(-(WINDOW + 2 * 7) // BS) + 1 < most_full
    for group in engine.kv.groups:  # no leaks
        assert group.pool.num_free_blocks == group.pool.num_blocks
