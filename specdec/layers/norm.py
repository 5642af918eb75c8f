"""RMSNorm with an optional fused residual add (the pre-norm transformer's two hot ops)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.kernels.cpu import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # one fused op (accumulates in float32); the Hugging Face form below is the reference
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        orig_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(orig_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        weight = self.weight
        ops = cpu_ops.ops_for(x, weight) if x.shape[-1] == weight.shape[0] else None  # the fused ops
        if residual is None:
            return ops.rms_norm(x, weight, self.eps) if ops is not None else self._norm(x)
        if ops is not None and residual.dtype == torch.float32:
            out, residual = ops.add_rms_norm(x, residual, weight, self.eps)  # a list: returned as a tuple
            return out, residual
        residual = x + residual
        return self._norm(residual), residual


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from one, ``x_hat * (1 + w)``, and the
    product is taken in float32 before casting back (transformers' Gemma3RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
