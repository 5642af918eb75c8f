"""Gemma 3, text only (``Gemma3ForCausalLM``, config ``gemma3_text``).

The Llama decoder with Gemma's differences, all read from the config: sliding-window layers
interleaved with global ones (``layer_types``, from ``sliding_window_pattern`` in older configs),
each kind with its own rotary base (``rope_parameters["sliding_attention"]`` /
``["full_attention"]``, the old ``rope_local_base_freq`` / ``rope_theta``); q/k RMSNorm; scores
scaled by ``query_pre_attn_scalar ** -0.5``; GeGLU (tanh-approximated GELU); embeddings scaled by
sqrt(hidden) rounded to the model dtype; (1 + w) RMSNorms, with norms after attention and
around the MLP; final logit soft-capping when the config sets it. ``attn_logit_softcapping`` is
not applied: transformers' Gemma 3 attention ignores it (the q/k norms took its place; published
configs set it to null), and transformers is the reference this model matches.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.layers.attention import REFERENCE_BACKEND, AttentionBackend, AttentionMetadata
from specdec.layers.norm import GemmaRMSNorm
from specdec.layers.rotary import RotaryEmbedding
from specdec.models.llama import Attention, LlamaForCausalLM, _cfg, layer_sliding_window


def _layer_rope(config, layer_type: str) -> tuple[float, dict | None]:
    """(theta, scaling or None) of one layer kind."""
    params = (getattr(config, "rope_parameters", None) or {}).get(layer_type) or {}
    default = 10_000.0 if layer_type == "sliding_attention" else 1_000_000.0
    theta = float(params.get("rope_theta", default))
    return theta, None if params.get("rope_type", "default") == "default" else dict(params)


class GeGLU(nn.Module):
    def __init__(self, config):
        super().__init__()
        act = _cfg(config, "hidden_activation", None) or _cfg(config, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported for Gemma 3 (only gelu_pytorch_tanh)")
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, attn_backend: AttentionBackend, layer_idx: int):
        super().__init__()
        eps = _cfg(config, "rms_norm_eps", 1e-6)
        sliding_window = layer_sliding_window(config, layer_idx)
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"  # also picks the local rotary
        self.self_attn = Attention(
            config, bool(_cfg(config, "attention_bias", False)), True, attn_backend, sliding_window=sliding_window,
            scale=config.query_pre_attn_scalar**-0.5, norm_class=GemmaRMSNorm)
        self.mlp = GeGLU(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, rope, hidden: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    norm_class = GemmaRMSNorm

    def __init__(self, config, attn_backend: AttentionBackend = REFERENCE_BACKEND):
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention (an encoder) is not a causal LM")
        super().__init__(config, attn_backend)
        theta, scaling = _layer_rope(config, "full_attention")
        self.rotary = RotaryEmbedding(self.head_dim, config.max_position_embeddings, theta, scaling)
        theta, scaling = _layer_rope(config, "sliding_attention")
        self.rotary_local = RotaryEmbedding(self.head_dim, config.max_position_embeddings, theta, scaling)
        self.final_logit_softcapping = _cfg(config, "final_logit_softcapping", None)

    def make_layer(self, config, layer_idx: int, qkv_bias: bool, attn_backend: AttentionBackend) -> nn.Module:
        return Gemma3DecoderLayer(config, attn_backend, layer_idx)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                aux_layers: tuple[int, ...] = ()):
        """As ``LlamaForCausalLM.forward``."""
        hidden = self.embed_tokens(input_ids)  # [T, H]
        # sqrt(hidden) rounded to the model dtype first, as the checkpoints were trained
        hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(hidden.dtype)
        rope_global, rope_local = self.rotary.lookup(positions), self.rotary_local.lookup(positions)
        collected: dict[int, torch.Tensor] = {}
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if i in aux_layers:
                collected[i] = hidden
            hidden = layer(rope_local if layer.is_sliding else rope_global, hidden, kv_cache, meta)
        hidden = self.norm(hidden)
        if not aux_layers:
            return hidden
        return hidden, torch.cat([collected[i] for i in aux_layers], dim=-1)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.final_logit_softcapping is None:
            return super().compute_logits(hidden, out)
        cap = self.final_logit_softcapping
        logits = torch.tanh(self.lm_head(hidden) / cap) * cap
        return logits.float() if out is None else out.copy_(logits)
