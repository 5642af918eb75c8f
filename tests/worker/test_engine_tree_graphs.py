"""A draft_model engine with token trees, and an EAGLE engine, on the graph path (Triton
attention; the padded tree graphs and the per-batch-size graphs, an EAGLE head's fed its
features, run eagerly on CPU with the kernels in the interpreter) give plain greedy decoding's
tokens, in float32."""
import os

if os.environ.get("SPECDEC_KERNEL_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton; it is in the 'test' extra)")

from specdec.worker.setup import _enable_graphs


def test_tree_steps_through_graphs_stay_lossless(graph_case, llama_path, noisy_draft_path):
    llm = graph_case.engine(llama_path, {"method": "draft_model", "model": noisy_draft_path,
                                         "num_speculative_tokens": 3, "tree_topk": 2, "tree_nodes": 6})
    engine = llm.engine.executor.driver_worker
    if graph_case.device == "cpu":  # the builder captures graphs on GPUs only: add the same ones, run eagerly
        _enable_graphs(llm.config, engine.runner, engine.draft_runner, llm.engine.max_model_len,
                       llm.config.speculative_config, engine.method)
    calls = graph_case.count_runs({"target": [engine.runner.tree_graph], "draft": [engine.draft_runner.tree_graph]})
    assert graph_case.generate(llm) == graph_case.expected
    assert calls["target"] > 0 and calls["draft"] > 0
    assert engine.runner.tree_graph.max_query_len == 7 and engine.draft_runner.tree_graph.max_query_len == 2


def test_eagle_steps_through_graphs_stay_lossless(graph_case, llama_path, eagle_head_path):
    llm = graph_case.engine(llama_path, {"method": "eagle", "model": eagle_head_path, "num_speculative_tokens": 3})
    engine = llm.engine.executor.driver_worker
    if graph_case.device == "cpu" or not engine.draft_runner.graphs:  # EAGLE steps are not captured by the builder yet
        _enable_graphs(llm.config, engine.runner, engine.draft_runner, llm.engine.max_model_len,
                       llm.config.speculative_config, engine.method)
    assert engine.draft_runner.tree_graph is None  # a head's tree passes need features: eager
    calls = graph_case.count_runs({"target": list(engine.runner.graphs.values()),
                                   "draft": list(engine.draft_runner.graphs.values())})
    assert graph_case.generate(llm) == graph_case.expected
    assert calls["target"] > 0 and calls["draft"] > 0  # verification steps and drafting passes replayed
