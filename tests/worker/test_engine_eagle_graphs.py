"""An EAGLE engine whose target steps go through the per-batch-size graphs (Triton attention;
run eagerly on CPU with the kernels in the interpreter, captured on a GPU): the graphs return
the hidden states the head drafts from, and greedy output equals plain decoding in float32."""
import os

DEVICE = os.environ.get("SPECDEC_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton; it is in the 'test' extra)")

from specdec import LLM, SamplingParams

ENGINE = dict(dtype="float32", device=DEVICE, max_model_len=96, spec_cost_calibration=False, kv_cache_memory=64 << 20)


def test_eagle_target_steps_through_graphs_stay_lossless(llama_path, eagle_head_path, prompts):
    chosen = prompts[:3]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = LLM(model=llama_path, **ENGINE)
    expected = [o.outputs[0].token_ids for o in plain.generate(chosen, params, use_tqdm=False)]
    llm = LLM(model=llama_path, attention_backend="triton", **ENGINE,
              speculative_config={"method": "eagle", "model": eagle_head_path, "num_speculative_tokens": 3})
    worker = llm.engine.executor.driver_worker
    max_blocks = -(-llm.engine.max_model_len // llm.config.block_size) + 1
    # decode (q = 1) and verification (q = K + 1) graphs of the target; on CPU run eagerly on their buffers
    worker.runner.enable_graphs([1, 2, 4], [1, 4], max_blocks, use_graphs=DEVICE != "cpu")
    served = []
    for q, graph in worker.runner.graphs.items():
        run = graph.run

        def counted(*args, _run=run, _q=q, **kwargs):
            served.append(_q)
            return _run(*args, **kwargs)

        graph.run = counted
    got = [o.outputs[0].token_ids for o in llm.generate(chosen, params, use_tqdm=False)]
    assert got == expected
    assert 4 in served  # verification steps came from the graphs
    assert llm.get_metrics()["num_draft_tokens"] > 0
