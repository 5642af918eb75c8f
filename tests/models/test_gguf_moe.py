"""GGUF mixture-of-experts files as llama.cpp writes them: a tiny random Qwen3-MoE built by
transformers, converted by llama.cpp's own ``convert_hf_to_gguf.py`` (Q8_0) and ``llama-quantize``
(Q4_K_M). The stacked ``ffn_*_exps`` tensors load as one kept-quantized linear per expert with the
file's exact values, and decode, in float32, the greedy tokens of transformers' own model on the
dequantized weights; speculation over them equals plain decoding.

Needs llama.cpp's source (``scripts/build_llama_cpp.sh``; Q4_K_M also its ``llama-quantize``) and
the SmolLM2 tokenizer folder (``specdec models pull``): skipped without them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from moe_decode_util import (ENGINE, assert_w4a8_ngram_lossless, greedy, greedy_counting_experts,  # noqa: E402
                             model_of, transformers_greedy)

from specdec import LLM  # noqa: E402
from specdec.bench.peers.llama_cpp import find_bin_dir, peers_dir, source_dir  # noqa: E402
from specdec.layers.moe import SparseMoE  # noqa: E402
from specdec.layers.quantization import WeightOnlyLinear  # noqa: E402
from specdec.models import gguf_convert  # noqa: E402
from specdec.models.hub import cache_dir  # noqa: E402

TOKENIZER = cache_dir() / "models" / "SmolLM2-135M-Instruct"
BIN_DIR = find_bin_dir()[0]
SOURCE = source_dir(BIN_DIR) or (peers_dir() / "llama.cpp" if (peers_dir() / "llama.cpp" / "convert_hf_to_gguf.py").is_file()
                                 else None)
NUM_EXPERTS, TOP_K = 8, 2

pytestmark = [pytest.mark.skipif(SOURCE is None, reason="llama.cpp source (convert_hf_to_gguf.py) not built"),
              pytest.mark.skipif(not (TOKENIZER / "tokenizer.json").is_file(), reason="SmolLM2 tokenizer not pulled")]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> Path:
    """Qwen3-MoE: 2 layers, hidden 256 and experts of 256 (the K-quants' 256-blocks), top-2 of 8,
    routers scaled so rows pick different experts."""
    from transformers import AutoTokenizer

    from specdec.models.tiny import make_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    return make_tiny_model(tmp_path_factory.mktemp("moe_hf"), arch="qwen3_moe", vocab_size=len(tokenizer),
                           hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                           intermediate_size=512, tokenizer=tokenizer, num_experts=NUM_EXPERTS,
                           num_experts_per_tok=TOP_K, moe_intermediate_size=256, norm_topk_prob=True,
                           router_scale=20.0, initializer_range=0.05, random_norms_and_biases=True)


def llama_cpp_gguf(checkpoint: Path, out: Path, qtype: str) -> Path:
    """``checkpoint`` as llama.cpp converts it: Q8_0 by the converter, Q4_K_M by llama-quantize."""
    convert = [sys.executable, str(SOURCE / "convert_hf_to_gguf.py"), str(checkpoint)]
    if qtype == "Q8_0":
        subprocess.run([*convert, "--outtype", "q8_0", "--outfile", str(out)], check=True, capture_output=True)
        return out
    f32 = out.with_suffix(".f32.gguf")
    subprocess.run([*convert, "--outtype", "f32", "--outfile", str(f32)], check=True, capture_output=True)
    subprocess.run([str(BIN_DIR / "llama-quantize"), str(f32), str(out), qtype, "2"], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module", params=["Q8_0", "Q4_K_M"])
def converted(request, moe_checkpoint, tmp_path_factory):
    """(the GGUF, its folder kept quantized, its folder dequantized in float32)."""
    qtype = request.param
    if qtype == "Q4_K_M" and (BIN_DIR is None or not (BIN_DIR / "llama-quantize").is_file()):
        pytest.skip("llama-quantize not built")
    folder = tmp_path_factory.mktemp(f"moe_{qtype}")
    path = llama_cpp_gguf(moe_checkpoint, folder / f"moe-{qtype}.gguf", qtype)
    kept = gguf_convert.convert_gguf(path, folder / "kept", progress=False, dtype=torch.float32)
    plain = gguf_convert.convert_gguf(path, folder / "plain", progress=False, dtype=torch.float32,
                                      keep_quantized=False)
    return path, str(kept), str(plain)


def test_experts_stay_quantized_with_the_files_exact_values(converted):
    path, kept, _ = converted
    model = model_of(LLM(model=kept, **ENGINE))
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    types = set()
    for i, layer in enumerate(model.layers):
        assert isinstance(layer.mlp, SparseMoE) and len(layer.mlp.experts) == NUM_EXPERTS
        router = tensors[f"blk.{i}.ffn_gate_inp.weight"]
        router_weight = np.array(gguf.quants.dequantize(router.data, router.tensor_type))  # a writable copy
        assert torch.equal(layer.mlp.gate.weight, torch.from_numpy(router_weight))
        stacked = {}
        for part in ("gate", "up", "down"):
            t = tensors[f"blk.{i}.ffn_{part}_exps.weight"]
            types.add(t.tensor_type.name)
            stacked[part] = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))  # [E, N, K]
        for e, expert in enumerate(layer.mlp.experts):
            assert isinstance(expert.gate_up_proj, WeightOnlyLinear) and isinstance(expert.down_proj, WeightOnlyLinear)
            assert torch.equal(expert.gate_up_proj.dequantized_weight(), torch.cat([stacked["gate"][e], stacked["up"][e]]))
            assert torch.equal(expert.down_proj.dequantized_weight(), stacked["down"][e])
    assert types == ({"Q8_0"} if "Q8_0" in path.name else {"Q4_K", "Q6_K"})  # Q4_K_M gives some down_exps Q6_K
    from safetensors import safe_open

    with safe_open(f"{kept}/model.safetensors", framework="pt") as f:  # no float copy of any expert
        assert not [name for name in f.keys() if ".experts." in name]


PROMPTS = [[5, 17, 99, 200, 3, 42, 7], [1000, 2000, 3000], list(range(40, 70))]


def test_decodes_the_tokens_of_transformers_on_the_dequantized_weights(converted):
    from transformers import AutoModelForCausalLM

    _, kept, plain = converted
    llm = LLM(model=kept, **ENGINE)
    ours, experts_read = greedy_counting_experts(llm, PROMPTS)
    assert experts_read > TOP_K  # rows route apart
    reference = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    assert ours == transformers_greedy(reference, PROMPTS)


def test_speculation_over_a_moe_gguf_is_lossless(converted):
    _, kept, _ = converted
    llm = LLM(model=kept, **ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9]]
    assert greedy(llm, prompts) == greedy(llm, prompts, use_speculation=False)


def test_w4a8_over_the_files_experts_is_lossless_too(converted):
    _, kept, _ = converted
    assert_w4a8_ngram_lossless(kept, [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9]])


def test_a_mixtral_style_llama_gguf_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "mixtral.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_expert_count(8)
    writer.add_expert_used_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="llama.expert_count = 8.*safetensors"):
        gguf_convert.convert_gguf(path, tmp_path / "out", progress=False)
