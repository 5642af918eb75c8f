"""Module transforms applied after loading (gpt-fast style): forward code has no quant branches.

- ``PackedLinear``: on CPU, bf16 weights pre-packed once into oneDNN's blocked layout, so a
  decode-sized matmul streams the weight at close to memory bandwidth (faster than ``F.linear``
  at 1-32 rows).
- ``Bf16WeightLinear``: on CPUs without bf16 arithmetic, where ``dtype="auto"`` is float32, the
  linears of a bf16 checkpoint keep their bf16 weights and multiply in float32
  (``woq_cpu.bf16_linear``): the values a float32 copy holds, half its bytes per decode step.
  A bf16 model (or one widened to float32 around its linears) takes it instead of ``PackedLinear``
  where it streams a weight at one row about as fast or faster (``bf16_kernel_faster``: timed once
  per process on rotating copies of one weight); with avx512_bf16 it then runs bf16 dot products on
  a weight kept in pair layout (``woq_cpu.bf16_pairs_linear``), or AMX tiles on the same layout where
  they are measured faster (``cpu_kernel_choice.bf16_amx_faster``: up to 16 rows per pass over the weight).
- ``WeightOnlyLinear`` (``"int8"``: symmetric per output channel; ``"int4"``: scale and
  offset per group of 128 inputs, LM head at int8): the weight stays quantized in memory, so a
  memory-bound step reads about a quarter (int8) or an eighth (int4) of float32's bytes; the CPU
  kernel dequantises it in registers and multiplies in float32 (``specdec.kernels.cpu.woq_cpu``). GGUF Q8_0, Q5_0,
  Q6_K, Q4_0, Q4_1 and Q4_K tensors load straight into this layer (``specdec.models.gguf_quant``;
  ``PartsLinear`` for a fused q/k/v whose parts differ in format). The quantized weights *are* the
  target: speculation is lossless with respect to them.
- ``"w8a8"`` / ``"w4a8"``: the same layers and weights with ``int8_activations``: each row of x
  is quantized to int8 per block of 32 inputs and multiplied with integer dot products
  (``woq_format.reference_linear_a8``; the CPU kernel ``woq_cpu.linear_a8``). A row's result
  depends on that row alone, bit for bit, and the rest of the forward computes a row the same
  way in a one-row decode and in a K+1-row verification (``tests/models/test_row_consistency.py``),
  so the int8 step function sees the same input in both and speculation stays lossless. A layer
  whose shape the format does not take (in_features not a multiple of 64) stays weight-only. Each row
  count runs the kernel variant measured fastest here (``cpu_kernel_choice.a8_row_ops``: 512- or
  256-bit VNNI, bf16 dot products, AMX tiles; the same values bit for bit).
- ``DynamicInt8Linear`` (``"int8_dynamic"``): int8 weights (per-channel) and per-call int8
  activations through PyTorch's fbgemm dynamic-quantized linear; 2-3x faster than packed bf16
  at 1-6 rows on the development CPU. Activation quantization changes numerics more than
  weight-only int8: made for drafts, where it cannot change the output distribution.
- ``Fp8Linear`` (``"fp8"``, ``specdec.layers.fp8``): e4m3 weights with per-output-channel
  scales, through ``torch._scaled_mm`` on GPUs that multiply fp8, dequantised on the fly elsewhere.
``F.linear`` on the original weights stays the reference both are tested against.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specdec.config import INTEGER_QUANTIZATIONS, LM_HEAD_QUANTIZATIONS
from specdec.kernels.cpu import amx_cpu, woq_cpu
from specdec.kernels.cpu.woq_format import (
    Int4Weight,
    Int8Weight,
    quantize_int4,
    quantize_int8,
    supports_a8,
)
from specdec.layers import cpu_kernel_choice
from specdec.layers.fp8 import Fp8Linear

INT4_GROUP_SIZE = 128  # inputs per int4 scale / offset: 4.5 bits per weight with float32 scales


def _can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and _onednn_packs_bf16()


@functools.lru_cache(maxsize=1)
def _onednn_packs_bf16() -> bool:
    """Whether oneDNN packs bf16 linear weights on this CPU (it refuses where the CPU has neither
    AVX-512 BW/VL/DQ nor AVX-NE-CONVERT): asked once on a tiny weight."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def bound_once(module: nn.Module, key: str, buffer: torch.Tensor, make):
    """``make()`` once per tensor of ``buffer``, kept in ``module.__dict__[key]``: a layer's kernel op and
    arguments bound once (per call, finding them costs more Python than the kernel at batch 1), made
    again when the buffer is a new tensor (``.to()``, a copied module: the id differs)."""
    cached = module.__dict__.get(key)
    if cached is not None and cached[0] == id(buffer):
        return cached[1]
    value = make()
    module.__dict__[key] = (id(buffer), value, buffer)  # the buffer kept alive: its id stays its own
    return value


