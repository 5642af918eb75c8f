"""GGUF Q8_0 / Q4_0 linears load kept quantized (int8 / int4 layers over the file's own blocks),
and decode, in float32, the tokens of the pure-torch reference over the same weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from test_hub import _permute_for_llama_cpp, _tiny_model, _write_gguf  # noqa: E402

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.kernels import woq_cpu  # noqa: E402
from specdec.layers.quantization import WeightOnlyLinear  # noqa: E402
from specdec.models import gguf_convert  # noqa: E402

QTYPES = {"Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_0": gguf.GGMLQuantizationType.Q4_0}
ENGINE = dict(dtype="float32", device="cpu", max_model_len=64, spec_cost_calibration=False)


@pytest.fixture(scope="module", params=[("llama", "Q8_0"), ("llama", "Q4_0"), ("qwen2", "Q4_0")],
                ids=lambda p: "-".join(p))
def converted(request, tmp_path_factory):
    arch, qtype = request.param
    original = _tiny_model(arch)
    folder = tmp_path_factory.mktemp(f"{arch}-{qtype}")
    _write_gguf(original, folder / "tiny.gguf", arch, pre="smollm" if arch == "llama" else "qwen2",
                linear_qtype=QTYPES[qtype])
    out = gguf_convert.convert_gguf(folder / "tiny.gguf", folder / "hf", progress=False)
    return original, str(out), arch, qtype


def dequantized_file_weight(original, name: str, arch: str, qtype: str) -> torch.Tensor:
    """What llama.cpp's dequantization of the file gives for one transformers weight."""
    data = original.state_dict()[name].float().numpy()
    config = original.config
    if arch == "llama" and ".q_proj." in name:
        data = _permute_for_llama_cpp(data, config.num_attention_heads)
    elif arch == "llama" and ".k_proj." in name:
        data = _permute_for_llama_cpp(data, config.num_key_value_heads)
    w = gguf.quants.dequantize(gguf.quants.quantize(data, QTYPES[qtype]), QTYPES[qtype])
    if arch == "llama" and ".q_proj." in name:  # undo, as the loader does on quantized rows
        w = _permute_for_llama_cpp(w, config.num_attention_heads).reshape(w.shape)
    return torch.from_numpy(np.ascontiguousarray(w)).float()


def test_linears_stay_quantized_with_the_files_exact_values(converted):
    original, folder, arch, qtype = converted
    llm = LLM(model=folder, **ENGINE)
    model = llm.engine.executor.driver_worker.runner.model
    layers = [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]
    assert len(layers) == 4 * original.config.num_hidden_layers + (0 if original.config.tie_word_embeddings else 1)
    assert all(m.int4 == (qtype == "Q4_0") and m.quantized_weight().group_size == 32 for m in layers)
    plain = [name for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert plain == (["lm_head"] if original.config.tie_word_embeddings else [])  # a tied head is the embedding
    attn = model.layers[0].self_attn
    q_size = attn.q_size
    got = attn.qkv_proj.quantized_weight().dequantize(torch.float32)
    if arch == "llama":  # the loader undid the Q/K permutation: rows in transformers order
        heads = original.config.num_attention_heads
        expected_q = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(
            _permute_for_llama_cpp(original.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy(), heads),
            QTYPES[qtype]), QTYPES[qtype]))
        d = expected_q.shape[0] // heads // 2
        expected_q = expected_q.reshape(heads, d, 2, -1).transpose(1, 2).reshape(expected_q.shape)
    else:
        expected_q = dequantized_file_weight(original, "model.layers.0.self_attn.q_proj.weight", arch, qtype)
    assert torch.equal(got[:q_size], expected_q)
    down = dequantized_file_weight(original, "model.layers.1.mlp.down_proj.weight", arch, qtype)
    assert torch.equal(model.layers[1].mlp.down_proj.quantized_weight().dequantize(torch.float32), down)


def greedy(llm, prompts, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.skipif(not woq_cpu.available(), reason="no AVX-512 kernel on this machine")
def test_kernel_decodes_the_tokens_of_the_reference(converted, monkeypatch):
    _, folder, _, _ = converted
    prompts = ["hello world", "the world", "fellow the"]
    fast = greedy(LLM(model=folder, **ENGINE), prompts)
    monkeypatch.setattr(woq_cpu, "extension", lambda: None)
    assert greedy(LLM(model=folder, **ENGINE), prompts) == fast


def test_logits_are_close_to_the_dequantized_float_model(converted):
    """The activations' int8 rounding is the only difference from float math on the file's weights."""
    original, folder, arch, qtype = converted
    reference = type(original)(original.config).eval()
    state = {k: (dequantized_file_weight(original, k, arch, qtype) if v.ndim == 2 and "embed" not in k else v)
             for k, v in original.state_dict().items()}
    if original.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    reference.load_state_dict(state, strict=False)
    llm = LLM(model=folder, **ENGINE)
    ids = [5, 17, 99, 200, 3, 42, 7]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5),
                       use_tqdm=False)[0]
    with torch.no_grad():
        ref_logits = reference(torch.tensor([ids])).logits[0, -1]
    assert out.outputs[0].token_ids[0] == int(ref_logits.argmax())


def test_speculation_over_a_kept_quantized_gguf_is_lossless(converted):
    _, folder, _, _ = converted
    llm = LLM(model=folder, **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompts = ["hello world hello world hello", "the world the world the"]
    assert greedy(llm, prompts) == greedy(llm, prompts, use_speculation=False)
