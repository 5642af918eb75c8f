"""MXFP4 weights (OCP microscaling FP4, as gpt-oss publishes its experts), kept packed.

A row of K inputs is stored as K / 32 blocks; each block holds 32 FP4 (E2M1) values packed two
per byte (``blocks`` [N, K/32, 16] uint8, the even input in the low nibble) and one power-of-two
scale (``scales`` [N, K/32] uint8, E8M0: 2^(s - 127)). That is (16 + 1) bytes per 32 weights:
4.25 bits per weight in memory.

``Mxfp4Linear`` keeps the packed tensors and dequantises inside its matmul, a chunk of output
rows at a time (``ROWS_PER_CHUNK``), so no full-precision copy of the weight ever exists; the
temporary is bounded by the chunk. ``dequantize_mxfp4`` is the pure-torch reference (the
lookup table and ``ldexp`` transformers uses), ``quantize_mxfp4`` the inverse used to build
test checkpoints (round to the nearest FP4 value under the block's scale).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # weights per scale
ROWS_PER_CHUNK = 256  # output rows dequantised at once in Mxfp4Linear


def _byte_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 2]: the two FP4 values a byte holds (low nibble first)."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack([lut[byte & 0x0F], lut[byte >> 4]], dim=-1)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> weight [..., G * 32] in ``dtype``."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    values = _byte_table(torch.float32, blocks.device)[blocks.long()]  # [..., G, 16, 2]
    values = values.reshape(*scales.shape, BLOCK)
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents[..., None].float()).reshape(*scales.shape[:-1], -1).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., K] (K a multiple of 32) -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8):
    each block's scale the smallest power of two that brings its largest magnitude within 6, each
    value rounded to the nearest FP4 value."""
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs inputs in multiples of {BLOCK}, got {weight.shape[-1]}")
    w = weight.detach().float().reshape(*weight.shape[:-1], -1, BLOCK)  # [..., G, 32]
    amax = w.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = w / torch.ldexp(torch.ones_like(exponent), exponent)[..., None]
    magnitudes = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # [..., G, 32] in 0..7
    codes = codes + 8 * (scaled < 0)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent.to(torch.int32) + 127).to(torch.uint8)


class Mxfp4Linear(nn.Module):
    """``x @ dequant(blocks, scales).T + b`` with the weight kept packed (4.25 bits per weight)."""

    @classmethod
    def empty(cls, in_features: int, out_features: int, bias: bool) -> Mxfp4Linear:
        """Zero weights of this shape, to be loaded (on the default device)."""
        groups = in_features // BLOCK
        return cls(torch.zeros(out_features, groups, BLOCK // 2, dtype=torch.uint8),
                   torch.zeros(out_features, groups, dtype=torch.uint8), torch.zeros(out_features) if bias else None)

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features = blocks.shape[0]
        self.in_features = blocks.shape[1] * BLOCK
        # parameters (never trained) so that checkpoint loaders fill them by name like any weight
        self.blocks = nn.Parameter(blocks.contiguous(), requires_grad=False)  # [N, K/32, 16] uint8
        self.scales = nn.Parameter(scales.contiguous(), requires_grad=False)  # [N, K/32] uint8
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks, self.scales, dtype)

    def bits_per_weight(self) -> float:
        stored = sum(t.numel() * t.element_size() for t in (self.blocks, self.scales))
        return 8.0 * stored / (self.out_features * self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(*x.shape[:-1], self.out_features)
        for start in range(0, self.out_features, ROWS_PER_CHUNK):
            end = min(start + ROWS_PER_CHUNK, self.out_features)
            weight = dequantize_mxfp4(self.blocks[start:end], self.scales[start:end], x.dtype)
            out[..., start:end] = F.linear(x, weight)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"mxfp4, in={self.in_features}, out={self.out_features}"
