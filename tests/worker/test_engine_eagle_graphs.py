"""An EAGLE engine whose target steps go through the per-batch-size graphs (Triton attention;
run eagerly on CPU with the kernels in the interpreter, captured on a GPU): the graphs return
the hidden states the head drafts from, and greedy output equals plain decoding in float32."""
import os

if os.environ.get("SPECDEC_KERNEL_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton; it is in the 'test' extra)")


def test_eagle_target_steps_through_graphs_stay_lossless(graph_case, llama_path, eagle_head_path):
    llm = graph_case.engine(llama_path, {"method": "eagle", "model": eagle_head_path, "num_speculative_tokens": 3})
    worker = llm.engine.executor.driver_worker
    max_blocks = -(-llm.engine.max_model_len // llm.config.block_size) + 1
    # decode (q = 1) and verification (q = K + 1) graphs of the target; on CPU run eagerly on their buffers
    worker.runner.enable_graphs([1, 2, 4], [1, 4], max_blocks, use_graphs=graph_case.device != "cpu")
    served = graph_case.count_runs({q: [graph] for q, graph in worker.runner.graphs.items()})
    assert graph_case.generate(llm) == graph_case.expected
    assert served[4] > 0  # verification steps came from the graphs
    assert llm.get_metrics()["num_draft_tokens"] > 0
