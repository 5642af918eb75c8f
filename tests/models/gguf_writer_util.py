"""A tiny ``qwen3moe`` GGUF written as llama.cpp's ``convert_hf_to_gguf.py`` writes one, without llama.cpp.

From a transformers ``Qwen3MoeForCausalLM``: the tensor names (gguf-py's ``TENSOR_NAMES``, the table
the converter maps with), the metadata keys of its ``Qwen3MoeModel`` / ``TextModel``
(``qwen3moe.block_count`` ... ``qwen3moe.expert_feed_forward_length``) and its layouts: each
layer's experts stacked as ``blk.<i>.ffn_{gate,up,down}_exps`` [E, N, K] (gate and up cut from
transformers' fused ``gate_up_proj``), norms and the router (``ffn_gate_inp``) in F32, no Q/K row
permutation (llama.cpp permutes Llama's only). Experts in Q8_0 (``gguf.quants.quantize``) or Q4_K
(``quantize_q4_k``: ``gguf.quants`` dequantizes Q4_K but has no quantizer for it), every other
matrix in F16. The tokenizer is a byte-level BPE (``tokenizer.ggml.model = "gpt2"``, tokens,
token types, merges, special ids), what transformers rebuilds a tokenizer from.

``write_qwen3moe_gguf`` returns every tensor as the file holds it, dequantized, under its
transformers name: loaded into transformers' own model, those are the oracle's weights.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import MODEL_TENSOR as T

EXPERT_TYPES = {"Q8_0": QType.Q8_0, "Q4_K": QType.Q4_K}
_FILE_TYPES = {"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M}
# transformers name inside ``model.layers.<i>.`` -> (llama.cpp tensor, stored in F32)
_LAYER_TENSORS = {
    "input_layernorm.weight": (T.ATTN_NORM, True),
    "self_attn.q_proj.weight": (T.ATTN_Q, False),
    "self_attn.k_proj.weight": (T.ATTN_K, False),
    "self_attn.v_proj.weight": (T.ATTN_V, False),
    "self_attn.o_proj.weight": (T.ATTN_OUT, False),
    "self_attn.q_norm.weight": (T.ATTN_Q_NORM, True),
    "self_attn.k_norm.weight": (T.ATTN_K_NORM, True),
    "post_attention_layernorm.weight": (T.FFN_NORM, True),
    "mlp.gate.weight": (T.FFN_GATE_INP, True),
}
_MODEL_TENSORS = {"model.embed_tokens.weight": (T.TOKEN_EMBD, False), "model.norm.weight": (T.OUTPUT_NORM, True),
                  "lm_head.weight": (T.OUTPUT, False)}


def _name(tensor: T, layer: int | None = None) -> str:
    return gguf.TENSOR_NAMES[tensor].format(bid=layer) + ".weight"


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K blocks of the rows of ``x`` [..., K] (K a multiple of 256) -> uint8 [..., K / 256 * 144].

    Per block of 256: fp16 ``d`` and ``dmin``, 8 sub-blocks of 32 with a 6-bit scale and min each
    (12 bytes, the bit layout ``gguf.quants.Q4_K.get_scale_min`` reads) and 4-bit codes, value =
    d sc q - dmin m. Each sub-block spans [-m, max]: min and scale from its range, rounded to the
    6-bit grids of the block's d / dmin (a plain range fit, not llama.cpp's search)."""
    shape = x.shape
    sub = x.astype(np.float32).reshape(-1, 8, 32)  # [blocks, sub-blocks, 32]
    mins = np.maximum(-sub.min(axis=-1), 0.0)  # [blocks, 8], value = scale q - min
    scales = (sub.max(axis=-1) + mins) / 15.0
    d = (scales.max(axis=-1) / 63.0).astype(np.float16)  # [blocks]
    dmin = (mins.max(axis=-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scales, df, out=np.zeros_like(scales), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(mins, dminf, out=np.zeros_like(mins), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]  # [blocks, 8, 1] the sub-block's effective scale
    offset = (dminf * mn)[..., None]
    q = np.clip(np.round(np.divide(sub + offset, step, out=np.zeros_like(sub), where=step > 0)), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),  # bytes 0-3: scales 0-3, top bits of scales 4-7
        mn[:, :4] | ((mn[:, 4:] >> 4) << 6),  # bytes 4-7: mins 0-3, top bits of mins 4-7
        (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),  # bytes 8-11: low bits of scales / mins 4-7
    ], axis=-1)
    codes = q.reshape(-1, 4, 2, 32)  # 32 bytes per pair of sub-blocks: the first in the low nibbles
    qs = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), packed_scales, qs], axis=-1)
    return blocks.reshape(*shape[:-1], shape[-1] // 256 * 144)


def _quantized(x: np.ndarray, qtype: QType) -> np.ndarray:
    return quantize_q4_k(x) if qtype == QType.Q4_K else gguf.quants.quantize(x, qtype)


def _tokenizer_metadata(writer: gguf.GGUFWriter, tokenizer, vocab_size: int) -> None:
    """What ``TextModel._set_vocab_gpt2`` writes: every id below ``vocab_size`` named (unused ones
    ``[PAD<i>]``), special tokens typed CONTROL, the merges and the special ids."""
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_ids)
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED if i not in by_id else gguf.TokenType.CONTROL if i in special
             else gguf.TokenType.NORMAL for i in range(vocab_size)]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)


