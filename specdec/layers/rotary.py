"""Rotary position embedding (neox / Hugging Face "rotate_half" layout) with rope scaling.

LongRoPE (Phi-3 ``rope_type`` "longrope"): two tables, the short factors' for a request whose
sequence fits ``original_max_position_embeddings`` and the long factors' beyond it, both scaled by
the attention factor (sqrt(1 + ln(factor) / ln(original)) unless the config gives one), as
transformers computes them; ``lookup`` takes which rows use the long table. YaRN (gpt-oss,
DeepSeek): frequencies blended between interpolation and extrapolation over the correction
range of ``beta_fast`` / ``beta_slow``, tables scaled by its attention factor (0.1 ln(factor) + 1,
or the ``mscale`` / ``mscale_all_dim`` ratio), as transformers computes them.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from specdec.kernels.cpu import cpu_ops


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


def _yarn_factor(scaling: dict, max_position: int | None) -> float:
    factor = scaling.get("factor")
    return float(factor) if factor is not None else max_position / scaling["original_max_position_embeddings"]


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict, max_position: int | None) -> torch.Tensor:
    factor = _yarn_factor(scaling, max_position)
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:  # the dimension that turns num_rotations times
        return head_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    extrapolation = 1 - ramp  # weight of the unscaled frequencies
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: dict | None, max_position: int) -> float:
    """What the cos / sin tables are multiplied by (1 but for LongRoPE and YaRN)."""
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "longrope":
        return longrope_attention_factor(scaling, max_position)
    if rope_type != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, max_position)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def compute_inv_freq(head_dim: int, theta: float, scaling: dict | None, max_position: int | None = None
                     ) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "longrope":
        return longrope_inv_freq(head_dim, theta, scaling, long=False)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, max_position)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3, "
                     f"longrope, yarn)")


def longrope_inv_freq(head_dim: int, theta: float, scaling: dict, long: bool) -> torch.Tensor:
    factors = scaling["long_factor" if long else "short_factor"]
    if len(factors) != head_dim // 2:
        raise ValueError(f"rope_scaling {'long' if long else 'short'}_factor has {len(factors)} entries, the rotary "
                         f"dimension {head_dim} needs {head_dim // 2}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)


def longrope_attention_factor(scaling: dict, max_position: int) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        """``head_dim``: the rotated dimensions (all of a head, or its first part with partial rotary)."""
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = head_dim, max_position, theta, scaling
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        # LongRoPE's switch point, None for one table
        self.original_max_position = scaling["original_max_position_embeddings"] if rope_type == "longrope" else None
        for name in ("cos", "sin", "cos_long", "sin_long"):
            self.register_buffer(name, torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the float32 cos/sin tables, e.g. after building the model on the meta device."""
        device = self.cos.device if self.cos.device.type != "meta" else None
        t = torch.arange(self.max_position, dtype=torch.float32)

        def tables(inv_freq: torch.Tensor, mscale: float = 1.0):
            freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
            return (freqs.cos() * mscale).to(device), (freqs.sin() * mscale).to(device)

        mscale = attention_factor(self.scaling, self.max_position)
        if self.original_max_position is None:
            self.cos, self.sin = tables(compute_inv_freq(self.head_dim, self.theta, self.scaling, self.max_position),
                                        mscale)
            return
        self.cos, self.sin = tables(longrope_inv_freq(self.head_dim, self.theta, self.scaling, False), mscale)
        self.cos_long, self.sin_long = tables(longrope_inv_freq(self.head_dim, self.theta, self.scaling, True), mscale)

    def lookup(self, positions: torch.Tensor, long_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin rows for a step's positions, [T, 1, D/2] float32: gathered once per forward
        and shared by every layer (one table serves the whole model). ``long_rows`` [T] bool: the
        rows that read LongRoPE's long table."""
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        if long_rows is not None and self.original_max_position is not None:
            long = long_rows.view(-1, 1, 1)
            cos = torch.where(long, self.cos_long[positions].unsqueeze(1), cos)
            sin = torch.where(long, self.sin_long[positions].unsqueeze(1), sin)
        return cos, sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by the [T, 1, D/2] tables of ``RotaryEmbedding.lookup``
    (float32 on CPU: one fused op, ``specdec.kernels.cpu.cpu_ops``; else ``rotate_reference``)."""
    if x.dim() == 3 and x.stride(-1) == 1 and cpu_ops.usable(x, cos, sin) and cos.is_contiguous() \
            and sin.is_contiguous():
        return cpu_ops.extension().rotate(x, cos, sin)
    return rotate_reference(x, cos, sin)


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
