"""A draft_model engine with token trees, and an EAGLE engine, on the graph path (Triton
attention; the padded tree graphs and the per-batch-size graphs, an EAGLE head's fed its
features, run eagerly on CPU with the kernels in the interpreter) give plain greedy decoding's
tokens, in float32."""
import os

DEVICE = os.environ.get("SPECDEC_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton; it is in the 'test' extra)")

from specdec import LLM, SamplingParams
from specdec.worker.setup import _enable_graphs

# two engines live in this process: each takes a fixed KV cache, not a share of the GPU
ENGINE = dict(dtype="float32", device=DEVICE, max_model_len=96, spec_cost_calibration=False, kv_cache_memory=64 << 20)


def test_tree_steps_through_graphs_stay_lossless(llama_path, noisy_draft_path, prompts):
    chosen = prompts[:3]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = LLM(model=llama_path, **ENGINE)
    expected = [o.outputs[0].token_ids for o in plain.generate(chosen, params, use_tqdm=False)]
    llm = LLM(model=llama_path, attention_backend="triton", **ENGINE,
              speculative_config={"method": "draft_model", "model": noisy_draft_path, "num_speculative_tokens": 3,
                                  "tree_topk": 2, "tree_nodes": 6})
    engine = llm.engine.executor.driver_worker
    if DEVICE == "cpu":  # the builder captures graphs on GPUs only: add the same ones, run eagerly
        _enable_graphs(llm.config, engine.runner, engine.draft_runner, llm.engine.max_model_len,
                       llm.config.speculative_config, engine.method)
    calls = {"target": 0, "draft": 0}
    for name, runner in (("target", engine.runner), ("draft", engine.draft_runner)):
        graph, run = runner.tree_graph, runner.tree_graph.run

        def counted(*args, _run=run, _name=name):
            calls[_name] += 1
            return _run(*args)

        graph.run = counted  # counts the steps served by the tree graph
    got = [o.outputs[0].token_ids for o in llm.generate(chosen, params, use_tqdm=False)]
    assert got == expected
    assert calls["target"] > 0 and calls["draft"] > 0
    assert engine.runner.tree_graph.max_query_len == 7 and engine.draft_runner.tree_graph.max_query_len == 2


def test_eagle_steps_through_graphs_stay_lossless(llama_path, eagle_head_path, prompts):
    chosen = prompts[:3]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = LLM(model=llama_path, **ENGINE)
    expected = [o.outputs[0].token_ids for o in plain.generate(chosen, params, use_tqdm=False)]
    llm = LLM(model=llama_path, attention_backend="triton", **ENGINE,
              speculative_config={"method": "eagle", "model": eagle_head_path, "num_speculative_tokens": 3})
    engine = llm.engine.executor.driver_worker
    if DEVICE == "cpu" or not engine.draft_runner.graphs:  # EAGLE steps are not captured by the builder yet
        _enable_graphs(llm.config, engine.runner, engine.draft_runner, llm.engine.max_model_len,
                       llm.config.speculative_config, engine.method)
    assert engine.draft_runner.tree_graph is None  # a head's tree passes need features: eager
    calls = {"target": 0, "draft": 0}
    for name, runner in (("target", engine.runner), ("draft", engine.draft_runner)):
        for graph in runner.graphs.values():
            def counted(*args, _run=graph.run, _name=name, **kwargs):
                calls[_name] += 1
                return _run(*args, **kwargs)

            graph.run = counted
    got = [o.outputs[0].token_ids for o in llm.generate(chosen, params, use_tqdm=False)]
    assert got == expected
    assert calls["target"] > 0 and calls["draft"] > 0  # verification steps and drafting passes replayed