class _A8Plan(NamedTuple):
    """How ``WeightOnlyLinear`` runs an int8-activation call of m rows: ``ops[min(m, len(ops) - 1)](x, *args)``."""
    ops: tuple  # the op for a call of m rows at index m (one entry: every row count)
    in_features: int
    args: tuple  # the op's arguments after x: the weight's tensors, K, N, bias


class _Bf16Plan(NamedTuple):
    """How ``Bf16WeightLinear`` runs a call: the bound kernel (None where it does not run) and the most
    inputs it takes (None: any number)."""
    kernel: Callable[[torch.Tensor], torch.Tensor] | None
    kernel_max_inputs: int | None


class Bf16WeightLinear(nn.Module):
    """A linear whose weight is kept in bf16: in a float32 model, half the bytes a memory-bound step
    reads, made only from weights bf16 holds exactly (a bf16 checkpoint loaded as float32) unless asked
    to round; in a bf16 model, where it streams faster than ``PackedLinear`` (``bf16_kernel_faster``).

    Made from a bf16 linear (a bf16 model, or one whose other layers are widened to float32) on a CPU
    with bf16 dot products (avx512_bf16), the weight is kept in pair layout (``woq_cpu.pack_bf16_pairs``;
    ``pairs`` True) and every call runs ``woq_cpu.bf16_pairs_linear``: activations rounded to bf16,
    products summed in float32, as a bf16 model's linears compute, a row's result the same whatever
    the call's row count. Otherwise (a float32 linear: its float32 values are kept) the weight keeps
    its [N, K] layout and ``woq_cpu.bf16_linear`` multiplies in float32 (the values a float32 copy
    gives), past ``BF16_KERNEL_MAX_ROWS`` rows as a float32 GEMM on a widened copy."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.pairs = (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
                      and woq_cpu.supports_pairs(*weight.shape) and woq_cpu.bf16_pairs_available())
        weight = weight.to(torch.bfloat16).contiguous()
        self.register_buffer("weight_bf16", woq_cpu.pack_bf16_pairs(weight) if self.pairs else weight)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight, [N, K] float32."""
        weight = self.weight_bf16
        return (woq_cpu.unpack_bf16_pairs(weight) if self.pairs else weight).float()

    def _plan(self) -> _Bf16Plan:
        return bound_once(self, "_plan_cached", self._buffers["weight_bf16"], self._make_plan)

    def _make_plan(self) -> _Bf16Plan:
        weight, bias = self._buffers["weight_bf16"], self.bias
        ops = woq_cpu.extension() if weight.device.type == "cpu" and self.in_features % 32 == 0 else None
        if ops is None:
            return _Bf16Plan(None, 0)
        if self.pairs:
            amx = amx_cpu.extension() if cpu_kernel_choice.bf16_amx_faster() else None
            op = amx.amx_bf16_linear.default if amx is not None else ops.bf16_pairs_linear.default
            return _Bf16Plan(lambda x: op(x, weight, bias), None)  # noqa: E731
        op = ops.bf16_linear.default
        return _Bf16Plan(lambda x: op(x, weight, bias), woq_cpu.BF16_KERNEL_MAX_ROWS * self.in_features)  # noqa: E731

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # a step where no row reaches this layer (the AMX kernel needs a row)
            return x.new_empty(*x.shape[:-1], self.out_features)
        plan = self._plan()
        if plan.kernel is not None and (plan.kernel_max_inputs is None or x.numel() <= plan.kernel_max_inputs):
            return plan.kernel(x)
        if self.pairs:  # off the kernel (another device, kernels disabled): the same values through F.linear
            return woq_cpu.bf16_pairs_linear(x, self.weight_bf16, self.bias)
        if x.dtype == torch.bfloat16:
            return F.linear(x, self.weight_bf16, self.bias)
        return woq_cpu.bf16_linear(x, self.weight_bf16, self.bias)  # past the kernel's rows: float32 GEMM

    def extra_repr(self) -> str:
        amx = ", AMX" if self.pairs and cpu_kernel_choice.bf16_amx_faster() else ""
        layout = f", pair layout{amx}" if self.pairs else ""
        return f"bf16 weight{layout}, in={self.in_features}, out={self.out_features}"


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether bf16 holds every value of this float32 weight (a bf16 checkpoint loaded as float32)."""
    step = 1 << 22  # elements per slice: no full-size temporary
    flat = weight.detach().reshape(-1)
    return all(torch.equal(flat[i:i + step].to(torch.bfloat16).float(), flat[i:i + step])
               for i in range(0, flat.numel(), step))


@functools.lru_cache(maxsize=1)
def bf16_kernel_faster() -> bool:
    """Whether ``Bf16WeightLinear`` (its kernel: ``bf16_pairs_linear`` where the CPU has bf16 dot
    products, else ``bf16_linear``) streams a bf16 weight at one row within 10% of oneDNN's packed
    bf16 linear here, or faster: each timed on 4 copies of a bf16 [4096, 2048] weight taken in turn
    (64 MB: no copy stays in cache), the two alternating over 5 passes of 8 calls, best pass each.
    Measured rather than assumed: which one streams faster depends on the CPU (how it runs 512-bit
    operations, its prefetchers). Near-ties go to the kernel: its engine also brings float32
    activations, the fused float32 ops and the row-by-row attention kernel, and a threshold that
    sits on the tie would pick a different engine from one process to the next."""
    if not (woq_cpu.available() and _onednn_packs_bf16()):
        return False
    linears = [nn.Linear(2048, 4096, bias=False, dtype=torch.bfloat16) for _ in range(4)]
    for lin in linears:
        nn.init.constant_(lin.weight, 0.01)
    layers = [Bf16WeightLinear(lin) for lin in linears]
    packed = [torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 1) for lin in linears]
    x = torch.randn(1, 2048).to(torch.bfloat16)
    calls = {"kernel": lambda i: layers[i](x),
             "onednn": lambda i: torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], "")}
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(5):
        for name, call in calls.items():
            start = time.perf_counter()
            for i in range(8):
                call(i % 4)
            best[name] = min(best[name], time.perf_counter() - start)
    return best["kernel"] < 1.1 * best["onednn"]


class WeightOnlyLinear(nn.Module):
    """``x @ dequant(W).T + b`` for an ``Int8Weight`` / ``Int4Weight`` (``specdec.kernels.cpu.woq_format``).

    On CPU the AVX-512 / AVX2 kernel (``specdec.kernels.cpu.woq_cpu``) runs it in float32 arithmetic with the
    weight dequantised in registers; elsewhere, or without the kernel, the reference (dequantise,
    then ``F.linear``). The quantized tensors are buffers, so ``.to(device)`` moves them.
    """

    def __init__(self, weight: Int8Weight | Int4Weight, bias: torch.Tensor | None, compute_dtype: torch.dtype,
                 int8_activations: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight_shape(weight)
        self.compute_dtype = compute_dtype
        self.int4 = isinstance(weight, Int4Weight)
        # int8 activations (module docstring): the integers are kept in the VNNI kernel's order only
        self.int8_activations = int8_activations and supports_a8(weight)
        if self.int8_activations:
            a8 = woq_cpu.A8Weight.prepare(weight)
            self.register_buffer("a8_layout", a8.weight)
            # the compact scales the kernel reads (the same values as ``scales`` / ``offsets``)
            self.register_buffer("a8_scales", a8.kernel_scales[0])
            self.register_buffer("a8_scale_factors", a8.kernel_scales[1])
            self.register_buffer("a8_offsets", a8.kernel_offsets[0] if self.int4 else None)
            self.register_buffer("a8_offset_factors", a8.kernel_offsets[1] if self.int4 else None)
        elif self.int4:
            self.register_buffer("packed", weight.packed)
        else:
            self.register_buffer("weight_int8", weight.qweight)
        if self.int4:
            self.register_buffer("offsets", weight.offsets)
        self.register_buffer("scales", weight.scales)
        # a parameter, as nn.Linear's: checkpoint loaders fill biases by parameter name
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def a8_weight(self) -> woq_cpu.A8Weight:
        return woq_cpu.A8Weight(self.a8_layout, self.scales, self.offsets if self.int4 else None,
                                (self.a8_scales, self.a8_scale_factors),
                                (self.a8_offsets, self.a8_offset_factors) if self.int4 else None)

    def quantized_weight(self) -> Int8Weight | Int4Weight:
        if self.int8_activations:
            return self.a8_weight().source()
        if self.int4:
            return Int4Weight(self.packed, self.scales, self.offsets)
        return Int8Weight(self.weight_int8, self.scales)

    def dequantized_weight(self) -> torch.Tensor:
        return self.quantized_weight().dequantize(self.compute_dtype)

    def _make_a8_plan(self) -> _A8Plan:
        """The kernel's op per row count and its arguments, gathered once per buffer tensor by
        ``forward`` (per call they cost more Python than the kernel call itself at batch 1)."""
        weight, bias = self.a8_weight(), self.bias
        ops = woq_cpu.extension_a8() if self._buffers["a8_layout"].device.type == "cpu" else None
        if ops is None:  # the reference off CPU
            return _A8Plan((lambda x: woq_cpu.linear_a8(x, weight, bias),), self.in_features, ())
        # the variant measured fastest at each row count (AMX among them): the same values bit for bit
        by_rows = cpu_kernel_choice.a8_row_ops(self.int4)
        if len(set(by_rows)) == 1:
            by_rows = by_rows[:1]
        return _A8Plan(tuple(by_rows), self.in_features, (*woq_cpu.a8_kernel_args(weight), bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8_activations:
            ops, in_features, args = bound_once(self, "_a8_cached", self._buffers["a8_layout"], self._make_a8_plan)
            return ops[min(x.numel() // in_features, len(ops) - 1)](x, *args)
        elif x.device.type == "cpu":
            out = woq_cpu.linear(x, self.quantized_weight())
        else:
            out = F.linear(x, self.dequantized_weight().to(x.dtype))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        kind = ("int4" if self.int4 else "int8") + (", int8 activations" if self.int8_activations else "")
        return f"{kind}, in={self.in_features}, out={self.out_features}, group={self.in_features // self.scales.shape[1]}"


class PartsLinear(nn.Module):
    """A fused linear whose row blocks are in different quantized formats (a GGUF Q4_K_M q/k/v:
    Q4_K q and k, Q6_K v): one ``WeightOnlyLinear`` per part, outputs concatenated."""

    def __init__(self, parts: tuple, bias: torch.Tensor | None, compute_dtype: torch.dtype,
                 int8_activations: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight_shape(parts)
        self.parts = nn.ModuleList(WeightOnlyLinear(p, None, compute_dtype, int8_activations) for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def dequantized_weight(self) -> torch.Tensor:
        return torch.cat([p.dequantized_weight() for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([p(x) for p in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias


def weight_shape(weight: Int8Weight | Int4Weight | tuple) -> tuple[int, int]:
    if isinstance(weight, tuple):
        shapes = [weight_shape(p) for p in weight]
        return sum(n for n, _ in shapes), shapes[0][1]
    return tuple(weight.shape) if isinstance(weight, Int4Weight) else tuple(weight.qweight.shape)


def _bias(linear: nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().clone()


def Int8Linear(linear: nn.Linear, group_size: int | None = None, int8_activations: bool = False) -> WeightOnlyLinear:
    """Weight-only int8, one symmetric scale per output channel (or per ``group_size`` inputs)."""
    weight = quantize_int8(linear.weight, group_size)
    return WeightOnlyLinear(weight, _bias(linear), linear.weight.dtype, int8_activations).to(linear.weight.device)


def Int4Linear(linear: nn.Linear, group_size: int = INT4_GROUP_SIZE, int8_activations: bool = False) -> WeightOnlyLinear:
    """Weight-only int4 with a scale and offset per group of inputs: ``group_size``, or the
    largest of its halves (down to 32) that divides in_features; int8 per channel if none does."""
    group = group_size
    while linear.in_features % group and group > 32:
        group //= 2
    if linear.in_features % group or group % 32:
        return Int8Linear(linear, int8_activations=int8_activations)
    weight = quantize_int4(linear.weight, group)
    return WeightOnlyLinear(weight, _bias(linear), linear.weight.dtype, int8_activations).to(linear.weight.device)


def W8A8Linear(linear: nn.Linear) -> WeightOnlyLinear:
    return Int8Linear(linear, int8_activations=True)


def W4A8Linear(linear: nn.Linear) -> WeightOnlyLinear:
    return Int4Linear(linear, int8_activations=True)


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


QUANTIZATIONS = {"int8": Int8Linear, "int4": Int4Linear, "w8a8": W8A8Linear, "w4a8": W4A8Linear,
                 "int8_dynamic": DynamicInt8Linear, "fp8": Fp8Linear}
# int4 keeps the LM head at int8, as llama.cpp's Q4 mixes keep output.weight at 6-8 bits
_LM_HEAD_QUANTIZATION = {"int4": Int8Linear, "w4a8": W8A8Linear}
# an LM head in a chosen weight format ("int8" / "int4"), with the int8 activations of its model's
# format where it has them: (head format, int8 activations) -> layer
_LM_HEAD_FORMATS = {("int8", False): Int8Linear, ("int4", False): Int4Linear,
                    ("int8", True): W8A8Linear, ("int4", True): W4A8Linear}
_CPU_ONLY = ("int8_dynamic", "w8a8", "w4a8")


def lm_head_linear(quantization: str | None, lm_head_quantization: str | None = None):
    """The constructor of a model's LM head under ``quantization``: ``lm_head_quantization``'s weight
    format ("int8" / "int4") where given, else the format's default (None: the body's own layer)."""
    if lm_head_quantization is None:
        return _LM_HEAD_QUANTIZATION.get(quantization)
    if lm_head_quantization not in LM_HEAD_QUANTIZATIONS:
        raise ValueError(f"lm_head_quantization must be None or one of {LM_HEAD_QUANTIZATIONS}, "
                         f"got {lm_head_quantization!r}")
    if quantization not in INTEGER_QUANTIZATIONS:
        raise ValueError(f"lm_head_quantization {lm_head_quantization!r} needs quantization one of "
                         f"{INTEGER_QUANTIZATIONS}, got {quantization!r}")
    return _LM_HEAD_FORMATS[(lm_head_quantization, quantization in ("w8a8", "w4a8"))]


def _replace_linears(module: nn.Module, make, lm_head_make=None, prefix: str = "") -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            is_head = f"{prefix}{name}" == "lm_head"
            setattr(module, name, (lm_head_make or make)(child) if is_head else make(child))
        else:
            _replace_linears(child, make, lm_head_make, f"{prefix}{name}.")


def _with_int8_activations(module: nn.Module) -> None:
    """Kept-quantized layers (a GGUF's) -> the same weights with int8 activations (w8a8 / w4a8)."""
    for name, child in module.named_children():
        if isinstance(child, WeightOnlyLinear) and not child.int8_activations:
            bias = None if child.bias is None else child.bias.detach()
            setattr(module, name, WeightOnlyLinear(child.quantized_weight(), bias, child.compute_dtype, True))
        elif isinstance(child, PartsLinear):
            parts = tuple(p.quantized_weight() for p in child.parts)
            bias = None if child.bias is None else child.bias.detach()
            setattr(module, name, PartsLinear(parts, bias, child.parts[0].compute_dtype, True))
        else:
            _with_int8_activations(child)


def prepare_for_inference(model: nn.Module, quantization: str | None, device: torch.device,
                          bf16_weights: str | None = None, lm_head_quantization: str | None = None) -> nn.Module:
    """Swap linears for their fast inference form. Tied embeddings keep the original weight.
    Layers already quantized (a GGUF's kept weights) keep their weights; ``w8a8`` / ``w4a8`` give
    them int8 activations. ``bf16_weights`` (a float32 model on CPU, no quantization): ``"exact"``
    keeps in bf16 the linears bf16 holds exactly, ``"round"`` rounds every linear to bf16
    (``Bf16WeightLinear``); given a bf16 model, its linears keep their bf16 weights and the rest is
    widened to float32 (``widen_to_float32``): a float32 model without a float32 copy of the weights
    ever being made. ``lm_head_quantization`` (an integer ``quantization`` only): the LM head's weight
    format, "int8" or "int4" (``lm_head_linear``; None: int8 for int4 / w4a8)."""
    dtype = next(model.parameters()).dtype
    if quantization is None and device.type == "cuda":  # float experts: the Triton fused-MoE kernel
        from specdec.layers.moe import fuse_experts

        fuse_experts(model)
    make_lm_head = lm_head_linear(quantization, lm_head_quantization)  # raises where it cannot apply
    if quantization in QUANTIZATIONS:
        if quantization in _CPU_ONLY and device.type != "cpu":
            raise ValueError(f"quantization {quantization!r} runs on CPU only; use 'int8' / 'int4' on GPUs")
        _replace_linears(model, QUANTIZATIONS[quantization], make_lm_head)
        if quantization in ("w8a8", "w4a8"):
            _with_int8_activations(model)
            if device.type == "cpu":  # mixture-of-experts layers: one C++ call per layer
                from specdec.layers.moe_a8 import fuse_a8_experts

                fuse_a8_experts(model)
    elif quantization is not None:
        raise ValueError(f"quantization must be None or one of {sorted(QUANTIZATIONS)}, got {quantization!r}")
    elif bf16_weights and dtype in (torch.float32, torch.bfloat16) and device.type == "cpu" and woq_cpu.available():
        _replace_linears(model, lambda lin: Bf16WeightLinear(lin) if (
            bf16_weights == "round" or dtype == torch.bfloat16 or bf16_exact(lin.weight)) and lin.in_features % 32 == 0
            else lin)
        if dtype == torch.bfloat16:
            widen_to_float32(model)
    elif _can_pack(dtype, device):
        fast = bf16_kernel_faster()
        _replace_linears(model, lambda lin: Bf16WeightLinear(lin) if fast and lin.in_features % 32 == 0
                         else PackedLinear(lin))
    return model


def widen_to_float32(model: nn.Module) -> None:
    """Every floating parameter and buffer of ``model`` outside its ``Bf16WeightLinear`` weights
    (norms, embeddings, biases, rotary tables, linears left as they were) in float32, in place
    (parameters keep their identity, so modules sharing one see the change): a bf16-loaded model
    whose linears keep bf16 weights then computes in float32."""
    kept = {id(m.weight_bf16) for m in model.modules() if isinstance(m, Bf16WeightLinear)}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != torch.float32 and id(param) not in kept:
                param.data = param.data.float()
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32 and id(buf) not in kept:
                module._buffers[name] = buf.float()
