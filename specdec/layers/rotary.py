"""Rotary position embedding (neox / Hugging Face "rotate_half" layout) with rope scaling."""
from __future__ import annotations

import math

import torch
from torch import nn

from specdec.kernels import cpu_ops


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = head_dim, max_position, theta, scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the float32 cos/sin tables, e.g. after building the model on the meta device."""
        device = self.cos.device if self.cos.device.type != "meta" else None
        inv_freq = compute_inv_freq(self.head_dim, self.theta, self.scaling)
        t = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        self.cos, self.sin = freqs.cos().to(device), freqs.sin().to(device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin rows for a step's positions, [T, 1, D/2] float32: gathered once per forward
        and shared by every layer (one table serves the whole model)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by the [T, 1, D/2] tables of ``RotaryEmbedding.lookup``
    (float32 on CPU: one fused op, ``specdec.kernels.cpu_ops``; else ``rotate_reference``)."""
    if x.dim() == 3 and x.stride(-1) == 1 and cpu_ops.usable(x, cos, sin) and cos.is_contiguous() \
            and sin.is_contiguous():
        return cpu_ops.extension().rotate(x, cos, sin)
    return rotate_reference(x, cos, sin)


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
