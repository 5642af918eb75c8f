"""gpt-oss (``GptOssForCausalLM``): the Llama decoder with attention sinks (a learned logit per
head in every softmax), sliding-window layers alternating with full ones (``layer_types``), QKV
and output biases, YaRN rotary (from ``rope_parameters``) and a mixture-of-experts feed-forward:
router with a bias, the top-k logits then a softmax over them, experts with biases and the
clamped SwiGLU (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7.0).

Expert weights come stacked per layer (E experts, hidden H, intermediate I):
MXFP4 as published (``quantization_config.quant_method == "mxfp4"``): ``mlp.experts.gate_up_proj_blocks``
[E, 2I, H/32, 16], ``..._scales`` [E, 2I, H/32], ``mlp.experts.down_proj_blocks`` [E, H, I/32, 16],
``..._scales`` [E, H, I/32], kept packed in ``Mxfp4Linear`` (4.25 bits per weight); or float as
transformers saves them: ``mlp.experts.gate_up_proj`` [E, H, 2I], ``mlp.experts.down_proj`` [E, I, H];
biases ``gate_up_proj_bias`` [E, 2I], ``down_proj_bias`` [E, H]. gate_up's outputs interleave gate
(even) and up (odd); ``expert_weights`` splits each stacked tensor into per-expert gate / up /
down tensors with the Llama names, which the Llama loader fuses into gate-then-up halves (for
MXFP4 a selection of whole packed rows). The router is ``mlp.router`` in the checkpoint, ``mlp.gate``
here. The harmony chat format is the checkpoint's chat template.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from specdec.layers.moe import ClampedSwiGLU, Expert, SparseMoE, TopKRouter
from specdec.layers.mxfp4 import Mxfp4Linear
from specdec.models.llama import LlamaForCausalLM

_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_blocks|_scales|_bias|)$")


def mxfp4_experts(config) -> bool:
    quant = getattr(config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return method == "mxfp4"


def gpt_oss_moe(config, packed: bool = False) -> SparseMoE:
    hidden, inter, num_experts = config.hidden_size, config.intermediate_size, config.num_local_experts
    router = TopKRouter(hidden, num_experts, config.num_experts_per_tok, softmax_first=False, normalize=False,
                        bias=True)
    activation = ClampedSwiGLU(float(getattr(config, "swiglu_alpha", 1.702)),
                               float(getattr(config, "swiglu_limit", 7.0)))
    experts = [Expert(hidden, inter, bias=True, activation=activation) for _ in range(num_experts)]
    if packed:
        for expert in experts:
            expert.gate_up_proj = Mxfp4Linear.empty(hidden, 2 * inter, bias=True)
            expert.down_proj = Mxfp4Linear.empty(inter, hidden, bias=True)
    return SparseMoE(router, experts)


def expert_weights(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint tensor -> (name, tensor) pairs in the Llama loader's per-expert names
    (``...experts.<e>.gate_proj.weight`` / ``.blocks`` / ``.scales`` / ``.bias``, ``up_proj``,
    ``down_proj``); the router renamed; anything else unchanged."""
    match = _STACKED.match(name)
    if match is None:
        yield name.replace(".mlp.router.", ".mlp.gate."), tensor
        return
    prefix, proj, suffix = match.groups()
    field = {"_blocks": "blocks", "_scales": "scales", "_bias": "bias", "": "weight"}[suffix]
    for e in range(tensor.shape[0]):
        t = tensor[e]
        if suffix == "":  # float weights are stored transposed: [in, out]
            t = t.T
        if proj == "down_proj":
            yield f"{prefix}.{e}.down_proj.{field}", t
        else:  # rows (outputs) interleave gate and up
            yield f"{prefix}.{e}.gate_proj.{field}", t[0::2]
            yield f"{prefix}.{e}.up_proj.{field}", t[1::2]


class GptOssForCausalLM(LlamaForCausalLM):
    qkv_bias = True

    def attention_options(self, config, layer_idx: int) -> dict:
        return {**super().attention_options(config, layer_idx), "sinks": True}

    def make_layer(self, config, layer_idx: int, qkv_bias: bool, attn_backend) -> nn.Module:
        layer = super().make_layer(config, layer_idx, qkv_bias, attn_backend)
        layer.mlp = gpt_oss_moe(config, packed=mxfp4_experts(config))
        return layer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(pair for name, tensor in weights for pair in expert_weights(name, tensor))
