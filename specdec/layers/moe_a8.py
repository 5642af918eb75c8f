"""A ``SparseMoE`` whose int8-activation experts (w4a8 / w8a8) run in one C++ call per layer on CPU.

``fuse_a8_experts`` (applied by ``prepare_for_inference`` after the w4a8 / w8a8 transform) replaces
every ``SparseMoE`` whose experts are plain SwiGLU ``Expert``s with bias-free int8-activation
``WeightOnlyLinear``s by an ``A8FusedMoE``: each of its linears stacked once over the experts
(``kernels.cpu.moe_cpu.stack_a8``), the experts' own buffers made views of the stacked tensors (no
second copy), and every call ``moe_cpu.moe_a8``: grouping, gate_up, SiLU-mul, down and the weighted
sum in one op, the same values bit for bit as ``grouped_experts`` over the experts (which still run a
call the op does not take: non-float32 activations, kernels disabled).
"""
from __future__ import annotations

import torch
from torch import nn

from specdec.kernels.cpu import moe_cpu
from specdec.layers import cpu_kernel_choice
from specdec.layers.moe import Expert, SparseMoE, grouped_experts, silu_mul
from specdec.layers.quantization import WeightOnlyLinear

_A8_BUFFERS = ("a8_layout", "a8_scales", "a8_offsets", "a8_scale_factors", "a8_offset_factors")


def _a8_linear(linear: nn.Module) -> bool:
    return isinstance(linear, WeightOnlyLinear) and linear.int8_activations and linear.bias is None


def fusable_a8(moe: SparseMoE) -> bool:
    """Whether ``moe``'s experts take the one-call kernel: SwiGLU ``Expert``s on CPU, both linears
    bias-free int8-activation layers, one format and shape per linear across the experts."""
    experts = list(moe.experts)
    if not all(isinstance(e, Expert) and e.activation is silu_mul and _a8_linear(e.gate_up_proj)
               and _a8_linear(e.down_proj) for e in experts):
        return False
    first = experts[0]
    return (first.gate_up_proj.a8_layout.device.type == "cpu"
            and all(e.gate_up_proj.int4 == first.gate_up_proj.int4 and e.down_proj.int4 == first.down_proj.int4
                    and e.gate_up_proj.a8_layout.shape == first.gate_up_proj.a8_layout.shape
                    and e.down_proj.a8_layout.shape == first.down_proj.a8_layout.shape for e in experts))


def _stack(linears: list[WeightOnlyLinear]) -> moe_cpu.StackedA8 | None:
    """The linears' weights stacked, each linear's kernel buffers then rebound to views of the stack."""
    stacked = moe_cpu.stack_a8([lin.a8_weight() for lin in linears])
    if stacked is None:
        return None
    for e, lin in enumerate(linears):
        for name, view in zip(_A8_BUFFERS, stacked.expert(e)):
            if name != "a8_offsets" or lin.int4:
                lin._buffers[name] = view
        lin.__dict__.pop("_a8_cached", None)  # the bound call holds the old buffers
    return stacked


class A8FusedMoE(nn.Module):
    """Router (``gate``) + experts whose int8-activation weights are stacked for ``moe_cpu.moe_a8``.
    x: [T, H] -> [T, H]."""

    def __init__(self, moe: SparseMoE, gate_up: moe_cpu.StackedA8, down: moe_cpu.StackedA8):
        super().__init__()
        self.gate = moe.gate
        self.experts = moe.experts  # their kernel buffers are views of the stacks below
        self.stats = moe.stats
        self.gate_up, self.down = gate_up, down
        self.amx_min_rows = (None, None)
        self._ops = moe_cpu.extension()
        if self._ops is not None and moe_cpu.has_amx(self._ops):
            self.amx_min_rows = (cpu_kernel_choice.a8_amx_min_rows(gate_up.int4),
                                 cpu_kernel_choice.a8_amx_min_rows(down.int4))
        # the op and its weight arguments bound once: per call, gathering them costs more Python than
        # a small layer's kernel time
        self._op = None if self._ops is None else self._ops.moe_a8.default
        self._weight_args = (*gate_up.kernel_args(), *down.kernel_args(), down.in_features,
                             self.amx_min_rows[0] or 0, self.amx_min_rows[1] or 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.gate(x)
        if self._op is None or x.dtype != torch.float32 or routing.weights.dtype != torch.float32:
            return grouped_experts(x, routing, self.experts, self.stats)
        out, touched = self._op(x.contiguous(), routing.expert_ids.contiguous(), routing.weights.contiguous(),
                                *self._weight_args)
        stats = self.stats
        stats.num_calls += 1
        stats.num_experts_read += touched
        stats.num_pairs += routing.expert_ids.numel()
        stats.last_experts_read = touched
        if stats.recording:
            stats.history.append(touched)
        return out

    def unfused(self) -> SparseMoE:
        """The same router and experts as a ``SparseMoE`` (expert by expert; shares the weights)."""
        moe = SparseMoE(self.gate, list(self.experts))
        moe.stats = self.stats
        return moe

    def extra_repr(self) -> str:
        kinds = ["int4" if s.int4 else "int8" for s in (self.gate_up, self.down)]
        return (f"experts={len(self.experts)}, gate_up {kinds[0]}, down {kinds[1]}, int8 activations, "
                f"one C++ call per layer{'' if self._ops is not None else ' (kernel unavailable)'}")


def fuse_a8_experts(model: nn.Module) -> int:
    """Replace every ``SparseMoE`` of ``model`` whose experts take the kernel (``fusable_a8``) by an
    ``A8FusedMoE`` (in place); -> how many. Nothing where the kernel cannot run here."""
    if moe_cpu.extension() is None:
        return 0
    count = 0
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, SparseMoE) and fusable_a8(child):
                gate_up = _stack([e.gate_up_proj for e in child.experts])
                down = _stack([e.down_proj for e in child.experts])
                if gate_up is not None and down is not None:
                    setattr(module, name, A8FusedMoE(child, gate_up, down))
                    count += 1
    return count
