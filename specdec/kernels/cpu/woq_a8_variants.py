"""The int8-activation kernel's variants: other instruction sequences for ``woq_cpu.linear_a8``
(``csrc/woq_a8_variants.h``), each equal to it bit for bit, so the engine may run a different one at
each row count (``layers.cpu_kernel_choice.a8_variant_plan`` measures which is fastest here).

=================  =======  ====================================================================
variant            formats  how a unit's integer sums are made
=================  =======  ====================================================================
``vnni512``        both     512-bit vpdpbusd, one broadcast instruction per row and vector
                            (``a8_linear``; the AVX2 build's kernel is named ``avx2``)
``vnni512-bcast``  int4     512-bit vpdpbusd reading each row's activation word as its own
                            broadcast memory operand
``vnni256``        both     256-bit vpdpbusd (AVX-512 VL), each 16-output block as two halves:
                            for CPUs that issue 512-bit operations as two 256-bit ones (Zen 4)
``bf16``           int4     nibbles widened to bf16 in registers, vdpbf16ps (avx512_bf16)
``amx``            both     AMX tiles (``amx_cpu.extension_a8``; timed by ``a8_amx_min_rows``)
=================  =======  ====================================================================

``SPECDEC_A8_KERNEL=<variant>`` forces one variant at every row count for the formats it takes
(the others keep the default): for tests and the kernel survey.
"""
from __future__ import annotations

import os

import torch

from specdec.kernels.cpu import amx_cpu, cpp_build, woq_cpu

FORCE_ENV = "SPECDEC_A8_KERNEL"
DEFAULT = "vnni512"
# variant -> (op of the int8-activation extension, whether it takes int8 weights, CPU flags it needs)
VARIANTS = {
    "vnni512": ("a8_linear", True, ()),
    "vnni512-bcast": ("a8_linear_vnni512_bcast", False, ()),
    "vnni256": ("a8_linear_vnni256", True, ()),
    "bf16": ("a8_linear_bf16", False, ("avx512_bf16",)),
}
AMX = "amx"


def default_variant() -> str:
    """The variant ``woq_cpu.linear_a8`` runs: ``vnni512`` (``avx2`` in the AVX2 build)."""
    return DEFAULT if woq_cpu.build_args(None, a8=True)[0] == "avx512" else "avx2"


def variant_ops(int4: bool, amx: bool = True) -> dict[str, object]:
    """name -> op ``(x, *woq_cpu.a8_kernel_args(weight), bias) -> y`` of every variant that runs a
    w4a8 (``int4``) or w8a8 weight here, the default first (``amx``: with the AMX path where it runs);
    empty where the kernel does not run."""
    ops = woq_cpu.extension_a8()
    if ops is None:
        return {}
    out = {default_variant(): ops.a8_linear.default}
    flags = cpp_build.cpu_flags()
    for name, (op, takes_int8, needs) in VARIANTS.items():
        if name != DEFAULT and (int4 or takes_int8) and set(needs) <= flags and hasattr(ops, op):
            out[name] = getattr(ops, op).default
    amx_ops = amx_cpu.extension_a8() if amx else None
    if amx_ops is not None:
        out[AMX] = amx_ops.a8_linear_amx.default
    return out


def forced_variant() -> str | None:
    """``$SPECDEC_A8_KERNEL`` (None where unset); a name that no CPU has raises, naming the choices."""
    name = os.environ.get(FORCE_ENV) or None
    known = {*VARIANTS, AMX, "avx2"}
    if name is not None and name not in known:
        raise ValueError(f"{FORCE_ENV}={name!r}: must be one of {sorted(known)}")
    return name


def linear_a8_variant(x: torch.Tensor, weight: woq_cpu.A8Weight, variant: str,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``woq_cpu.linear_a8(x, weight, bias)`` through ``variant`` (the same values bit for bit); a
    variant that does not run here for this format raises, naming those that do."""
    ops = variant_ops(weight.int4)
    if variant not in ops:
        raise ValueError(f"a8 kernel variant {variant!r} does not run {'w4a8' if weight.int4 else 'w8a8'} "
                         f"here; this CPU runs {sorted(ops)}")
    return ops[variant](x, *woq_cpu.a8_kernel_args(weight), bias)
