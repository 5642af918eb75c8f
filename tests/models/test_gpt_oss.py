"""gpt-oss: token-identical to transformers in float32 on tiny random checkpoints: attention sinks,
sliding-window layers (window 8, outgrown) alternating with full ones, YaRN rotary, biased router
and experts with the clamped SwiGLU; expert weights float (as transformers saves them) or MXFP4
as published (``*_blocks`` / ``*_scales``, kept packed at 4.25 bits per weight). Logits, greedy
generation with prefix caching, and speculative decoding (draft model, n-gram)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from moe_parity import HFGreedy, check_greedy_mixed_batch, check_logits, check_speculative

from specdec import LLM
from specdec.layers.mxfp4 import Mxfp4Linear, dequantize_mxfp4, quantize_mxfp4

SHAPE = dict(arch="gpt_oss", num_layers=2, head_dim=16, intermediate_size=64, num_local_experts=8,
             num_experts_per_tok=2, sliding_window=8, initializer_range=0.05, router_scale=20.0,
             random_norms_and_biases=True)


def mxfp4_pair(src: str, float_dst: Path, packed_dst: Path) -> tuple[str, str]:
    """The checkpoint with MXFP4-representable experts twice: float (for transformers) and packed
    with ``quantization_config`` (as gpt-oss is published)."""
    from safetensors.torch import load_file, save_file

    for dst in (float_dst, packed_dst):
        shutil.copytree(src, dst, dirs_exist_ok=True)
    for file in Path(src).glob("*.safetensors"):
        weights = load_file(str(file))
        floats, packed = dict(weights), dict(weights)
        for name, w in weights.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out]
                blocks, scales = quantize_mxfp4(w.transpose(1, 2))  # rows = outputs, as published
                floats[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
                del packed[name]
                packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        save_file(floats, str(float_dst / file.name), metadata={"format": "pt"})
        save_file(packed, str(packed_dst / file.name), metadata={"format": "pt"})
    config = json.loads((packed_dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (packed_dst / "config.json").write_text(json.dumps(config))
    return str(float_dst), str(packed_dst)


@pytest.fixture(scope="module")
def gpt_oss(make_model, make_perturbed_copy, tmp_path_factory, tiny_tokenizer):
    target = make_model("gpt_oss", **SHAPE)
    draft = make_perturbed_copy(target, tmp_path_factory.mktemp("gpt_oss_draft"), scale=0.1, seed=3)
    return target, draft, HFGreedy(target), tiny_tokenizer


def test_logits_match_transformers(gpt_oss):
    target, _, hf, _ = gpt_oss
    check_logits(target, hf)


def test_greedy_mixed_batch_with_prefix_caching(gpt_oss):
    target, _, hf, tok = gpt_oss
    check_greedy_mixed_batch(target, hf, tok)


def test_speculative_greedy_matches_transformers(gpt_oss):
    target, draft, hf, tok = gpt_oss
    check_speculative(target, draft, hf, tok)


def test_mxfp4_experts_stay_packed_and_match_transformers(gpt_oss, tmp_path_factory, tiny_tokenizer):
    target, _, _, tok = gpt_oss
    float_path, packed_path = mxfp4_pair(target, tmp_path_factory.mktemp("gpt_oss_f"),
                                         tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    hf = HFGreedy(float_path)
    check_logits(packed_path, hf)
    check_greedy_mixed_batch(packed_path, hf, tok)
    llm = LLM(model=packed_path, dtype="float32", device="cpu", max_model_len=64)
    model = llm.engine.executor.driver_worker.runner.model
    linears = [e.gate_up_proj for e in model.layers[0].mlp.experts] + [e.down_proj for e in model.layers[1].mlp.experts]
    assert all(isinstance(m, Mxfp4Linear) and m.bits_per_weight() == 4.25 for m in linears)
    assert all(m.blocks.dtype == torch.uint8 for m in linears)


@pytest.mark.parametrize("packed", [False, True], ids=["float", "mxfp4"])
def test_two_tensor_parallel_ranks_equal_one(packed, gpt_oss, tmp_path_factory):
    """TP=2 (sinks split by head, each expert's width split, MXFP4 blocks whole, output biases
    added once): greedy tokens equal one device's."""
    from moe_parity import PROMPTS, greedy_params, token_ids

    target, _, _, tok = gpt_oss
    if packed:
        _, target = mxfp4_pair(target, tmp_path_factory.mktemp("gpt_oss_tp_f"), tmp_path_factory.mktemp("gpt_oss_tp_q"))
    prompts = [tok.encode(p) for p in PROMPTS]
    one = token_ids(LLM(model=target, dtype="float32", device="cpu", max_model_len=96), prompts, greedy_params())
    llm = LLM(model=target, dtype="float32", device="cpu", max_model_len=96, tensor_parallel_size=2)
    try:
        model = llm.engine.executor.driver_worker.runner.model
        assert model.layers[0].self_attn.sinks.shape == (2,)  # 4 heads / 2 ranks
        assert model.layers[0].mlp.moe.experts[0].intermediate_size == 32
        assert token_ids(llm, prompts, greedy_params()) == one
    finally:
        llm.engine.executor.shutdown()
