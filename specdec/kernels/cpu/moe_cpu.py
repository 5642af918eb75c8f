"""A mixture-of-experts layer of int8-activation experts (w4a8 / w8a8) in one C++ call
(``csrc/moe_cpu.cpp``: ``moe_a8``), built on first use like the other CPU kernels.

The experts' gate_up and down weights are stacked once (``stack_a8``: [E, ...] tensors of
``woq_cpu.A8Weight``'s layout and one scale form for all experts), and ``moe_a8(x, ids, weights,
gate_up, down)`` runs the layer: pairs grouped by expert, each touched expert's gate_up, SiLU-mul
and down through the int8-activation kernel's own tiles, outputs scaled by their routing weights and
summed in increasing expert id. The result equals ``layers.moe.grouped_experts`` over the per-expert
linears bit for bit (the same products and sums in the same order); ``layers.moe.reference_moe``
(each pair alone, in torch around the same linears) is the oracle both are tested against.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from specdec.kernels.cpu import amx_cpu, cpp_build, woq_cpu
from specdec.kernels.cpu.woq_cpu import A8Weight, block_rows, compact_scales, pad_rows

DISABLE_ENV = "SPECDEC_DISABLE_MOE_KERNEL"  # run MoE layers expert by expert (layers.moe.grouped_experts)
_NONE = torch.empty(0)


def extension(isa: str | None = None):
    """``torch.ops.specdec_moe_<isa>`` (``moe_a8``; ``isa``: see ``woq_cpu.build_args``) once built, with
    the AMX path where the int8-activation kernel's AMX build runs here; or None (after one warning)."""
    isa, flags, needs = woq_cpu.build_args(isa, a8=True)
    amx = isa == "avx512" and amx_cpu.extension_a8() is not None
    if amx:
        flags, needs = tuple(dict.fromkeys(flags + amx_cpu.A8_FLAGS)), tuple(dict.fromkeys(needs + amx_cpu.A8_NEEDS))
    return _load(isa + ("_amx" if amx else ""), flags, needs)


@functools.lru_cache(maxsize=None)
def _load(variant: str, flags: tuple[str, ...], needs: tuple[str, ...]):
    ns = f"specdec_moe_{variant}"
    return cpp_build.load_ops(ns, "moe_cpu.cpp", ns, ["-O3", *flags, f"-DSPECDEC_LIB={ns}"], needs=needs,
                              what="the CPU MoE kernel", disable_env=DISABLE_ENV,
                              fallback="MoE layers run expert by expert")


def has_amx(ops) -> bool:
    """Whether ``ops`` (an ``extension()``) was built with the AMX path."""
    return hasattr(ops, "a8_linear_amx")


@dataclass
class StackedA8:
    """One linear of every expert, stacked: ``weight`` [E, N padded to 16, K (int8) or K / 2 (int4)],
    ``scales`` / ``offsets`` [E, N padded, K / G] in one compact form (``woq_cpu.compact_scales``,
    stored per block), ``scale_factors`` / ``offset_factors`` [E, N padded, K / 256] for the two-level
    form (else None)."""
    weight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    scale_factors: torch.Tensor | None
    offset_factors: torch.Tensor | None
    in_features: int
    out_features: int

    @property
    def int4(self) -> bool:
        return self.offsets is not None

    def kernel_args(self) -> tuple:
        """(weight, scales, offsets, scale factors, offset factors) as ``moe_a8`` takes them."""
        def some(t):
            return _NONE if t is None else t
        return (self.weight, self.scales, some(self.offsets), some(self.scale_factors), some(self.offset_factors))

    def expert(self, e: int) -> tuple:
        """Expert ``e``'s kernel tensors (weight, scales, offsets, scale factors, offset factors; None where
        unused), views of the stacked ones."""
        return tuple(None if t is None else t[e] for t in (self.weight, self.scales, self.offsets,
                                                           self.scale_factors, self.offset_factors))


def _blocked(form: tuple | None) -> tuple | None:
    return None if form is None else tuple(None if t is None else block_rows(pad_rows(t)) for t in form)


def _float32_forms(w: A8Weight) -> A8Weight:
    return A8Weight(w.weight, w.scales, w.offsets, _blocked((w.scales, None)),
                    _blocked((w.offsets, None)) if w.int4 else None)


def _two_level_forms(w: A8Weight) -> A8Weight:
    """``w`` with its scales (and offsets) as int8 codes times super-block factors where both take that
    form exactly, else float32: the same values in other bytes."""
    g = w.in_features // w.scales.shape[1]
    scales = compact_scales(w.scales, g, half=False)
    offsets = compact_scales(w.offsets, g, half=False) if w.int4 else None
    if scales[1] is None or offsets is not None and offsets[1] is None:
        return _float32_forms(w)
    return A8Weight(w.weight, w.scales, w.offsets, _blocked(scales), _blocked(offsets))


def _form_key(w: A8Weight) -> tuple:
    tensors = (*w.kernel_scales, *(w.kernel_offsets or (None, None)))
    return tuple(None if t is None else (t.dtype, tuple(t.shape)) for t in tensors)


def _one_form(weights: list[A8Weight]) -> list[A8Weight]:
    """The weights with their scales in one form: theirs where they share it, else the two-level form
    where every expert takes it, else float32."""
    weights = [w if w.kernel_scales is not None else _float32_forms(w) for w in weights]
    if len({_form_key(w) for w in weights}) == 1:
        return weights
    two_level = [_two_level_forms(w) for w in weights]
    if len({_form_key(w) for w in two_level}) == 1:
        return two_level
    return [_float32_forms(w) for w in weights]


def stack_a8(weights: list[A8Weight]) -> StackedA8 | None:
    """The experts' weights stacked (a copy) with their scales in one form (``_one_form``); None where the
    experts differ in format or shape."""
    first = weights[0]
    if any(w.int4 != first.int4 or w.weight.shape != first.weight.shape or w.scales.shape != first.scales.shape
           for w in weights):
        return None
    weights = _one_form(weights)

    def stacked(form: str, i: int) -> torch.Tensor | None:
        parts = [None if getattr(w, form) is None else getattr(w, form)[i] for w in weights]
        return None if parts[0] is None else torch.stack(parts)
    return StackedA8(torch.stack([w.weight for w in weights]), stacked("kernel_scales", 0),
                     stacked("kernel_offsets", 0), stacked("kernel_scales", 1), stacked("kernel_offsets", 1),
                     first.in_features, first.out_features)


def moe_a8(ops, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, gate_up: StackedA8,
           down: StackedA8, amx_min_rows: tuple[int | None, int | None] = (None, None)) -> tuple[torch.Tensor, int]:
    """sum_j weights[t, j] * down(silu_mul(gate_up(x[t]))) of expert expert_ids[t, j], for x [T, H] float32,
    expert_ids [T, k] int64, weights [T, k] float32 -> (out [T, H] float32, distinct experts read).
    ``amx_min_rows``: (gate_up, down) row counts from which an expert runs the AMX tiles (None: never)."""
    return ops.moe_a8(x, expert_ids, weights, *gate_up.kernel_args(), *down.kernel_args(),
                      down.in_features, amx_min_rows[0] or 0, amx_min_rows[1] or 0)
