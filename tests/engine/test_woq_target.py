"""int8 / int4 targets (``quantization=``): speculation is lossless with respect to the quantized
target (greedy, float32: speculative output equals the same engine's plain output), the draft can
be quantized too, and the fast CPU kernel decodes the same tokens as the pure-torch reference."""
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.kernels.cpu import woq_cpu
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


@pytest.mark.parametrize("quantization", ["int4", "w4a8"])
def test_quantized_target_with_token_trees_equals_it_without(llama_path, noisy_draft_path, prompts, quantization):
    chosen = prompts[4:7]
    llm = LLM(model=llama_path, **ENGINE, quantization=quantization, speculative_config={
        "method": "draft_model", "model": noisy_draft_path, "num_speculative_tokens": 3,
        "tree_topk": 2, "tree_nodes": 6})
    assert greedy_tokens(llm, chosen) == greedy_tokens(llm, chosen, use_speculation=False)


@pytest.mark.skipif("not woq_cpu.available()", reason="no AVX-512 kernel on this machine")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_kernel_decodes_the_tokens_of_the_pure_torch_reference(llama_path, prompts, quantization, monkeypatch):
    chosen = prompts[:4]
    fast = greedy_tokens(LLM(model=llama_path, **ENGINE, quantization=quantization), chosen)
    monkeypatch.setattr(woq_cpu, "extension", lambda: None)  # every layer takes the reference path
    assert greedy_tokens(LLM(model=llama_path, **ENGINE, quantization=quantization), chosen) == fast


@pytest.fixture(scope="module")
def wide_pair(make_model, make_perturbed_copy, tmp_path_factory):
    """A target with SmolLM2-135M's attention shape (9 query / 3 kv heads of 64) and a noisy copy as draft."""
    target = make_model("wide_llama", arch="llama", hidden_size=576, num_heads=9, num_kv_heads=3,
                        intermediate_size=1536, initializer_range=0.05, random_norms_and_biases=True)
    return target, make_perturbed_copy(target, tmp_path_factory.mktemp("wide_draft"), scale=0.1, seed=3)


@pytest.mark.parametrize("quantization", ["w4a8", "w8a8"])
@pytest.mark.parametrize("spec", [
    {"method": "draft_model", "num_speculative_tokens": 3},
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
], ids=["draft-chain-k3", "ngram-k3"])
def test_int8_activation_target_with_speculation_equals_it_without(wide_pair, prompts, quantization, spec):
    """int8 activations make each layer a step function of its input: lossless only because every
    other op computes a row the same in a decode step and in a verification (attention backend
    "rows"); the plain run goes first, so the speculative one also meets its prompts' cached blocks."""
    target, draft = wide_pair
    chosen = prompts[:4]
    spec = dict(spec, model=draft) if spec["method"] == "draft_model" else spec
    llm = LLM(model=target, **ENGINE, quantization=quantization, speculative_config=spec)
    model = llm.engine.executor.driver_worker.runner.model
    assert model.layers[0].self_attn.backend.name == "rows"
    assert sum(isinstance(m, WeightOnlyLinear) and m.int8_activations for m in model.modules()) > 0
    plain = greedy_tokens(llm, chosen, use_speculation=False)
    assert greedy_tokens(llm, chosen) == plain
    # the next token came from row 0 of a multi-row verification, not from a one-row decode
    assert llm.get_metrics()["num_draft_tokens"] > 0
    if spec["method"] == "draft_model":
        assert llm.get_metrics()["num_accepted_tokens"] > 0


def test_int8_activations_compute_in_float32_under_auto_dtype_on_a_bf16_cpu(wide_pair, prompts, monkeypatch):
    """Where "auto" means bf16 (avx512_bf16 / AMX), w4a8 still runs float32 activations and the
    row-by-row attention, the ops its losslessness rests on."""
    from specdec.worker import device

    monkeypatch.setattr(device, "cpu_supports_bf16", lambda: True)
    target, draft = wide_pair
    chosen = prompts[:3]
    engine = dict(ENGINE, dtype="auto")
    assert LLM(model=target, **engine, quantization="int8").engine.dtype == torch.bfloat16  # the rule is w4a8's
    llm = LLM(model=target, **engine, quantization="w4a8", speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    assert llm.engine.dtype == torch.float32
    assert llm.engine.executor.driver_worker.runner.model.layers[0].self_attn.backend.name == "rows"
    assert greedy_tokens(llm, chosen) == greedy_tokens(llm, chosen, use_speculation=False)
