"""``dtype="auto"`` on a CPU without bf16 arithmetic runs float32, and the linears a bf16
checkpoint filled keep their bf16 weights (``Bf16WeightLinear``): the same values, half the bytes
a decode step reads. Greedy tokens equal an explicit float32 run's, with and without speculation."""
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.kernels.cpu import woq_cpu
from specdec.layers.quantization import Bf16WeightLinear
from specdec.worker.device import cpu_supports_bf16

pytestmark = pytest.mark.skipif("cpu_supports_bf16() or not woq_cpu.available()",
                                reason="'auto' is bfloat16 on this CPU, or no AVX-512 kernel")
ENGINE = dict(device="cpu", max_model_len=96, spec_cost_calibration=False)


def greedy_tokens(llm, prompts, use_speculation=True):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, use_speculation=use_speculation)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_auto_keeps_a_bf16_llama_path_in_bf16_and_decodes_float32_tokens(bf16_llama_path, prompts):
    chosen = prompts[:4]
    reference = greedy_tokens(LLM(model=bf16_llama_path, dtype="float32", **ENGINE), chosen)
    llm = LLM(model=bf16_llama_path, dtype="auto", **ENGINE, speculative_config={
        "method": "draft_model", "model": bf16_llama_path, "num_speculative_tokens": 3})
    worker = llm.engine.executor.driver_worker
    for model in (worker.runner.model, worker.draft_runner.model):
        assert sum(isinstance(m, Bf16WeightLinear) for m in model.modules()) == 2 * 4 + 1  # qkv, o, gate_up, down in 2 layers; lm_head
    assert greedy_tokens(llm, chosen, use_speculation=False) == reference
    assert greedy_tokens(llm, chosen) == reference


def test_auto_leaves_a_float32_checkpoint_in_float32(llama_path):
    model = LLM(model=llama_path, dtype="auto", **ENGINE).engine.executor.driver_worker.runner.model
    assert not any(isinstance(m, Bf16WeightLinear) for m in model.modules())


def test_an_explicit_float32_engine_keeps_float32_weights_in_target_and_draft(bf16_llama_path):
    worker = LLM(model=bf16_llama_path, dtype="float32", **ENGINE, speculative_config={
        "method": "draft_model", "model": bf16_llama_path, "num_speculative_tokens": 2}).engine.executor.driver_worker
    for model in (worker.runner.model, worker.draft_runner.model):
        assert not any(isinstance(m, Bf16WeightLinear) for m in model.modules())
