"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k norm) with sparse
mixture-of-experts feed-forwards: softmax over ``num_experts``, the top ``num_experts_per_tok``,
renormalised when ``norm_topk_prob``. Layer i is sparse unless it is listed in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; those keep a dense MLP of
``intermediate_size``."""
from __future__ import annotations

from torch import nn

from specdec.layers.moe import Expert, SparseMoE, TopKRouter
from specdec.models.llama import _cfg
from specdec.models.qwen3 import Qwen3ForCausalLM


def sparse_layer(config, layer_idx: int) -> bool:
    num_experts = _cfg(config, "num_experts", 0)
    step = _cfg(config, "decoder_sparse_step", 1)
    return (layer_idx not in (_cfg(config, "mlp_only_layers", []) or []) and num_experts > 0
            and (layer_idx + 1) % step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_layer(self, config, layer_idx: int, qkv_bias: bool, attn_backend) -> nn.Module:
        layer = super().make_layer(config, layer_idx, qkv_bias, attn_backend)
        if sparse_layer(config, layer_idx):
            hidden, num_experts = config.hidden_size, config.num_experts
            router = TopKRouter(hidden, num_experts, config.num_experts_per_tok, softmax_first=True,
                                normalize=bool(_cfg(config, "norm_topk_prob", False)))
            layer.mlp = SparseMoE(router, [Expert(hidden, config.moe_intermediate_size) for _ in range(num_experts)])
        return layer
