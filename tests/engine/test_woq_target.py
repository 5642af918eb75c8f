"""int8 / int4 targets (``quantization=``): speculation is lossless with respect to the quantized
target (greedy, float32: speculative output equals the same engine's plain output), the draft can
be quantized too, and the fast CPU kernel decodes the same tokens as the pure-torch reference."""
import pytest

from specdec import LLM, SamplingParams
from specdec.kernels import woq_cpu
from specdec.layers.quantization import WeightOnlyLinear

ENGINE = dict(dtype="float32", device="cpu", max_model_len=96, spec_cost_calibration=False)


def greedy_tokens(llm, prompts, use_speculation=True):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, use_speculation=use_speculation)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def woq_layers(model, int4: bool) -> int:
    return sum(isinstance(m, WeightOnlyLinear) and m.int4 == int4 for m in model.modules())


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_target_with_speculation_equals_it_without(llama_path, noisy_draft_path, prompts, quantization):
    chosen = prompts[:4]
    llm = LLM(model=llama_path, **ENGINE, quantization=quantization, speculative_config={
        "method": "draft_model", "model": noisy_draft_path, "num_speculative_tokens": 3,
        "quantization": quantization})
    worker = llm.engine.executor.driver_worker
    int4 = quantization == "int4"
    assert woq_layers(worker.runner.model, int4) > 0 and woq_layers(worker.draft_runner.model, int4) > 0
    assert greedy_tokens(llm, chosen) == greedy_tokens(llm, chosen, use_speculation=False)
    assert llm.get_metrics()["num_accepted_tokens"] > 0


def test_quantized_target_with_token_trees_equals_it_without(llama_path, noisy_draft_path, prompts):
    chosen = prompts[4:7]
    llm = LLM(model=llama_path, **ENGINE, quantization="int4", speculative_config={
        "method": "draft_model", "model": noisy_draft_path, "num_speculative_tokens": 3,
        "tree_topk": 2, "tree_nodes": 6})
    assert greedy_tokens(llm, chosen) == greedy_tokens(llm, chosen, use_speculation=False)


@pytest.mark.skipif(not woq_cpu.available(), reason="no AVX-512 kernel on this machine")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_kernel_decodes_the_tokens_of_the_pure_torch_reference(llama_path, prompts, quantization, monkeypatch):
    chosen = prompts[:4]
    fast = greedy_tokens(LLM(model=llama_path, **ENGINE, quantization=quantization), chosen)
    monkeypatch.setattr(woq_cpu, "extension", lambda: None)  # every layer takes the reference path
    assert greedy_tokens(LLM(model=llama_path, **ENGINE, quantization=quantization), chosen) == fast
