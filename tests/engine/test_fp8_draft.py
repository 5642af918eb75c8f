"""A draft_model engine with an fp8 draft (CPU: e4m3 storage, dequantise matmul) stays lossless:
greedy output in float32 equals plain greedy decoding; so does an EAGLE engine with an fp8 head
(token trees), and an fp8 target with speculation against the same fp8 target without it."""
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.layers.fp8 import Fp8Linear

ENGINE = dict(dtype="float32", device="cpu", max_model_len=96, spec_cost_calibration=False)


def greedy_tokens(llm, prompts, use_speculation=True):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, use_speculation=use_speculation)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def fp8_linears(model) -> int:
    return sum(isinstance(m, Fp8Linear) for m in model.modules())


def test_fp8_draft_is_lossless_and_still_accepted(llama_path, noisy_draft_path, prompts):
    chosen = prompts[:4]
    expected = greedy_tokens(LLM(model=llama_path, **ENGINE), chosen)
    llm = LLM(model=llama_path, **ENGINE, speculative_config={
        "method": "draft_model", "model": noisy_draft_path, "num_speculative_tokens": 3, "quantization": "fp8"})
    assert fp8_linears(llm.engine.executor.driver_worker.draft_runner.model) > 0 and fp8_linears(llm.engine.executor.driver_worker.runner.model) == 0
    assert greedy_tokens(llm, chosen) == expected
    metrics = llm.get_metrics()
    assert metrics["num_accepted_tokens"] > 0  # fp8 rounding leaves the draft useful


def test_fp8_eagle_head_drafting_trees_is_lossless(llama_path, prompts, tmp_path):
    from specdec.models.eagle import init_head, save_head
    from specdec.models.loader import load_model

    head = init_head(load_model(llama_path, torch.float32, torch.device("cpu")), seed=1)
    save_head(head, tmp_path / "head")
    chosen = prompts[7:10]
    expected = greedy_tokens(LLM(model=llama_path, **ENGINE), chosen)
    llm = LLM(model=llama_path, **ENGINE, speculative_config={
        "method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": 3, "quantization": "fp8",
        "tree_topk": 2, "tree_nodes": 6})
    assert fp8_linears(llm.engine.executor.driver_worker.draft_runner.model) > 0 and fp8_linears(llm.engine.executor.driver_worker.runner.model) == 0
    assert greedy_tokens(llm, chosen) == expected
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_fp8_target_with_speculation_equals_it_without(llama_path, prompts):
    chosen = prompts[4:7]
    llm = LLM(model=llama_path, **ENGINE, quantization="fp8", speculative_config={
        "method": "draft_model", "model": llama_path, "num_speculative_tokens": 2, "quantization": "fp8"})
    assert fp8_linears(llm.engine.executor.driver_worker.runner.model) > 0
    assert greedy_tokens(llm, chosen) == greedy_tokens(llm, chosen, use_speculation=False)


def test_an_unknown_draft_quantization_names_the_field():
    with pytest.raises(ValueError, match="speculative_config.quantization"):
        SpeculativeConfig(model="x", quantization="fp4")
