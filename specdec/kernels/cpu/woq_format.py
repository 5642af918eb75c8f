"""Quantized weight formats (int8, int4) and the reference of the linear computed with them.

Both keep the weight in its ``[N, K]`` (out, in) orientation with scales per group of
``group_size`` consecutive inputs of one output row (``group_size == K``: per output channel):

- ``Int8Weight``: ``w[n, k] = qweight[n, k] * scales[n, k // G]`` (symmetric, int8). GGUF Q8_0
  is this format with G = 32.
- ``Int4Weight``: ``w[n, k] = q[n, k] * scales[n, k // G] + offsets[n, k // G]`` with q in 0..15
  two to a byte in GGUF Q4_0's nibble order: in each block of 32 inputs, byte j holds input j in
  its low nibble and input j + 16 in its high nibble. GGUF Q4_0 is this format with G = 32 and
  offsets -8 d, Q4_1 and Q4_K (per 32-input sub-block: d * sc and -dmin * m) with G = 32 after
  reordering Q4_K's nibbles; ``quantize_int4`` picks per-group min/max scales and integer zero
  points z (asymmetric: offsets -z * scale).

``reference_linear`` (dequantize, then ``F.linear`` in float32) is the definition every fast
kernel is tested against: weight-only, the activations stay exact. (Rounding them to int8 too, as
llama.cpp's dot products do, makes a layer a step function of its input, so the last-ulp
differences between a K+1-row verification and a one-row decode elsewhere in the model would flip
roundings and greedy speculation would drift from greedy decoding.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BLOCK = 32  # the nibble-order block; int4 group sizes are multiples of it


@dataclass
class Int8Weight:
    qweight: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K // G] float32

    @property
    def group_size(self) -> int:
        return self.qweight.shape[1] // self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + 4 * self.scales.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.qweight.shape
        exact = torch.float64 if dtype == torch.float64 else torch.float32
        w = self.qweight.to(exact).view(n, -1, self.group_size) * self.scales.to(exact)[:, :, None]
        return w.view(n, k).to(dtype)


@dataclass
class Int4Weight:
    packed: torch.Tensor  # [N, K // 2] uint8, Q4_0 nibble order
    scales: torch.Tensor  # [N, K // G] float32
    offsets: torch.Tensor  # [N, K // G] float32: the weight where q = 0

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], 2 * self.packed.shape[1]

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 8 * self.scales.numel()

    def unpacked(self) -> torch.Tensor:
        """[N, K] uint8 values 0..15 in input order."""
        n, k = self.shape
        blocks = self.packed.view(n, k // BLOCK, BLOCK // 2)
        return torch.cat([blocks & 0xF, blocks >> 4], dim=-1).view(n, k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        exact = torch.float64 if dtype == torch.float64 else torch.float32
        q = self.unpacked().to(exact).view(n, -1, self.group_size)
        w = q * self.scales.to(exact)[:, :, None] + self.offsets.to(exact)[:, :, None]
        return w.view(n, k).to(dtype)


def _check_groups(k: int, group_size: int, multiple: int) -> None:
    if group_size <= 0 or k % group_size or group_size % multiple:
        raise ValueError(f"group_size {group_size} must divide in_features {k} and be a multiple of {multiple}")


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> Int8Weight:
    """Symmetric int8, one scale per ``group_size`` inputs (None: per output channel)."""
    n, k = w.shape
    g = k if group_size is None else group_size
    _check_groups(k, g, 1)
    groups = w.detach().float().reshape(n, k // g, g)
    scales = (groups.abs().amax(dim=-1) / 127.0).clamp(min=1e-12)
    q = torch.round(groups / scales[:, :, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.view(n, k).contiguous(), scales.contiguous())


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K // 2] uint8 in Q4_0 nibble order."""
    n, k = q.shape
    blocks = q.to(torch.uint8).view(n, k // BLOCK, BLOCK)
    return (blocks[..., : BLOCK // 2] | (blocks[..., BLOCK // 2:] << 4)).reshape(n, k // 2).contiguous()


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> Int4Weight:
    """Asymmetric int4 per group: scale (max - min) / 15, zero point round(-min / scale)."""
    n, k = w.shape
    _check_groups(k, group_size, BLOCK)
    groups = w.detach().float().reshape(n, k // group_size, group_size)
    lo = groups.amin(dim=-1).clamp(max=0.0)
    hi = groups.amax(dim=-1).clamp(min=0.0)
    scales = ((hi - lo) / 15.0).clamp(min=1e-12)
    zeros = torch.round(-lo / scales).clamp(0, 15)
    q = torch.round(groups / scales[:, :, None] + zeros[:, :, None]).clamp(0, 15)
    return Int4Weight(pack_nibbles(q.view(n, k)), scales.contiguous(), (-zeros * scales).contiguous())


def reference_linear(x: torch.Tensor, weight: Int8Weight | Int4Weight) -> torch.Tensor:
    """The definition: float32 matmul with the dequantized weight, result in x's dtype."""
    return F.linear(x.float(), weight.dequantize(torch.float32)).to(x.dtype)


# ---- int8 activations (``"w8a8"`` / ``"w4a8"``) ----
#
# Each row of x is quantized on its own, per block of ``A8_BLOCK`` consecutive inputs: symmetric,
# scale max|x| / 127 (0 for an all-zero block), q = round_half_even(x * (127 / max|x|)) in
# -127..127, all in float32. The linear is then, per weight group, an exact integer dot product
# of q with the weight integers, scaled in float: for int8 weights
# y[m, n] = sum_b xs[m, b] * ws[n, g(b)] * sum_{k in b} q[m, k] w[n, k]; for int4
# y[m, n] = sum_b xs[m, b] * (ws[n, g(b)] * sum_{k in b} q[m, k] w[n, k] + wo[n, g(b)] * sum_{k in b} q[m, k]).
# A row's result depends on that row alone, so a row computed in a one-row call and inside an
# M-row call is the same number.

A8_BLOCK = 32  # activation inputs per int8 scale; weight groups are multiples of it


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] int8, scales [M, K / A8_BLOCK] float32), as defined above."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // A8_BLOCK, A8_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    nonzero = amax > 0
    # a true division (a Python scalar over a tensor would multiply by the reciprocal instead)
    inv = torch.where(nonzero, torch.full_like(amax, 127.0) / torch.where(nonzero, amax, 1.0), 0.0)
    q = torch.round(blocks * inv[:, :, None]).clamp(-127, 127).to(torch.int8)
    scales = amax / torch.full_like(amax, 127.0)
    return q.view(m, k), scales


def supports_a8(weight: Int8Weight | Int4Weight) -> bool:
    """Whether a weight takes int8 activations: K a multiple of 64, groups a multiple of 32 (int4)
    or 16 (int8: GGUF Q6_K's groups of 16)."""
    n, k = weight.shape if isinstance(weight, Int4Weight) else weight.qweight.shape
    return k % 64 == 0 and weight.group_size % (A8_BLOCK if isinstance(weight, Int4Weight) else 16) == 0


def reference_linear_a8(x: torch.Tensor, weight: Int8Weight | Int4Weight) -> torch.Tensor:
    """The definition of the int8-activation linear (above): integer block sums exact in float64,
    the scaling in float64, the result rounded to float32, then to x's dtype. x: [..., K] -> [..., N]."""
    if not supports_a8(weight):
        raise ValueError("int8 activations need K a multiple of 64 and weight groups a multiple of 32 (int8: 16)")
    int4 = isinstance(weight, Int4Weight)
    n, k = weight.shape if int4 else weight.qweight.shape
    rows = x.reshape(-1, k)
    q, xs = quantize_activations(rows)
    sub = min(weight.group_size, A8_BLOCK)  # inputs of one activation block and one weight group
    nb = k // sub
    w_int = (weight.unpacked() if int4 else weight.qweight).double().view(n, nb, sub)
    qd = q.double().view(-1, nb, sub)
    xsd, ws = xs.double(), weight.scales.double()
    y = torch.zeros(rows.shape[0], n, dtype=torch.float64)
    for b in range(nb):
        a, g = b * sub // A8_BLOCK, b * sub // weight.group_size
        dots = qd[:, b] @ w_int[:, b].T  # [M, N], exact integers
        term = dots * ws[:, g]
        if int4:
            term = term + qd[:, b].sum(-1, keepdim=True) * weight.offsets.double()[:, g]
        y += xsd[:, a:a + 1] * term
    return y.float().view(*x.shape[:-1], n).to(x.dtype)
