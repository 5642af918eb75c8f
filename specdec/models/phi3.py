"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``): the Llama decoder with its projections fused as
published (``qkv_proj``, ``gate_up_proj``: loaded whole), partial rotary when the config sets
``partial_rotary_factor``, and LongRoPE.

LongRoPE follows transformers: a request whose sequence is longer than
``original_max_position_embeddings`` rotates with the long factors, otherwise with the short
ones, both tables scaled by the attention factor. The choice is made per request from its length
in the step (on the device, so captured graphs make it too). transformers re-encodes a sequence
whose generation crosses the switch point; here the keys cached before the crossing keep the
short factors (as vLLM does), so such a request matches transformers only up to the crossing.
"""
from __future__ import annotations

import torch
from torch import nn

from specdec.layers.attention import AttentionBackend, AttentionMetadata
from specdec.models.llama import DecoderLayer, LlamaForCausalLM


def _partial_rotary_factor(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return float(factor or 1.0)


class Phi3ForCausalLM(LlamaForCausalLM):
    _stacked = ()  # the checkpoint's qkv_proj / gate_up_proj are already our fused modules

    def make_layer(self, config, layer_idx: int, qkv_bias: bool, attn_backend: AttentionBackend) -> nn.Module:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary_dim = int(head_dim * _partial_rotary_factor(config))
        return DecoderLayer(config, qkv_bias, False, attn_backend, rotary_dim=rotary_dim,
                            **self.attention_options(config, layer_idx))

    @property
    def rotary_dim(self) -> int:
        return self.layers[0].self_attn.rotary_dim

    def rope_rows(self, positions: torch.Tensor, meta: AttentionMetadata):
        switch = self.rotary.original_max_position
        if switch is None:
            return self.rotary.lookup(positions)
        rows = torch.arange(positions.shape[0], device=positions.device)
        request = torch.searchsorted(meta.query_start_loc[1:], rows, right=True).clamp_(max=meta.num_reqs - 1)
        return self.rotary.lookup(positions, long_rows=meta.seq_lens[request] > switch)

