"""The tensor-parallel tests' harness (float32, CPU over gloo): each engine of 2 ranks spawns one
extra process (rank 1) and drives it from this one. ``tp`` starts engines and, whatever the test
did, shuts each down at the end and checks that no rank process is left behind; ``one_device``
starts the reference: the same settings on one device."""
from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams

SETTINGS = dict(dtype="float32", device="cpu", max_model_len=96)


class TensorParallelHarness:
    def __init__(self) -> None:
        self.running: list[LLM] = []

    def engine(self, model: str, speculative_config: dict | None = None, **kw) -> LLM:
        llm = LLM(model=model, tensor_parallel_size=2, speculative_config=speculative_config, **{**SETTINGS, **kw})
        self.running.append(llm)
        return llm

    def stop(self, llm: LLM) -> None:
        """Shut an engine down (again, if it already was) and check its rank processes are gone."""
        procs = list(llm.engine.executor._procs)
        llm.engine.executor.shutdown()
        assert all(not p.is_alive() for p in procs)
        self.running.remove(llm)

    @staticmethod
    def mixed_batch(llm: LLM, batch: list, params: SamplingParams) -> list[list[int]]:
        """Greedy tokens of ``batch`` where the odd requests speculate and the even ones do not."""
        plain = params.clone(use_speculation=False)
        outs = llm.generate(batch, [params if i % 2 else plain for i in range(len(batch))], use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def tp():
    harness = TensorParallelHarness()
    yield harness
    for llm in list(harness.running):
        harness.stop(llm)


@pytest.fixture(scope="session")
def one_device():
    def start(model: str, speculative_config: dict | None = None, **kw) -> LLM:
        return LLM(model=model, speculative_config=speculative_config, **{**SETTINGS, **kw})
    return start
