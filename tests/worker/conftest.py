"""The setup of the engine tests that run speculative steps through graphs (test_engine_*graphs.py):
the engine settings, the plain greedy tokens each engine must reproduce, and a counter of the steps
the graphs served. On CPU the graphs run eagerly with the Triton kernels in the interpreter; with
SPECDEC_KERNEL_DEVICE=cuda (scripts/gpu_check.sh) they are captured and replayed."""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from specdec import LLM, SamplingParams

GRAPH_DEVICE = os.environ.get("SPECDEC_KERNEL_DEVICE", "cpu")
# two engines live in one process: each takes a fixed KV cache, not a share of the GPU
GRAPH_ENGINE = dict(dtype="float32", device=GRAPH_DEVICE, max_model_len=96, spec_cost_calibration=False,
                    kv_cache_memory=64 << 20)


@dataclass
class GraphCase:
    device: str
    prompts: list[str]
    params: SamplingParams
    expected: list[list[int]]  # plain greedy decoding's tokens of ``prompts``

    def engine(self, model: str, speculative_config: dict) -> LLM:
        """A speculative engine on the Triton attention backend, which the graph path runs."""
        return LLM(model=model, attention_backend="triton", speculative_config=speculative_config, **GRAPH_ENGINE)

    def generate(self, llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(self.prompts, self.params, use_tqdm=False)]

    @staticmethod
    def count_runs(graphs: dict[object, list]) -> dict[object, int]:
        """Wraps each graph's ``run`` so that calls[key] counts the steps its graphs serve."""
        calls = {key: 0 for key in graphs}
        for key, group in graphs.items():
            for graph in group:
                def counted(*args, _run=graph.run, _key=key, **kwargs):
                    calls[_key] += 1
                    return _run(*args, **kwargs)

                graph.run = counted
        return calls


@pytest.fixture(scope="session")
def graph_case(llama_path, prompts) -> GraphCase:
    chosen = prompts[:3]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = LLM(model=llama_path, **GRAPH_ENGINE)
    expected = [o.outputs[0].token_ids for o in plain.generate(chosen, params, use_tqdm=False)]
    return GraphCase(GRAPH_DEVICE, chosen, params, expected)
