"""GGUF Q8_0 / Q4_0 linears load kept quantized (int8 / int4 layers over the file's own blocks),
and decode, in float32, the tokens of the pure-torch reference over the same weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from test_hub import _permute_for_llama_cpp, _tiny_model, _write_gguf  # noqa: E402

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.kernels.cpu import woq_cpu  # noqa: E402
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


@pytest.mark.skipif("not woq_cpu.available()", reason="no AVX-512 kernel on this machine")
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


# --- K-quants and the other kept types, mixed as llama.cpp's Q4_K_M mixes them ---------------

T = gguf.GGMLQuantizationType


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape[:-1], -1)


def encode_q4_k(data: np.ndarray) -> np.ndarray:
    """Rows -> Q4_K blocks (144 bytes per 256 inputs), min/max per 32 as llama.cpp's reference does."""
    x = data.astype(np.float32).reshape(-1, 8, 32)
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    sub_scale, sub_min = (hi - lo) / 15, -lo
    d = np.maximum(sub_scale.max(-1, keepdims=True) / 63, 1e-8).astype(np.float16).astype(np.float32)
    dmin = np.maximum(sub_min.max(-1, keepdims=True) / 63, 1e-8).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(sub_scale / d), 1, 63).astype(np.uint8)
    m = np.clip(np.round(sub_min / dmin), 0, 63).astype(np.uint8)
    q = np.clip(np.round((x + (dmin * m)[..., None]) / (d * sc)[..., None]), 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], axis=-1)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), scales, qs], axis=-1)
    return blocks.reshape(data.shape[0], -1)


def encode_q6_k(data: np.ndarray) -> np.ndarray:
    """Rows -> Q6_K blocks (210 bytes per 256 inputs): ql[128], qh[64], 16 int8 scales, fp16 d."""
    x = data.astype(np.float32).reshape(-1, 16, 16)
    sub = np.abs(x).max(-1) / 31
    d = np.maximum(np.abs(sub).max(-1, keepdims=True) / 127, 1e-8).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(sub / d), 1, 127).astype(np.int8)
    q = (np.clip(np.round(x / (d * sc)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    low, high = (q & 0xF).reshape(-1, 2, 2, 64), (q >> 4).reshape(-1, 2, 4, 32)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), _fp16_bytes(d)], axis=-1)
    return blocks.reshape(data.shape[0], -1)


def encode(data: np.ndarray, qtype) -> np.ndarray:
    if qtype == T.Q4_K:
        return encode_q4_k(data)
    if qtype == T.Q6_K:
        return encode_q6_k(data)
    return gguf.quants.quantize(data, qtype)


