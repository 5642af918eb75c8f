"""GGUF mixture-of-experts loading without llama.cpp: a tiny random Qwen3-MoE built by transformers,
written as a ``qwen3moe`` GGUF by ``gguf_writer_util`` (llama.cpp's tensor names, metadata and
layouts; experts in Q8_0 or Q4_K, the rest F32 / F16). The stacked ``ffn_*_exps`` tensors load as
one kept-quantized linear per expert holding the file's exact values; greedy decoding (float32)
equals transformers' own model loaded with the file's dequantized values; speculation over the
file equals plain decoding. ``test_gguf_moe.py`` checks the same on files llama.cpp converts,
where llama.cpp is built."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_writer_util import EXPERT_TYPES, quantize_q4_k, write_qwen3moe_gguf
from moe_decode_util import (ENGINE, assert_w4a8_ngram_lossless, greedy, greedy_counting_experts, model_of,
                             transformers_greedy)

from specdec import LLM
from specdec.layers.moe import SparseMoE
from specdec.layers.quantization import WeightOnlyLinear
from specdec.models import gguf_convert

NUM_EXPERTS, TOP_K = 16, 4
PROMPTS = [[5, 17, 99, 200, 3, 42, 7], [100, 200, 300], list(range(40, 70))]


@pytest.fixture(scope="module")
def hf_moe(make_model):
    """Qwen3-MoE: 2 layers, hidden 256 and experts of 256 (the K-quants' 256-blocks), top-4 of 16,
    routers scaled so rows pick different experts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_model("gguf_written_moe", arch="qwen3_moe", hidden_size=256, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, intermediate_size=512, num_experts=NUM_EXPERTS,
                      num_experts_per_tok=TOP_K, moe_intermediate_size=256, norm_topk_prob=True,
                      router_scale=20.0, initializer_range=0.05, random_norms_and_biases=True)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module", params=sorted(EXPERT_TYPES))
def written(request, hf_moe, tmp_path_factory):
    """(the GGUF, its folder converted with experts kept quantized, the file's values by transformers name)."""
    model, tokenizer = hf_moe
    folder = tmp_path_factory.mktemp(f"written_{request.param}")
    path = folder / f"moe-{request.param}.gguf"
    values = write_qwen3moe_gguf(model, tokenizer, path, request.param)
    kept = gguf_convert.convert_gguf(path, folder / "kept", progress=False, dtype=torch.float32)
    return path, str(kept), values


def test_q4_k_blocks_dequantize_near_their_source():
    """The writer's Q4_K packing is what ``gguf`` decodes: within a code step of the source (a
    sub-block's step is at most its range / 15, plus the 6-bit scale rounding)."""
    x = np.random.default_rng(0).normal(size=(6, 512)).astype(np.float32)
    blocks = quantize_q4_k(x)
    assert blocks.shape == (6, 2 * 144) and blocks.dtype == np.uint8
    back = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K)
    ranges = np.ptp(x.reshape(6, -1, 32), axis=-1)
    assert np.all(np.abs(back - x).reshape(6, -1, 32).max(-1) <= ranges / 15 * 0.75)
    assert np.abs(back - x).mean() < np.abs(x).mean() / 10


def test_experts_stay_quantized_with_the_files_exact_values(written):
    path, kept, values = written
    model = model_of(LLM(model=kept, **ENGINE))
    reader = gguf.GGUFReader(str(path))
    types = {t.tensor_type.name for t in reader.tensors if "_exps" in t.name}
    assert types == {path.stem.split("-")[1]}
    for i, layer in enumerate(model.layers):
        assert isinstance(layer.mlp, SparseMoE) and len(layer.mlp.experts) == NUM_EXPERTS
        prefix = f"model.layers.{i}.mlp."
        assert torch.equal(layer.mlp.gate.weight, values[prefix + "gate.weight"])
        gate_up, down = values[prefix + "experts.gate_up_proj"], values[prefix + "experts.down_proj"]
        for e, expert in enumerate(layer.mlp.experts):
            assert isinstance(expert.gate_up_proj, WeightOnlyLinear) and isinstance(expert.down_proj, WeightOnlyLinear)
            assert torch.equal(expert.gate_up_proj.dequantized_weight(), gate_up[e])
            assert torch.equal(expert.down_proj.dequantized_weight(), down[e])
        assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(
            [values[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"]))
    from safetensors import safe_open

    with safe_open(f"{kept}/model.safetensors", framework="pt") as f:  # no float copy of any expert
        assert not [name for name in f.keys() if ".experts." in name]


def test_decodes_the_tokens_of_transformers_on_the_files_values(written, hf_moe):
    from transformers import Qwen3MoeForCausalLM

    _, kept, values = written
    llm = LLM(model=kept, **ENGINE)
    ours, experts_read = greedy_counting_experts(llm, PROMPTS)
    assert experts_read > TOP_K  # rows route apart
    reference = Qwen3MoeForCausalLM(hf_moe[0].config).eval()
    reference.load_state_dict(values, strict=True)
    assert ours == transformers_greedy(reference, PROMPTS)


def test_speculation_over_the_written_file_is_lossless(written):
    _, kept, _ = written
    llm = LLM(model=kept, **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9], PROMPTS[2]]
    assert greedy(llm, prompts) == greedy(llm, prompts, use_speculation=False)
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_w4a8_over_the_written_experts_is_lossless_too(written):
    _, kept, _ = written
    assert_w4a8_ngram_lossless(kept, [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9], PROMPTS[2]])