def write_qwen3moe_gguf(model, tokenizer, path: str | Path, expert_type: str = "Q8_0") -> dict[str, torch.Tensor]:
    """Write ``model`` (a transformers ``Qwen3MoeForCausalLM``, untied, every layer sparse) as a
    ``qwen3moe`` GGUF at ``path``; -> {transformers name: the file's value, float32}."""
    config = model.config
    if config.tie_word_embeddings or getattr(config, "mlp_only_layers", None) or config.decoder_sparse_step != 1:
        raise ValueError("the writer takes untied Qwen3-MoE models whose every layer is sparse")
    qtype = EXPERT_TYPES[expert_type]
    params = {name: p.detach().float().numpy() for name, p in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3MOE])
    writer.add_name("tiny-qwen3moe")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_file_type(_FILE_TYPES[expert_type])
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _tokenizer_metadata(writer, tokenizer, config.vocab_size)

    values: dict[str, np.ndarray] = {}

    def add_float(hf_name: str, gguf_name: str, f32: bool) -> None:
        data = params.pop(hf_name).astype(np.float32 if f32 else np.float16)
        writer.add_tensor(gguf_name, data)
        values[hf_name] = data.astype(np.float32)

    def add_experts(hf_name: str, gguf_name: str, data: np.ndarray) -> np.ndarray:  # data [E, N, K]
        blocks = _quantized(data, qtype)
        writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
        return gguf.quants.dequantize(blocks, qtype)

    for hf_name, (tensor, f32) in _MODEL_TENSORS.items():
        add_float(hf_name, _name(tensor), f32)
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for hf_name, (tensor, f32) in _LAYER_TENSORS.items():
            add_float(prefix + hf_name, _name(tensor, i), f32)
        gate_up = params.pop(prefix + "mlp.experts.gate_up_proj")  # [E, 2I, H], gate rows first
        inter = gate_up.shape[1] // 2
        gate = add_experts(prefix + "gate", _name(T.FFN_GATE_EXP, i), np.ascontiguousarray(gate_up[:, :inter]))
        up = add_experts(prefix + "up", _name(T.FFN_UP_EXP, i), np.ascontiguousarray(gate_up[:, inter:]))
        values[prefix + "mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
        values[prefix + "mlp.experts.down_proj"] = add_experts(
            prefix + "down", _name(T.FFN_DOWN_EXP, i), params.pop(prefix + "mlp.experts.down_proj"))
    if params:
        raise ValueError(f"weights the writer does not map: {sorted(params)[:5]}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {name: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for name, v in values.items()}
