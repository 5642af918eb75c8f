"""Module transforms applied after loading (gpt-fast style): forward code has no quant branches.

- ``PackedLinear``: on CPU, bf16 weights pre-packed once into oneDNN's blocked layout, so a
  decode-sized matmul streams the weight at close to memory bandwidth (measured ~1.3-1.5x
  ``F.linear`` at 1-32 rows on the development machine).
- ``Int8Linear``: weight-only int8 with per-output-channel scales; halves the bytes a
  memory-bound step reads. Uses PyTorch's ``_weight_int8pack_mm`` where it exists (measured on
  the development CPU: no faster than packed bf16 at 1 row, slower at 6 rows).
- ``DynamicInt8Linear`` (``"int8_dynamic"``): int8 weights (per-channel) and per-call int8
  activations through PyTorch's fbgemm dynamic-quantized linear; 2-3x faster than packed bf16
  at 1-6 rows on the development CPU. Activation quantization changes numerics more than
  weight-only int8: made for drafts, where it cannot change the output distribution.
- ``Fp8Linear`` (``"fp8"``, ``specdec.layers.fp8``): e4m3 weights with per-output-channel
  scales, through ``torch._scaled_mm`` on GPUs that multiply fp8, dequantised on the fly elsewhere.
``F.linear`` on the original weights stays the reference both are tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.layers.fp8 import Fp8Linear


def _can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)  # [out]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype
        self.register_buffer("weight_int8", torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.use_pack_mm = linear.weight.device.type == "cpu" and hasattr(torch, "_weight_int8pack_mm")

    def dequantized_weight(self) -> torch.Tensor:
        return (self.weight_int8.float() * self.scales.float()[:, None]).to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_pack_mm:
            shape = x.shape
            out = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.weight_int8, self.scales)
            out = out.reshape(*shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.dequantized_weight(), self.bias)


class DynamicInt8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        from torch.ao.nn.quantized.dynamic import Linear as QLinear

        w = linear.weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        self.inner = QLinear(linear.in_features, linear.out_features, bias_=linear.bias is not None, dtype=torch.qint8)
        qweight = torch.quantize_per_channel(w, scales, zero, 0, torch.qint8)
        self.inner.set_weight_bias(qweight, None if linear.bias is None else linear.bias.detach().float())
        self.compute_dtype = linear.weight.dtype
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.float()).to(self.compute_dtype)


QUANTIZATIONS = {"int8": Int8Linear, "int8_dynamic": DynamicInt8Linear, "fp8": Fp8Linear}


def _replace_linears(module: nn.Module, make) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
        else:
            _replace_linears(child, make)


def prepare_for_inference(model: nn.Module, quantization: str | None, device: torch.device) -> nn.Module:
    """Swap linears for their fast inference form. Tied embeddings keep the original weight."""
    dtype = next(model.parameters()).dtype
    if quantization in QUANTIZATIONS:
        if quantization == "int8_dynamic" and device.type != "cpu":
            raise ValueError("quantization 'int8_dynamic' (fbgemm) runs on CPU only; use 'int8' on GPUs")
        _replace_linears(model, QUANTIZATIONS[quantization])
    elif quantization is not None:
        raise ValueError(f"quantization must be None or one of {sorted(QUANTIZATIONS)}, got {quantization!r}")
    elif _can_pack(dtype, device):
        _replace_linears(model, PackedLinear)
    return model
