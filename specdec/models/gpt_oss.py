"""gpt-oss's mixture-of-experts feed-forward: router with a bias, top-k logits then a softmax over
them, experts with biases and the clamped SwiGLU (alpha 1.702, limit 7.0), expert weights as
published in MXFP4 (``*_blocks`` / ``*_scales``, kept packed: ``layers.mxfp4.Mxfp4Linear``) or as
float tensors (what transformers saves).

Checkpoint layout, per layer (E experts, hidden H, intermediate I):
``mlp.router.weight`` [E, H], ``mlp.router.bias`` [E];
MXFP4: ``mlp.experts.gate_up_proj_blocks`` [E, 2I, H/32, 16], ``..._scales`` [E, 2I, H/32],
``mlp.experts.down_proj_blocks`` [E, H, I/32, 16], ``..._scales`` [E, H, I/32];
float: ``mlp.experts.gate_up_proj`` [E, H, 2I], ``mlp.experts.down_proj`` [E, I, H];
biases ``mlp.experts.gate_up_proj_bias`` [E, 2I], ``mlp.experts.down_proj_bias`` [E, H].
gate_up's output rows interleave gate and up (gate even, up odd); they are reordered at load to
the gate-then-up halves ``Expert`` uses, which for MXFP4 is a permutation of whole packed rows.

The decoder around it (attention sinks, alternating sliding-window layers) needs the attention
backend's sink and window support; this module is the feed-forward the model class builds.
"""
from __future__ import annotations

import torch
from torch import nn

from specdec.layers.moe import ClampedSwiGLU, Expert, SparseMoE, TopKRouter
from specdec.layers.mxfp4 import Mxfp4Linear

EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias", "gate_up_proj_blocks",
                  "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


def gpt_oss_moe(config) -> SparseMoE:
    hidden, num_experts = config.hidden_size, config.num_local_experts
    router = TopKRouter(hidden, num_experts, config.num_experts_per_tok, softmax_first=False, normalize=False,
                        bias=True)
    activation = ClampedSwiGLU(float(getattr(config, "swiglu_alpha", 1.702)), float(getattr(config, "swiglu_limit", 7.0)))
    return SparseMoE(router, [Expert(hidden, config.intermediate_size, bias=True, activation=activation)
                              for _ in range(num_experts)])


def _gate_then_up(rows: int) -> torch.Tensor:
    """Row order taking interleaved gate/up rows (gate even) to gate rows then up rows."""
    return torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])


def install_experts(moe: SparseMoE, tensors: dict[str, torch.Tensor]) -> None:
    """Put one layer's ``mlp.experts.*`` tensors (names without that prefix: ``EXPERT_TENSORS``)
    into ``moe``'s experts: MXFP4 ones as ``Mxfp4Linear`` (packed), float ones into the linears."""
    unknown = set(tensors) - set(EXPERT_TENSORS)
    if unknown:
        raise ValueError(f"unexpected gpt-oss expert tensors {sorted(unknown)}")
    packed = "gate_up_proj_blocks" in tensors
    needed = (("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales") if packed
              else ("gate_up_proj", "down_proj")) + ("gate_up_proj_bias", "down_proj_bias")
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise ValueError(f"gpt-oss experts are missing {missing}")
    order = _gate_then_up(tensors["gate_up_proj_bias"].shape[-1])
    for e, expert in enumerate(moe.experts):
        gate_up_bias = tensors["gate_up_proj_bias"][e][order]
        down_bias = tensors["down_proj_bias"][e]
        if packed:
            expert.gate_up_proj = Mxfp4Linear(tensors["gate_up_proj_blocks"][e][order],
                                              tensors["gate_up_proj_scales"][e][order], gate_up_bias.float())
            expert.down_proj = Mxfp4Linear(tensors["down_proj_blocks"][e], tensors["down_proj_scales"][e],
                                           down_bias.float())
            continue
        _copy(expert.gate_up_proj, tensors["gate_up_proj"][e].T[order], gate_up_bias)
        _copy(expert.down_proj, tensors["down_proj"][e].T, down_bias)


def _copy(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor) -> None:
    if tuple(linear.weight.shape) != tuple(weight.shape):
        raise ValueError(f"gpt-oss expert weight {tuple(weight.shape)} does not match the config's "
                         f"{tuple(linear.weight.shape)}")
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
