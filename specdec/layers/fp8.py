"""FP8 (e4m3) weights with per-output-channel scales: a quarter of float32's bytes, half of bf16's.

Two formats share the name e4m3: the OCP one (``torch.float8_e4m3fn``, max 448), which NVIDIA
sm_89 / sm_90 and AMD gfx950 compute with, and AMD gfx942's (MI300X: ``torch.float8_e4m3fnuz``,
max 240, no negative zero). ``fp8_dtype_for`` picks by ``torch.version.hip`` and the device arch.

``Fp8Linear`` runs one of two ways:
- ``torch._scaled_mm`` where the hardware multiplies fp8 (``scaled_mm_supported``): it takes
  fp8 on both sides, so each call also quantises its activations, with one scale per row;
- elsewhere (older GPUs, CPUs) it dequantises the weight on the fly and calls ``F.linear``, which
  keeps the activations exact (weight-only). On CPU this is an emulation for correctness: the
  per-call dequantisation costs more than it saves (``int8`` is the CPU format).
``F.linear`` on ``dequantized_weight()`` is the reference both ways are tested against. Made
for drafts, whose numerics cannot change the output distribution; on a target it changes
outputs (opt-in, as int8).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

_MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale


def _rocm_arch(device: torch.device) -> str:
    return getattr(torch.cuda.get_device_properties(device), "gcnArchName", "").split(":")[0]


def fp8_dtype_for(device: torch.device) -> torch.dtype:
    """The e4m3 format the device computes with (OCP e4m3fn unless it is an MI300-class gfx942)."""
    if device.type == "cuda" and torch.version.hip and _rocm_arch(device) == "gfx942":
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` multiplies fp8 on this device: NVIDIA sm_89+ (Ada, Hopper and
    later), AMD gfx942 / gfx950 (MI300, MI350)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm") or not torch.cuda.is_available():
        return False
    if torch.version.hip:
        return _rocm_arch(device) in ("gfx942", "gfx950")
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_rows(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric e4m3: (values [M, K] fp8, scales [M, 1] float32), x ~ values * scales."""
    fmax = torch.finfo(fp8_dtype).max
    x = x.float()
    scales = (x.abs().amax(dim=-1, keepdim=True) / fmax).clamp(min=_MIN_SCALE)
    return (x / scales).clamp(-fmax, fmax).to(fp8_dtype), scales


class Fp8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, fp8_dtype: torch.dtype | None = None, use_scaled_mm: bool | None = None):
        super().__init__()
        device = linear.weight.device
        self.fp8_dtype = fp8_dtype_for(device) if fp8_dtype is None else fp8_dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype
        weight, scales = quantize_rows(linear.weight.detach(), self.fp8_dtype)
        self.register_buffer("weight_fp8", weight)  # [out, in]
        self.register_buffer("scales", scales.view(-1))  # [out] float32
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        if use_scaled_mm is None:
            # _scaled_mm wants both inner and outer sizes in multiples of 16
            use_scaled_mm = scaled_mm_supported(device) and self.in_features % 16 == 0 \
                and self.out_features % 16 == 0
        self.use_scaled_mm = use_scaled_mm

    def dequantized_weight(self) -> torch.Tensor:  # [out, in] compute dtype
        return (self.weight_fp8.float() * self.scales[:, None]).to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_scaled_mm:
            try:
                return self._scaled_forward(x)
            except (RuntimeError, NotImplementedError, ValueError) as e:  # no row-wise fp8 in this build or device
                warnings.warn(f"Fp8Linear: torch._scaled_mm failed ({str(e).splitlines()[0][:200]}); "
                              f"dequantising the weights instead", stacklevel=2)
                self.use_scaled_mm = False
        return F.linear(x, self.dequantized_weight(), self.bias)

    def _scaled_forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        values, row_scales = quantize_rows(x.reshape(-1, shape[-1]), self.fp8_dtype)
        # row-wise scales: CUDA's _scaled_mm writes only bf16 for them
        out = torch._scaled_mm(values, self.weight_fp8.t(), scale_a=row_scales, scale_b=self.scales[None, :],
                               out_dtype=torch.bfloat16)
        out = out.to(self.compute_dtype).reshape(*shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias
