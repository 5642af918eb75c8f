"""``dtype="auto"`` on a CPU with bf16 arithmetic (no quantization) where the bf16
kernel is the faster linear: the model is loaded in bf16, its linears keep their bf16 weights and
everything else computes in float32 (the fused float32 CPU ops and the row-by-row attention).
Greedy tokens equal an explicit float32 run's of the same bf16 checkpoint, with and without
speculation."""
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.kernels.cpu import woq_cpu
from specdec.layers import quantization
from specdec.layers.quantization import Bf16WeightLinear

pytestmark = pytest.mark.skipif("not woq_cpu.available()", reason="no CPU weight kernel here")
ENGINE = dict(device="cpu", max_model_len=96, spec_cost_calibration=False)


@pytest.fixture
def bf16_cpu(monkeypatch):
    from specdec.worker import device

    monkeypatch.setattr(device, "cpu_supports_bf16", lambda: True)
    monkeypatch.setattr(quantization, "bf16_kernel_faster", lambda: True)


def greedy_tokens(llm, prompts, use_speculation=True):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, use_speculation=use_speculation)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_auto_runs_bf16_weights_with_float32_activations_and_decodes_float32_tokens(bf16_cpu, bf16_llama_path,
                                                                                      prompts):
    chosen = prompts[:4]
    reference = greedy_tokens(LLM(model=bf16_llama_path, dtype="float32", **ENGINE), chosen)
    llm = LLM(model=bf16_llama_path, dtype="auto", **ENGINE, speculative_config={
        "method": "draft_model", "model": bf16_llama_path, "num_speculative_tokens": 3})
    assert llm.engine.dtype == torch.float32
    worker = llm.engine.executor.driver_worker
    for model in (worker.runner.model, worker.draft_runner.model):
        assert sum(isinstance(m, Bf16WeightLinear) for m in model.modules()) == 2 * 4 + 1  # qkv, o, gate_up, down x 2; lm_head
        assert all(m.weight_bf16.dtype == torch.bfloat16 for m in model.modules() if isinstance(m, Bf16WeightLinear))
        assert model.embed_tokens.weight.dtype == torch.float32 and model.norm.weight.dtype == torch.float32
        assert model.layers[0].self_attn.backend.name == "rows"
    assert greedy_tokens(llm, chosen, use_speculation=False) == reference
    assert greedy_tokens(llm, chosen) == reference


def test_explicit_bf16_takes_the_same_bf16_weight_path_as_auto(bf16_cpu, bf16_llama_path, prompts):
    """What a vLLM user passes is not the slower path: bf16 weights, float32 activations."""
    chosen = prompts[:3]
    reference = greedy_tokens(LLM(model=bf16_llama_path, dtype="float32", **ENGINE), chosen)
    llm = LLM(model=bf16_llama_path, dtype="bfloat16", **ENGINE, speculative_config={
        "method": "draft_model", "model": bf16_llama_path, "num_speculative_tokens": 3})
    assert llm.engine.dtype == torch.float32
    model = llm.engine.executor.driver_worker.runner.model
    assert sum(isinstance(m, Bf16WeightLinear) for m in model.modules()) == 2 * 4 + 1
    assert greedy_tokens(llm, chosen) == reference


def test_explicit_bf16_without_a_faster_bf16_kernel_and_a_quantized_auto_engine_keep_their_dtypes(
        bf16_cpu, bf16_llama_path, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(quantization, "bf16_kernel_faster", lambda: False)
        assert LLM(model=bf16_llama_path, dtype="bfloat16", **ENGINE).engine.dtype == torch.bfloat16
    llm = LLM(model=bf16_llama_path, dtype="auto", quantization="int8", **ENGINE)
    assert llm.engine.dtype == torch.bfloat16  # weight-only int8 keeps the bf16 model it had
    assert not any(isinstance(m, Bf16WeightLinear) for m in llm.engine.executor.driver_worker.runner.model.modules())


def test_an_eagle_head_drafts_for_the_float32_activations_target(bf16_cpu, bf16_llama_path, eagle_head_path,
                                                                 prompts):
    """The head shares the widened target's embedding (float32) and LM head."""
    head = eagle_head_path
    chosen = prompts[:3]
    reference = greedy_tokens(LLM(model=bf16_llama_path, dtype="float32", **ENGINE), chosen)
    llm = LLM(model=bf16_llama_path, dtype="auto", **ENGINE, speculative_config={
        "method": "eagle", "model": str(head), "num_speculative_tokens": 3})
    assert llm.engine.dtype == torch.float32
    assert greedy_tokens(llm, chosen) == reference
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_a_kv_budget_that_holds_a_sequence_only_in_bf16_keeps_the_bf16_model(bf16_cpu, bf16_llama_path):
    from transformers import AutoConfig

    from specdec.config import EngineConfig
    from specdec.worker.model_runner import ModelRunner
    from specdec.worker.plan import blocks_per_sequence

    cfg = EngineConfig(model=bf16_llama_path, max_model_len=ENGINE["max_model_len"])
    bf16_bytes = blocks_per_sequence(cfg, cfg.max_model_len, 0) * ModelRunner.kv_bytes_per_block(
        AutoConfig.from_pretrained(bf16_llama_path), cfg.block_size, torch.bfloat16)
    llm = LLM(model=bf16_llama_path, dtype="auto", kv_cache_memory=bf16_bytes, **ENGINE)
    assert llm.engine.dtype == torch.bfloat16  # a float32 cache would not hold one max_model_len sequence
    assert LLM(model=bf16_llama_path, dtype="auto", kv_cache_memory=2 * bf16_bytes, **ENGINE).engine.dtype == torch.float32