MIXED = {  # layer 0 as Q4_K_M writes its layers (Q6_K v and down); layer 1 the 32-block types
    "blk.0.attn_q": T.Q4_K, "blk.0.attn_k": T.Q4_K, "blk.0.attn_v": T.Q6_K, "blk.0.attn_output": T.Q4_K,
    "blk.0.ffn_gate": T.Q4_K, "blk.0.ffn_up": T.Q4_K, "blk.0.ffn_down": T.Q6_K,
    "blk.1.attn_q": T.Q5_0, "blk.1.attn_k": T.Q5_0, "blk.1.attn_v": T.Q8_0, "blk.1.attn_output": T.Q4_1,
    "blk.1.ffn_gate": T.Q4_K, "blk.1.ffn_up": T.Q4_1, "blk.1.ffn_down": T.Q5_0, "output": T.Q6_K,
}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A Qwen2 model (K = 256 / 512, as the K-quants need) in every kept type, converted twice:
    kept quantized and dequantized in float32 (the reference)."""
    original = _tiny_model("qwen2", hidden_size=256, intermediate_size=512)
    folder = tmp_path_factory.mktemp("mixed")
    _write_gguf(original, folder / "mixed.gguf", "qwen2", pre="qwen2",
                linear_qtype=lambda name: MIXED.get(name.rsplit(".", 1)[0]), encode=encode)
    kept = gguf_convert.convert_gguf(folder / "mixed.gguf", folder / "kept", progress=False)
    plain = gguf_convert.convert_gguf(folder / "mixed.gguf", folder / "plain", progress=False, dtype=torch.float32,
                                      keep_quantized=False)
    return str(kept), str(plain)


def test_encoders_round_trip_through_ggufs_dequantizer():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (4, 512)).astype(np.float32)
    for qtype, tol in ((T.Q4_K, 0.02), (T.Q6_K, 0.004)):
        back = gguf.quants.dequantize(encode(w, qtype), qtype)
        assert back.shape == w.shape and np.abs(back - w).max() < tol


def test_every_kept_type_loads_with_ggufs_own_values(mixed):
    from safetensors.torch import load_file

    from specdec.layers.quantization import PartsLinear

    kept, plain = mixed
    model = LLM(model=kept, **ENGINE).engine.executor.driver_worker.runner.model
    reference = load_file(f"{plain}/model.safetensors")
    assert not any(type(m) is torch.nn.Linear for m in model.modules())  # every linear kept quantized
    l0, l1 = model.layers
    assert isinstance(l0.self_attn.qkv_proj, PartsLinear)  # Q4_K q, k + Q6_K v
    assert [type(p.quantized_weight()).__name__ for p in l0.self_attn.qkv_proj.parts] == ["Int4Weight"] * 2 + [
        "Int8Weight"]
    assert l0.mlp.down_proj.quantized_weight().group_size == 16  # Q6_K
    assert isinstance(l1.self_attn.qkv_proj, WeightOnlyLinear)  # Q5_0 + Q8_0: one int8 weight
    assert l1.mlp.gate_up_proj.int4 and not l1.mlp.down_proj.int4  # Q4_K + Q4_1 int4, Q5_0 int8
    fused = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
    for i, layer in enumerate(model.layers):
        for name, parts in [*fused.items(), ("self_attn.o_proj", None), ("mlp.down_proj", None)]:
            prefix = f"model.layers.{i}.{name.split('.')[0]}."
            expected = (torch.cat([reference[prefix + p + ".weight"] for p in parts]) if parts
                        else reference[f"model.layers.{i}.{name}.weight"])
            assert torch.equal(layer.get_submodule(name).dequantized_weight().float(), expected), (i, name)
    assert torch.equal(model.lm_head.dequantized_weight().float(), reference["lm_head.weight"])


def test_kept_quantized_decodes_the_tokens_of_the_float32_dequantized_model(mixed):
    kept, plain = mixed
    prompts = ["hello world", "the world", "fellow the"]
    assert greedy(LLM(model=kept, **ENGINE), prompts) == greedy(LLM(model=plain, **ENGINE), prompts)


def test_speculation_over_a_mixed_gguf_is_lossless(mixed):
    kept, _ = mixed
    llm = LLM(model=kept, **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompts = ["hello world hello world hello", "the world the world the"]
    assert greedy(llm, prompts) == greedy(llm, prompts, use_speculation=False)


def test_a_folder_in_the_old_format_is_refused_with_what_to_do(mixed, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from specdec.models.gguf_quant import WOQ_FILE, load_quantized_linears

    kept, _ = mixed
    old = tmp_path / "old"
    shutil.copytree(kept, old)
    save_file(load_file(str(old / WOQ_FILE)), str(old / WOQ_FILE), metadata={"format": "specdec-woq-1"})
    with pytest.raises(ValueError, match="delete the converted folder"):
        load_quantized_linears(old)


def test_w4a8_rounds_the_activations_over_the_files_own_weights(mixed):
    from specdec.layers.quantization import PartsLinear

    kept, _ = mixed
    plain_llm = LLM(model=kept, **ENGINE)
    llm = LLM(model=kept, quantization="w4a8", **ENGINE,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    model = llm.engine.executor.driver_worker.runner.model
    before = plain_llm.engine.executor.driver_worker.runner.model
    layers = [m for m in model.modules() if isinstance(m, WeightOnlyLinear)]
    assert layers and all(m.int8_activations for m in layers)  # Q6_K's groups of 16 included
    assert isinstance(model.layers[0].self_attn.qkv_proj, PartsLinear)
    for name in ("layers.0.self_attn.qkv_proj", "layers.1.mlp.down_proj", "lm_head"):  # the weights are the file's
        assert torch.equal(model.get_submodule(name).dequantized_weight(), before.get_submodule(name).dequantized_weight())
    prompts = ["hello world hello world hello", "the world the world the"]
    assert greedy(llm, prompts) == greedy(llm, prompts, use_speculation=False)
