"""Mixtral: the Mistral decoder with a sparse mixture of ``num_local_experts`` SwiGLU experts,
``num_experts_per_tok`` (2) chosen per token by a softmax router and renormalised. Published
checkpoints name the block ``block_sparse_moe`` and the expert matrices ``w1`` (gate), ``w3`` (up)
and ``w2`` (down); they are mapped to the Llama names at load. A ``sliding_window`` in the config
applies to every layer (the Llama decoder's per-layer attention options)."""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from specdec.layers.moe import Expert, SparseMoE, TopKRouter
from specdec.models.mistral import MistralForCausalLM

_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.(w[123])\.")


def hf_name(name: str) -> str:
    """A published Mixtral weight name -> the name ``LlamaForCausalLM.load_weights`` maps."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return _EXPERT_WEIGHT.sub(lambda m: f".experts.{m.group(1)}.{_EXPERT_NAMES[m.group(2)]}.", name)


class MixtralForCausalLM(MistralForCausalLM):
    def make_layer(self, config, layer_idx: int, qkv_bias: bool, attn_backend) -> nn.Module:
        layer = super().make_layer(config, layer_idx, qkv_bias, attn_backend)  # sliding window from the config
        hidden, num_experts = config.hidden_size, config.num_local_experts
        router = TopKRouter(hidden, num_experts, config.num_experts_per_tok, softmax_first=True, normalize=True)
        layer.mlp = SparseMoE(router, [Expert(hidden, config.intermediate_size) for _ in range(num_experts)])
        return layer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((hf_name(name), tensor) for name, tensor in weights)
